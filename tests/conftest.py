import os
import shutil
import sys
from pathlib import Path

import pytest
from filelock import FileLock

# The whole suite runs in the device-faithful CPU mode (megatron_dapo/parallel/device_faithful.py): a host/device
# mix-up fails here as it would on a GPU. Subprocesses (torchrun workers, trainer runs) inherit it.
os.environ.setdefault("MEGATRON_DAPO_DEVICE_FAITHFUL", "1")

# In lanes (`make test`: a pytest-xdist process per core), each lane and every process it starts gets its share of
# the cores in threads. torch's default, a thread per core in each of them, oversubscribes the cores, and OpenMP's
# threads then spin waiting on preempted ones: the demo's warm start took 29 s alone at 2 threads and 164 s beside
# the other lane. (Runs that set their own, like the trainer launches with OMP_NUM_THREADS=1, keep theirs.)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


# tests/gpu/ shares the helpers in this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns several megatron-core processes (minutes on 2 cores)")
    config.addinivalue_line("markers", "smoke: a slow test in `make test-fast`, the one of its kind of integration")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` fills, built once for the whole run: `make test` runs the suite in parallel
    lanes (pytest-xdist processes), and a read-only fixture that takes a minute to build is built by the first
    lane that asks for it while the others wait for it, instead of once per lane."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        root = tmp_path_factory.mktemp(name)
        build(root)
        return root
    root = tmp_path_factory.getbasetemp().parent / name  # the run's folder, above each lane's own
    with FileLock(f"{root}.lock"):
        if not (root / "BUILT").exists():
            shutil.rmtree(root, ignore_errors=True)  # a lane that failed halfway left a part
            root.mkdir()
            build(root)
            (root / "BUILT").touch()
    return root


# The slowest modules first (seconds of a serial run, measured): the parallel lanes take modules in this order,
# so that none starts a long one when the other is nearly done. The rest follow in their own order.
LONGEST_FIRST = ["test_trainer_loop.py", "test_slurm_launch.py", "test_weight_sync.py", "test_gpu_check.py",
                 "test_rollout_resilience.py", "test_rollout_sglang.py", "test_moe_learns.py", "test_moe_sglang.py",
                 "test_repeatable_runs.py",
                 "test_trainer_checkpoint.py", "test_bad_input.py", "test_convert_checkpoint.py",
                 "test_rollout_service.py", "test_ablation_bench.py", "test_chain_task.py",
                 "test_memory_benches.py", "test_policy_parity.py", "test_reward.py", "test_policy_training.py",
                 "test_moe.py", "test_routing_replay.py", "test_moe_rollout.py", "test_local_engine.py",
                 "test_heartbeat.py",
                 "test_tiny_cpu_config.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """Data files and a tiny model warm-started just enough to get some sums right: the trainer runs of
    test_trainer_loop and test_slurm_launch train it. Built once a run; nothing writes into it."""
    return built_once(tmp_path_factory, "task", build_task)


def build_task(root: Path) -> None:
    from megatron_dapo.data.held_out_split import split_held_out
    from megatron_dapo.data.prompt_encoding import encode_prompt
    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.demo.tiny_model import make_tiny_model
    from megatron_dapo.demo.warm_start import supervised_warm_start

    rows = generate_rows(1200, 0, digits=1, operations="+", num_operands=2, style="short")
    train, held_out = split_held_out(rows, 20, 0)
    write_rows(root / "train.jsonl", train)
    write_rows(root / "eval.jsonl", held_out)
    corpus = [r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows]
    tok = make_tiny_model(root / "base", corpus, seed=0, hidden=64, layers=2)
    pairs = [(encode_prompt(tok, r["prompt"]), tok.encode(r["extra_info"]["solution"]) + [tok.eos_token_id])
             for r in train]
    supervised_warm_start(root / "base", root / "model", pairs, target_accuracy=0.2, max_steps=600, batch_size=32)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's task and warm model, made as `megatron-dapo demo` makes them (seed 0): a minute on 2 idle cores.
    test_tiny_cpu_config, test_gpu_check's end-to-end run and test_trainer_loop's bf16 run train it; nothing writes
    into it."""
    from megatron_dapo.demo import warm_task

    return built_once(tmp_path_factory, "demo", lambda out: warm_task(out, seed=0))


@pytest.fixture(scope="session")
def chain(tmp_path_factory):
    """The demo's "chain" task (sums worked line by line) as `megatron-dapo demo --task chain` makes it (seed 0), on
    its shorter problems only, 2 to 4 numbers (11 to 30 tokens): warm started to the demo's third right in about 250
    steps (40 s here), where the whole task's 2 to 10 takes 850 (over 5 minutes). test_chain_task trains it with
    DAPO and test_ablation_bench runs the quick ablation on it. Nothing writes into it."""
    from megatron_dapo.demo import warm_task

    return built_once(tmp_path_factory, "chain", lambda out: warm_task(out, seed=0, task="chain",
                                                                        rows={"num_operands": (2, 4)}, max_steps=400))


@pytest.fixture(scope="session")
def shared_sglang(tmp_path_factory):
    """One real SGLang server on the CPU (fp32, the tiny Qwen2 of tests/distributed/tiny_models.py) for the modules
    that sample from it and push weights into it but leave it running: its start-up is a minute of the suite's
    time on 2 busy cores. Take it through `sglang_server_as_started`. (server, tokenizer, its folder)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
    from tiny_models import save_with_tokenizer

    from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig

    root = tmp_path_factory.mktemp("sglang")
    tokenizer = save_with_tokenizer(root / "model")
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300)
    with SGLangServer(config, root / "server.log") as srv:
        yield srv, tokenizer, root


def train_in_process(cfg: dict, folder: Path, monkeypatch) -> tuple[float, float, list[dict]]:
    """`megatron-dapo train` of `cfg` (the YAML's shape, written to folder/run.yaml) in this process: held-out
    eval/avg@4 before and after, and the steps' metrics."""
    import json

    import yaml

    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.run_config import load_config
    from megatron_dapo.trainer import DapoTrainer

    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = DapoTrainer(load_config(path))
    try:
        before = trainer.evaluate()["eval/avg@4"]
        trainer.train()
        after = trainer.evaluate()["eval/avg@4"]
    finally:
        trainer.close()
    lines = (Path(cfg["train"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    return before, after, [json.loads(line) for line in lines]


def sglang_server_as_started(shared) -> tuple:
    """The shared server as a module expects it: up (started again if a module stopped it) and serving the
    weights of its folder as version "0" (a module may have pushed others)."""
    from megatron_dapo.rollout.sglang_server import post_json

    srv, tokenizer, root = shared
    if not srv.healthy():
        srv.restart()
    reset = post_json(f"{srv.url}/update_weights_from_disk", {"model_path": str(root / "model"),
                                                              "weight_version": "0"}, 300)
    assert reset["success"], reset
    return srv, tokenizer, root


def one_process_runtime(parallel):
    """torch.distributed and megatron-core's groups in this process, a world of one, for a module's fixture (which
    calls parallel.runtime.shutdown_runtime when it is done)."""
    from megatron_dapo.parallel.runtime import free_port, init_runtime

    return init_runtime(parallel, environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(free_port())})
