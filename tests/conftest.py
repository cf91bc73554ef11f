import os
import sys

import pytest

# The whole suite runs in the device-faithful CPU mode (megatron_dapo/device_faithful.py): a host/device
# mix-up fails here as it would on a GPU. Subprocesses (torchrun workers, trainer runs) inherit it.
os.environ.setdefault("MEGATRON_DAPO_DEVICE_FAITHFUL", "1")


# tests/gpu/ shares the helpers in this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns several megatron-core processes (minutes on 2 cores)")
    config.addinivalue_line("markers", "smoke: a slow test in `make test-fast`, the one of its kind of integration")


@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """Data files and a tiny model warm-started just enough to get some sums right: the trainer runs of
    test_trainer_loop, test_heartbeat and test_slurm_launch train it. Built once a session; nothing writes into it."""
    from megatron_dapo.data.held_out_split import split_held_out
    from megatron_dapo.data.prompt_encoding import encode_prompt
    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.demo.tiny_model import make_tiny_model
    from megatron_dapo.demo.warm_start import supervised_warm_start

    root = tmp_path_factory.mktemp("task")
    rows = generate_rows(1200, 0, digits=1, operations="+", num_operands=2, style="short")
    train, held_out = split_held_out(rows, 20, 0)
    write_rows(root / "train.jsonl", train)
    write_rows(root / "eval.jsonl", held_out)
    corpus = [r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows]
    tok = make_tiny_model(root / "base", corpus, seed=0, hidden=64, layers=2)
    pairs = [(encode_prompt(tok, r["prompt"]), tok.encode(r["extra_info"]["solution"]) + [tok.eos_token_id])
             for r in train]
    supervised_warm_start(root / "base", root / "model", pairs, target_accuracy=0.2, max_steps=600, batch_size=32)
    return root


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's task and warm model, made as `megatron-dapo demo` makes them (seed 0): a minute on 2 idle cores.
    test_tiny_cpu_config and test_gpu_check's end-to-end run train it; nothing writes into it."""
    from megatron_dapo.demo import WARM_START, prepare_task
    from megatron_dapo.demo.warm_start import supervised_warm_start

    out = tmp_path_factory.mktemp("demo")
    supervised_warm_start(out / "base", out / "warm", prepare_task(out, seed=0), seed=0, **WARM_START)
    return out


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
