"""bench/ablation.py --quick runs in the suite on the chain task and its warm model (every arm, one seed, one step's
samples of 8 prompts x 8), so that the ablation cannot rot; its numbers are the bench's to print, never asserted here
beyond their shape and what each arm's switches must do to the batch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "ablation.py"
ARMS = ["GRPO + KL", "naive GRPO", "+ overlong filtering", "+ clip-higher", "+ soft punishment", "+ token-level loss",
        "+ dynamic sampling"]


@pytest.mark.slow
def test_the_quick_ablation_runs_every_arm_in_the_papers_order_and_prints_its_table(chain, tmp_path):
    # A plain CPU run, as the bench and the demo run (the suite's device-faithful tagging doubles the in-process
    # engine's decoding time here: many small ops per token).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_DAPO_DEVICE_FAITHFUL": "0"}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--task", "chain", "--task-dir", str(chain),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| arm"))}
    assert list(rows) == ARMS
    for name, cells in rows.items():
        assert 0 <= float(cells[0]) <= float(cells[1]) <= 100, name  # avg@4 <= pass@4
        first, last = (float(e.split("±")[0]) for e in cells[3].split("->"))
        assert first > 0 and last > 0, name  # the entropy of every generated token, from the engine
        assert 0 <= float(cells[6]) <= 100, name  # groups without contrast, measured
        samples_per_trained = float(cells[7])
        # Without dynamic sampling every sample generated is trained on; with it, the dropped groups cost extra.
        assert samples_per_trained == 1.0 if name != "+ dynamic sampling" else samples_per_trained > 1.0, name
    assert re.search(r"warm model: held-out avg@4 [\d.]+ %", done.stdout)
    assert (tmp_path / "ablation.png").stat().st_size > 10_000


def test_a_response_limit_given_on_the_command_line_reaches_every_arm():
    """--limit 56 16: every arm trains under the limit, and the soft punishment's interval is the one given."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ablation", BENCH)
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    arms = ablation.arms("chain", (56, 16))
    assert [name for name, _ in arms] == ARMS
    assert all(switches["algorithm.max_response_len"] == 56 for _, switches in arms)
    punished = [s for _, s in arms if s.get("algorithm.overlong_penalty")]
    assert [s["algorithm.overlong_cache_len"] for s in punished] == [16, 16, 16]
    assert ablation.limits("chain", None) == (80, 24)  # the task's own
