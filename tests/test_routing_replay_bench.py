"""bench/bench_routing_replay.py runs in the suite at a tiny size, so it cannot rot: its table's numbers are for the
README, never asserted here, but with replay on the trainer routes every token as the engine did, by construction."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "bench_routing_replay.py"


def test_the_routing_replay_bench_prints_off_and_on_and_replay_leaves_no_routing_mismatch():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH), "--prompts", "3", "--group", "2", "--max-new-tokens", "8",
                           "--steps", "1"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = {f[0]: f[1:] for f in map(str.split, done.stdout.splitlines()) if len(f) == 4 and f[0] in ("off", "on")}
    assert set(rows) == {"off", "on"} and float(rows["on"][0]) == 0.0
    assert all(float(r[1]) >= 0 and float(r[2]) > 0 for r in rows.values())
    assert "on / off:" in done.stdout
