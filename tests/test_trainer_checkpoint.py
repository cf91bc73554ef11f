"""Trainer checkpoints: an exact resume in a new process at TP=2, PP=2 and DP=2, and at another layout;
atomicity, keep-last-N, bad inputs; a write that fails on one rank."""

import dataclasses
import hashlib
import json
import time
from types import SimpleNamespace

import pytest
import torch
from torchrun_launch import run_worker, torchrun

from megatron_dapo.checkpoint.safetensors_io import CheckpointError
from megatron_dapo.checkpoint.trainer_checkpoint import (
    MARKER,
    complete_checkpoints,
    latest_checkpoint,
    load_trainer_checkpoint,
    prune_checkpoints,
    read_trainer_state,
    save_trainer_checkpoint,
)
from megatron_dapo.config import ConfigError
from megatron_dapo.policy.hf_config import ModelSpec

# DP=2: the distributed optimizer's state really is split between the ranks; nodist: megatron's plain optimizer;
# bf16: the GPU's precision (bf16 weights, fp32 masters in the optimizer), for Qwen2 (qkv biases beside the norms
# in the no-weight-decay group) and Llama; the others fp32 by name.
LAYOUTS = {"tp2-pp1-dp1": "2,1", "tp1-pp2-dp1": "1,2", "tp1-pp1-dp2": "1,1", "tp1-pp2-dp1-nodist": "1,2,nodist",
           "tp1-pp1-dp2-bf16": "1,1,bf16", "tp1-pp1-dp2-nodist-bf16": "1,1,nodist,bf16",
           "tp1-pp1-dp2-bf16-llama": "1,1,bf16,llama", "tp1-pp1-dp2-nodist-bf16-llama": "1,1,nodist,bf16,llama",
           "tp1-pp1-dp2-bf16-ep2-moe": "1,1,bf16,moe",  # a Qwen3-MoE, its 4 experts over 2 expert-parallel ranks
           "tp1-pp1-dp2-bf16-ep2-glm": "1,1,bf16,glm",  # GLM-4.5-style routing: 8 experts, a shared one, the bias
           "tp1-pp1-cp2-dp1-bf16": "1,1,bf16,cp"}  # context parallelism: the optimizer state split over CP
# of the 4-layer tiny models (Llama has no qkv biases; the Qwen3-MoE has 3 layers of a router and 4 experts; the
# GLM-4.5-style one a dense layer, then 3 of a router, its expert bias, 8 experts and a shared one)
HF_TENSORS = {"qwen2": 51, "llama": 39, "moe": 77, "glm": 137}
RESHARD = ("1,2", "tp2-pp1-dp1")  # resumed at TP=1 x PP=2 from the TP=2 checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_ckpt")
    torchrun("trainer_ckpt_worker.py", 2, str(out), "full", *LAYOUTS.values())
    torchrun("trainer_ckpt_worker.py", 2, str(out), "resume", *LAYOUTS.values(), f"{RESHARD[0]}@{RESHARD[1]}")
    return out


def load_run(out, tag, mode):
    weights = {}
    for f in sorted(out.glob(f"{tag}-{mode}-stage*.pt")) + sorted(out.glob(f"{tag}-{mode}-rank*.pt")):
        weights.update(torch.load(f))
    return json.loads((out / f"{tag}-{mode}.json").read_text()), weights


def full_extra(step):
    return {"sampler": {"epoch": 0, "position": 6 * step}, "metrics_step": step}


@pytest.mark.slow
@pytest.mark.parametrize("tag", LAYOUTS)
def test_resumed_step_is_bitwise_the_uninterrupted_one(runs, tag):
    full, full_w = load_run(runs, tag, "full")
    resumed, resumed_w = load_run(runs, tag, "resume")
    model = next((m for m in ("llama", "moe", "glm") if tag.endswith(m)), "qwen2")
    assert len(full_w) == HF_TENSORS[model] and full_w.keys() == resumed_w.keys()  # every HF tensor of the model
    changed = [k for k in full_w if not torch.equal(full_w[k], resumed_w[k])]
    assert not changed, f"weights after step 4 differ: {changed[:5]}"
    assert full["dtypes"] == resumed["dtypes"] == (["torch.bfloat16"] if "bf16" in tag else ["torch.float32"])
    assert resumed["masters"] == full["masters"]  # the fp32 masters (bf16) restored bitwise, on every rank
    assert ("bf16" in tag) == (hashlib.sha256().hexdigest() not in full["masters"])  # bf16 has masters
    assert resumed["loss"] == full["loss"] and resumed["grad_norm"] == full["grad_norm"]
    assert resumed["lr"] == full["lr"] == pytest.approx(3e-3 * 4 / 6)  # warmup position restored with the step
    assert resumed["step_count"] == full["step_count"] == 3
    assert resumed["extra"] == full_extra(3)


@pytest.mark.slow
def test_resumed_at_another_layout_the_step_matches_to_rounding(runs):
    full, full_w = load_run(runs, RESHARD[1], "full")
    resumed, resumed_w = load_run(runs, f"tp1-pp2-dp1-from-{RESHARD[1]}", "resume")
    assert full_w.keys() == resumed_w.keys()
    scale = max(v.abs().max().item() for v in full_w.values())
    worst = max((resumed_w[k] - full_w[k]).abs().max().item() for k in full_w) / scale
    assert worst < 2e-6, f"weights after step 4 differ by {worst:.2e} (relative)"  # measured: 1.6e-7
    assert resumed["loss"] == pytest.approx(full["loss"], rel=2e-6)
    assert resumed["grad_norm"] == pytest.approx(full["grad_norm"], rel=2e-6)
    assert resumed["lr"] == full["lr"] and resumed["extra"] == full_extra(3)


@pytest.mark.slow
@pytest.mark.parametrize("tag", LAYOUTS)
def test_every_rank_gets_its_own_rng_states_back(runs, tag):
    full, _ = load_run(runs, tag, "full")
    resumed, _ = load_run(runs, tag, "resume")
    assert resumed["draws"] == full["draws"]  # python, numpy, torch, and megatron's tracker, per rank
    if tag == "tp2-pp1-dp1":  # the tracker's model-parallel state differs between TP ranks
        assert full["draws"][0]["tracker"] != full["draws"][1]["tracker"]


@pytest.mark.slow
@pytest.mark.parametrize("tag", LAYOUTS)
def test_keep_last_two(runs, tag):
    root = runs / f"ckpt-{tag}"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert latest_checkpoint(root) == root / "step_000003"
    state = read_trainer_state(root / "step_000003")
    assert state["step"] == 3 and state["layout"]["world_size"] == 2
    assert (root / "step_000003" / "model" / "megatron_dapo.json").is_file()  # convertible to HF as is


@pytest.mark.slow
def test_a_checkpoint_of_another_model_shape_is_refused(runs):
    path = runs / "ckpt-tp2-pp1-dp1" / "step_000003"
    spec = ModelSpec(**read_trainer_state(path)["model"])
    other = SimpleNamespace(spec=dataclasses.replace(spec, hidden_size=128, num_layers=2))
    with pytest.raises(CheckpointError, match=r"different model shape: num_layers=4 \(this model: 2\), "
                                              r"hidden_size=64 \(this model: 128\)"):
        load_trainer_checkpoint(path, other)


def fake_checkpoint(root, step, complete=True, suffix=""):
    path = root / f"step_{step:06d}{suffix}"
    path.mkdir(parents=True)
    if complete:
        (path / MARKER).write_text(f"{step}\n")
    return path


def test_leftovers_and_unmarked_folders_are_ignored(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    fake_checkpoint(tmp_path, 9)
    newest = fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 11, suffix=".tmp")  # a save interrupted before its rename
    fake_checkpoint(tmp_path, 12, complete=False)  # a folder without its marker
    fake_checkpoint(tmp_path, 13, suffix=".tmp").joinpath(MARKER).touch()
    (tmp_path / "step_000014").write_text("a file, not a folder")
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == newest
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000009", "step_000010"]


def test_steps_order_by_number_not_by_name(tmp_path):
    fake_checkpoint(tmp_path, 999999)
    newest = fake_checkpoint(tmp_path, 1000000)
    assert latest_checkpoint(tmp_path) == newest


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    unmarked = fake_checkpoint(tmp_path, 5, complete=False)
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step_000001", "step_000002"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert unmarked.is_dir()


def test_loading_an_incomplete_checkpoint_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(CheckpointError, match=r"step_000003: not a complete trainer checkpoint \(no COMPLETE"):
        load_trainer_checkpoint(path, trainer=None)


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_bad_keep_last(tmp_path, keep_last):
    with pytest.raises(ConfigError, match="keep_last: must be a whole number >= 1"):
        save_trainer_checkpoint(tmp_path, 1, trainer=None, extra={}, keep_last=keep_last)


def test_extra_must_be_json(tmp_path):
    with pytest.raises(CheckpointError, match="extra: must be JSON-serialisable"):
        save_trainer_checkpoint(tmp_path, 1, trainer=None, extra={"sampler": torch.zeros(2)})
    assert not any(tmp_path.iterdir())


# A write that fails on one rank, through megatron-core's collective error path or ours (ckpt_fault_worker.py).
AGREED_FAULTS = {"rng@1": "rank 1: OSError: [Errno 28] No space left on device: '{tmp}/rng/rank_00001.pt'",
                 "shard@1": "rank 1: RuntimeError: Worker failure: [Errno 28] No space left on device",
                 "state@0": "rank 0: OSError: [Errno 28] No space left on device: '{tmp}/trainer_state.json'"}


def write_failures(out, *faults):
    """Run ckpt_fault_worker.py through `faults` (a hang fails here); each one's results are in out/FAULT."""
    proc = run_worker("ckpt_fault_worker.py", 2, str(out), *faults, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]


def fault_time(case) -> float:
    return float((case / "fault_time").read_text())


def said(case, rank):
    file = case / f"rank{rank}.json"
    assert file.is_file(), f"rank {rank} raised no CheckpointWriteError"
    return json.loads(file.read_text())


@pytest.fixture(scope="module")
def agreed_failures(tmp_path_factory):
    """The faults of AGREED_FAULTS one after the other in one run of the worker: one start of its ranks, not three."""
    out = tmp_path_factory.mktemp("agreed_failures")
    write_failures(out, *AGREED_FAULTS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", AGREED_FAULTS)
def test_a_write_failing_on_one_rank_stops_every_rank_and_keeps_the_previous_checkpoint(agreed_failures, fault):
    case = agreed_failures / fault
    root = case / "checkpoints"
    tmp, previous = root / "step_000002.tmp", root / "step_000001"
    errors = [said(case, rank) for rank in (0, 1)]
    stop_s = max(e.pop("raised_at") for e in errors) - fault_time(case)
    assert errors[0] == errors[1]  # every rank raised the same error, naming the rank that failed
    assert errors[0]["error"].startswith(f"{tmp}: the checkpoint of step 2 could not be written: ")
    assert AGREED_FAULTS[fault].format(tmp=tmp) in errors[0]["error"]
    assert errors[0]["error"].endswith(f"the latest complete checkpoint is still {previous} (a rerun resumes from "
                                       f"it). Free space in {root} (or fix the error above) and rerun")
    assert errors[0]["latest"] == str(previous) == str(latest_checkpoint(root))
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # leftover deleted, keep_last=1 pruned nothing
    assert read_trainer_state(previous)["step"] == 1
    print(f"{fault}: both ranks ended {stop_s:.1f} s after the fault")  # 2.5 s, a fault to a run


@pytest.mark.slow
def test_a_write_failing_outside_megatrons_collective_error_path_stops_the_run(tmp_path):
    """megatron-core's coordinator writes common.pt alone, while the other ranks wait for it in the save: the
    coordinator raises at once and exits, and the launcher (torchrun here) stops the others."""
    write_failures(tmp_path, "common@0")
    stop_s = time.time() - fault_time(tmp_path / "common@0")
    root = tmp_path / "common@0" / "checkpoints"
    tmp = root / "step_000002.tmp"
    error = said(tmp_path / "common@0", 0)["error"]
    assert error.startswith(f"{tmp}: the checkpoint of step 2 could not be written: rank 0: OSError: [Errno 28] No "
                            f"space left on device: '{tmp}/model/common.pt'; the latest complete checkpoint is still "
                            f"{root / 'step_000001'}")
    assert latest_checkpoint(root) == root / "step_000001"  # the leftover is ignored, and deleted by the next save
    print(f"common.pt: the run ended {stop_s:.1f} s after the fault")  # 2.4 s


def test_the_checkpoint_writers_helper_starts_before_the_first_save():
    """megatron-core's writer hands its results through a helper process that it spawns at the first save and that
    imports torch when it unpickles the first results: 2-3 s inside the step that checkpoints here. The trainer
    starts it during setup (start_writer_helper); the first save then finds it running."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.checkpoint.mcore_checkpoint import start_writer_helper

    start_writer_helper().join()
    helper = filesystem_async._results_queue
    assert helper is not None and filesystem_async._get_write_results_queue() is helper
    assert helper.empty()  # the warm-up result was taken back: the writer's first get() is its own


def test_a_second_trainer_in_the_same_process_finds_the_writers_helper_running():
    """One helper per process: the ablation's arms and the tests' in-process runs build trainer after trainer in
    one process, and each used to spawn a helper of its own (2-3 s of CPU importing torch), leaving the one before
    running until the process ended."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.checkpoint.mcore_checkpoint import start_writer_helper

    start_writer_helper().join()
    helper, children = filesystem_async._results_queue, psutil.Process().children(recursive=True)
    start_writer_helper().join()
    assert filesystem_async._results_queue is helper
    assert psutil.Process().children(recursive=True) == children


def test_the_checkpoint_writers_helper_ends_with_a_killed_trainer():
    """A trainer rank killed (torchrun stopping a stuck run, the OOM killer) leaves no helper process behind."""
    import signal
    import subprocess
    import sys

    import psutil

    script = ("from megatron_dapo.checkpoint.mcore_checkpoint import start_writer_helper\n"
              "start_writer_helper().join()\nprint('up', flush=True)\nimport time\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        helpers = psutil.Process(proc.pid).children(recursive=True)
        assert helpers  # the manager (and multiprocessing's resource tracker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
