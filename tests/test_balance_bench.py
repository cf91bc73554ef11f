"""bench/bench_balance.py runs in the suite at a tiny size, so it cannot rot: its table's numbers are for the README,
never asserted here."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "bench_balance.py"


def test_the_balance_bench_prints_greedy_and_karmarkar_karp_per_data_parallel_size():
    done = subprocess.run([sys.executable, str(BENCH), "--prompts", "4", "--group", "4", "--batches", "2",
                           "--dp", "2", "4", "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [f for f in (line.replace("|", " ").split() for line in done.stdout.splitlines()) if f and f[0] == "16"]
    assert [r[1] for r in rows] == ["2", "4", "8"] and all(len(r) == 10 for r in rows)
    assert all(float(x) >= 1.0 for r in rows for x in r[3:9])  # max / mean tokens (mean, worst) and FLOPs
