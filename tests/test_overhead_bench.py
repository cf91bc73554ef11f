"""The fused loss's host-overhead benchmark runs on the CPU at a few calls, so it cannot rot between GPU draws;
its numbers are for the GPU check and the notes, never asserted here."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "bench_dapo_loss_overhead.py"


def test_the_overhead_bench_prints_a_row_per_token_count():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tokens", "16", "1000", "--reps", "5"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["16"], ["1000"])]
    assert [r[0] for r in rows] == ["16", "1000"] and all(len(r) == 7 and float(r[1]) > 0 for r in rows)
