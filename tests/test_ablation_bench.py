"""bench/ablation.py --quick runs in the suite on the demo's task and warm model (every arm, one seed, two steps'
samples), so that the ablation cannot rot; its numbers are the bench's to print, never asserted here beyond their
shape and what each arm's switches must do to the batch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "ablation.py"

pytestmark = pytest.mark.slow


def test_the_quick_ablation_runs_every_arm_and_prints_its_table(demo, tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--task", str(demo), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| arm"))}
    assert list(rows) == ["GRPO", "GRPO - KL", "+ clip-higher", "+ overlong", "+ token-level", "+ dyn. sampling"]
    for name, cells in rows.items():
        assert 0 <= float(cells[0]) <= float(cells[1]) <= 100, name  # avg@4 <= pass@4
        samples_per_kept = float(cells[6])
        # Without dynamic sampling every sample generated is trained on; with it, the dropped groups cost extra.
        assert samples_per_kept == 1.0 if name != "+ dyn. sampling" else samples_per_kept > 1.0, name
    assert re.search(r"warm model: held-out avg@4 [\d.]+ %", done.stdout)
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
