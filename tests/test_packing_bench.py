"""bench/bench_packing.py runs in the suite at a tiny size, so it cannot rot: its speed figures are for the README,
never asserted here; what holds by construction is: packed computes no padding, and both layouts start from the same
weights, so their first step's loss is the same."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "bench_packing.py"


def test_the_packing_bench_prints_both_layouts_their_ratio_and_the_balance():
    done = subprocess.run([sys.executable, str(BENCH), "--tiny"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = {f[0]: f[1:] for f in map(str.split, done.stdout.splitlines())
            if len(f) == 8 and f[0] in ("padded", "packed")}
    assert set(rows) == {"padded", "packed"} and float(rows["packed"][0]) == 0.0 < float(rows["padded"][0])
    assert rows["packed"][4] == "-"  # MFU: on a GPU only
    assert abs(float(rows["packed"][6]) - float(rows["padded"][6])) < 1e-5
    assert "packed / padded tokens/s:" in done.stdout and "Karmarkar-Karp" in done.stdout
