"""The log-prob, attention memory, train-step and export benchmarks run on the CPU under the device-faithful mode, at tiny
sizes: a host / device slip in a bench fails here rather than on a GPU, and a worker that dies fails its bench at
once, naming it."""

import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from worker_results import result_of  # noqa: E402


def bench(script: str, *args: str) -> str:
    env = {**os.environ, "MEGATRON_DAPO_DEVICE_FAITHFUL": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def table(out: str, first: str) -> list[list[str]]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == [first])
    return [line.split() for line in lines[header + 1:] if line.strip() and line.split()[0].isdigit()]


@pytest.mark.slow
def test_the_logprobs_memory_bench_runs_device_faithful_at_tp_1_and_2():
    rows = table(bench("bench_logprobs_memory.py", "--tokens", "256", "--vocab", "1000", "--tp", "1", "2"), "TP")
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(float(r[3]) > 0 for r in rows)  # ours / naive peak memory


@pytest.mark.slow
def test_the_attention_memory_bench_runs_device_faithful_and_names_the_sdpa_kernel():
    out = bench("bench_attention_memory.py", "--tokens", "128", "--heads", "2", "--groups", "1", "--head-dim", "16",
                "--repeats", "3")
    (row,) = table(out, "tokens")
    assert row[0] == "128" and "median time of 3" in out
    assert " ".join(row[7:]) in ("flash (cpu)", "math"), row  # torch's CPU kernels


def test_the_train_step_bench_runs_device_faithful_with_its_time_split_and_preflights_estimate():
    """The tiny model of bench/bench_train_step.py at the GPU's precision and placement; its figures are the GPU's
    to give, and only their shape is held here."""
    out = bench("bench_train_step.py", "--tiny", "--tokens", "2048", "--micro-batch-tokens", "1024", "--steps", "1")
    assert "bfloat16" in out and re.search(r"^tokens/s +\d+", out, re.M) and re.search(r"^MFU vs GEMM +[\d.]+ %", out, re.M)
    parts = dict(re.findall(r"^time (.+?) +[\d.]+ s +([\d.]+) %", out, re.M))
    assert list(parts) == ["forward", "log-probs + loss", "optimizer", "backward + reduction"], out
    assert all(float(v) > 0 for v in parts.values()), parts
    assert re.search(r"^peak memory +n/a on the CPU .*; preflight [\d.]+ GB", out, re.M)
    parts = re.search(r"^preflight parts weights (\S+) GB, grads (\S+) GB, optimizer (\S+) GB, "
                      r"activations (\S+) GB, logits (\S+) GB$", out, re.M)
    assert parts and all(float(v) > 0 for v in parts.groups()), out


@pytest.mark.slow
def test_the_train_step_bench_sets_each_fusion_alone_and_says_why_one_is_unavailable():
    """--fusions, as the GPU check runs it: a row per megatron-core fusion the local spec reaches. Those with a
    torch.compile fuser run here; RoPE's and the weight-gradient accumulation's need Transformer Engine or apex,
    which this machine (like the bare GPU machine) lacks, and their rows say so instead of failing the bench."""
    out = bench("bench_train_step.py", "--tiny", "--tokens", "2048", "--micro-batch-tokens", "1024", "--steps", "1",
                "--fusions")
    rows = {line.split()[0]: line for line in out[out.index("== fusions:"):].splitlines()
            if line.split()[:1] and line.split()[0].endswith("_fusion")}
    assert list(rows) == ["bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                          "gradient_accumulation_fusion"], out
    for flag in ("bias_activation_fusion", "bias_dropout_fusion"):
        assert float(rows[flag].split()[3]) > 0, rows[flag]  # fused / shipped step time
    assert "unavailable: apply_rope_fusion is not available" in rows["apply_rope_fusion"]
    assert "unavailable: ColumnParallelLinear was called with gradient_accumulation_fusion" in \
        rows["gradient_accumulation_fusion"]


def test_the_export_bench_moves_every_byte_of_the_model_through_the_buckets():
    out = bench("bench_export.py", "--tiny", "--bucket-mb", "0.02", "--repeats", "2")
    buckets = int(re.search(r"TP 1, (\d+) buckets", out).group(1))
    assert buckets > 2, out  # the model spread over several buckets; the bench checks every byte arrived
    assert re.search(r"^export / copy +[\d.]+ of the copy's bandwidth", out, re.M)


@pytest.mark.parametrize("layout", ["alone", "beside a live one"])
def test_a_dead_worker_fails_its_bench_at_once_naming_it(layout):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,))] if layout != "alone" else []
    procs.append(ctx.Process(target=os._exit, args=(3,)))
    for p in procs:
        p.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"TP=2: worker {len(procs) - 1} exited with 3"):
        result_of(procs, ctx.Queue(), "TP=2")
    assert time.monotonic() - start < 10  # not the 3600 s the result is waited for
    for p in procs:
        p.join(timeout=5)
    assert not any(p.is_alive() for p in procs)  # the live one is stopped too
