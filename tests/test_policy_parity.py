"""The Megatron policy under torchrun (gloo, 4 CPU processes) against transformers at TP x PP layouts."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "distributed" / "policy_worker.py"
CASES = [f"{kind}-tp{tp}-pp{pp}" for kind in ("qwen2", "qwen2_tied", "llama")
         for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, nproc: int, *args: str, timeout: int = 600) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parent)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=script.parent)
    if proc.returncode != 0:
        pytest.fail(f"{script.name} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy_parity")
    torchrun(WORKER, 4, str(out))
    merged = {}
    for f in sorted(out.glob("rank*.json")):
        merged.update(json.loads(f.read_text()))
    return merged


@pytest.mark.parametrize("case", CASES)
def test_logprobs_and_entropy_match_transformers(parity, case):
    assert case in parity, f"no rank reported {case}"
    r = parity[case]
    assert r["tokens"] == 138
    assert r["max_abs_logp"] < 1e-4
    assert r["max_abs_entropy"] < 1e-4


def test_vocab_parallel_gradient_matches_full_softmax(parity):
    grads = {k: v for k, v in parity.items() if k.startswith("logprob-grad-tp2")}
    assert len(grads) == 2, parity.keys()
    assert all(v["max_abs_grad"] < 1e-12 for v in grads.values())
