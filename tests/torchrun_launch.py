"""Launch a worker of tests/distributed/ under torchrun (gloo on CPU) and fail with its output if it fails."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.parallel.runtime import free_port

WORKERS = Path(__file__).parent / "distributed"


def run_worker(worker: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the worker under torchrun, whatever its outcome."""
    script = WORKERS / worker
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKERS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=WORKERS)


def torchrun(worker: str, nproc: int, *args: str, timeout: int = 600) -> None:
    proc = run_worker(worker, nproc, *args, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{worker} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}")
