"""The verifiable-math reward: math-verify in a pool of spawned processes with a hard per-sample time limit."""

import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.reward import RewardConfig, RewardPool, Verdict

TIMEOUT_S = 5.0
TAIL_CHARS = 1000
# sympy evaluates 9^(9^(9^9)) by first computing the integer 9^387420489 (370 million digits): judged directly,
# without a time limit, this did not finish within 5 minutes.
HANG = "Let me write it as a tower: \\boxed{9^{9^{9^{9}}}}"


@dataclass(frozen=True)
class Case:
    name: str
    response: str
    ground_truth: str
    correct: bool
    reason: str  # "error" matches any "error: ..." reason


def _noise(num_chars: int, seed: int) -> str:
    """Text full of things that look like answers but never close: unbalanced braces and \\boxed, stray $."""
    rng = random.Random(seed)
    pieces = ["so", "we", "get", "$x^2+1", "\\boxed{", "{{", "}", "$$", "\\frac{3}{", "answer", "=", "12", "\n"]
    return "".join(rng.choice(pieces) + " " for _ in range(num_chars))[:num_chars]


LOREM = "Consider the triangle again and add the two areas we found. " * 2000

CASES = [
    Case("boxed", "Adding them up, the total is \\boxed{34}.", "34", True, "ok"),
    Case("boxed wrong", "So the total is \\boxed{35}.", "34", False, "wrong"),
    Case("boxed dfrac", "Hence \\boxed{\\dfrac{3}{4}}", "0.75", True, "ok"),
    Case("answer line", "Reasoning step.\nAnother step.\nAnswer: 34", "34", True, "ok"),
    Case("answer line bold", "Done.\n**Answer:** 34", "34", True, "ok"),
    Case("answer line dollars", "Done.\nAnswer: $34$.", "34", True, "ok"),
    Case("final answer line", "Done.\nFinal Answer: 12\n", "12", True, "ok"),
    Case("answer on next line", "Answer:\n  42", "42", True, "ok"),
    Case("answer line after boxed wins", "\\boxed{2}\nWait, I dropped a term.\nAnswer: 3", "3", True, "ok"),
    Case("boxed after answer line wins", "Answer: 3\nActually it is \\boxed{2}", "3", False, "wrong"),
    Case("frac vs decimal", "Answer: \\frac{1}{2}", "0.5", True, "ok"),
    Case("decimal vs frac", "Answer: 0.5", "\\frac{1}{2}", True, "ok"),
    Case("slash vs frac", "Answer: 1/2", "\\frac{1}{2}", True, "ok"),
    Case("unreduced fraction", "Answer: 2/4", "1/2", True, "ok"),
    Case("close decimal is wrong", "Answer: 0.51", "1/2", False, "wrong"),
    Case("negative", "Answer: -7", "-7", True, "ok"),
    Case("sign matters", "Answer: 7", "-7", False, "wrong"),
    Case("negative fraction", "\\boxed{-\\frac{3}{2}}", "-1.5", True, "ok"),
    Case("latex sqrt", "Answer: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt3}{2}", True, "ok"),
    Case("equivalent radicals", "\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True, "ok"),
    Case("pi", "\\boxed{\\pi}", "\\pi", True, "ok"),
    Case("power", "Answer: $10^{3}$", "1000", True, "ok"),
    Case("thousands separator", "Answer: 1,000", "1000", True, "ok"),
    Case("equation", "\\boxed{x = 5}", "5", True, "ok"),
    Case("unit cm", "Answer: 5 cm", "5", True, "ok"),
    Case("unit after math", "Answer: $5$ dollars", "5", True, "ok"),
    Case("unit in text", "\\boxed{5\\text{ cm}}", "5", True, "ok"),
    Case("degrees", "Answer: 45^\\circ", "45", True, "ok"),
    Case("unbalanced boxed", "so \\boxed{\\frac{1}{2}", "1/2", False, "no_answer"),
    Case("truncated fraction", "Answer: \\frac{1}{", "1/2", False, "wrong"),
    Case("empty boxed", "\\boxed{}", "1", False, "unparsable"),
    Case("brace soup", "}}}{{{ \\boxed{{{ $$ $ \\left( Answer", "1", False, "no_answer"),
    Case("reversed braces", "Answer: }{", "1", False, "wrong"),
    Case("empty response", "", "1", False, "no_answer"),
    Case("number without answer marker", "I think it is 42.", "42", False, "no_answer"),
    Case("100 KB of noise then the answer", _noise(100_000, seed=0) + "\nAnswer: 42", "42", True, "ok"),
    Case("answer before the tail", "Answer: 42\n" + LOREM[:100_000], "42", False, "no_answer"),
    Case("ground truth math-verify cannot read", "Answer: 1", "", False, "error"),
]


def _matches(verdict: Verdict, case: Case) -> bool:
    reason_ok = verdict.reason.startswith("error: ") if case.reason == "error" else verdict.reason == case.reason
    return verdict.correct == case.correct and reason_ok


def _alive(pid: int) -> bool:
    # Workers are reaped on close, so a pid that is gone from /proc has fully exited.
    return os.path.exists(f"/proc/{pid}")


def _kill(pid: int) -> None:
    """SIGKILL a worker and wait until it has exited (a zombie until the pool reaps it) with all its threads: a
    zombie leader whose other threads are still tearing down holds its sockets open, and takes a sample."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(1000):
        if not _alive(pid) or _exited_all_threads(pid):
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} survived SIGKILL")


def _exited_all_threads(pid: int) -> bool:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return status["State"].split()[0] == "Z" and status["Threads"].strip() == "1"


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(num_workers=2, timeout_s=TIMEOUT_S, tail_chars=TAIL_CHARS)) as reward_pool:
        yield reward_pool


def test_table_of_responses(pool):
    assert all(len(c.response) > 100_000 for c in CASES if "100 KB" in c.name or "before the tail" in c.name)
    verdicts = pool.score([c.response for c in CASES], [c.ground_truth for c in CASES])
    assert len(verdicts) == len(CASES)
    mismatches = [f"{c.name}: expected ({c.correct}, {c.reason!r}), got ({v.correct}, {v.reason!r})"
                  for c, v in zip(CASES, verdicts) if not _matches(v, c)]
    assert not mismatches, "\n".join(mismatches)


def test_a_judging_process_does_not_load_torch(pool):
    """A run starts a judging process per core it gives the reward: each one that imported torch on the way (the
    reward's config reads the loss's setting rules) would pay seconds of start-up and hundreds of MB for nothing."""
    pool.wait_until_ready()
    for pid in pool.worker_pids():
        assert "libtorch" not in open(f"/proc/{pid}/maps").read(), f"worker {pid} loaded torch"


def test_verdicts_keep_input_order_across_workers(pool):
    truths = [str(i) for i in range(24)]
    verdicts = pool.score([f"Answer: {i if i % 3 else i + 1}" for i in range(24)], truths)
    assert [v.correct for v in verdicts] == [i % 3 != 0 for i in range(24)]
    assert [v.reward for v in verdicts] == [1.0 if i % 3 else -1.0 for i in range(24)]


def test_hung_sympy_call_is_killed_and_scored_wrong(pool, caplog):
    pids_before = set(pool.worker_pids())
    with caplog.at_level("WARNING", logger="megatron_dapo.reward.pool"):
        verdicts = pool.score([HANG, "Answer: 5", "\\boxed{6}"], ["7", "5", "5"])
    assert verdicts == [Verdict(False, "timeout"), Verdict(True, "ok"), Verdict(False, "wrong")]
    assert "reward.timeout_s" in caplog.text and "9^{9^{9^{9}}}" in caplog.text
    assert len(pids_before - set(pool.worker_pids())) == 1  # the hung worker was replaced
    assert pool.score(["Answer: 34"] * 4, ["34"] * 4) == [Verdict(True, "ok")] * 4


def test_an_answer_that_hangs_mid_batch_costs_only_itself(pool):
    """Answers go to a worker in batches; the limit is still per answer, and the rest of a lost batch is judged."""
    pool.wait_until_ready()
    pids_before = set(pool.worker_pids())
    responses = [f"Answer: {i}" for i in range(10)]
    responses[2] = HANG  # the third answer of the first worker's batch of five
    verdicts = pool.score(responses, [str(i) for i in range(10)])
    assert verdicts[2] == Verdict(False, "timeout")
    assert verdicts[:2] + verdicts[3:] == [Verdict(True, "ok")] * 9
    assert len(pids_before - set(pool.worker_pids())) == 1


def test_each_distinct_answer_is_judged_once(pool):
    """Responses giving the same final answer to the same problem share one judgement: three hung responses
    cost one worker and one timeout, not three (or both workers)."""
    pool.wait_until_ready()
    pids_before = set(pool.worker_pids())
    tail = "\n".join(["Some reasoning."] * 3)
    verdicts = pool.score([HANG, "Other words. " + HANG, tail + HANG, "Answer: 5"], ["7", "7", "7", "5"])
    assert verdicts == [Verdict(False, "timeout")] * 3 + [Verdict(True, "ok")]
    assert len(pids_before - set(pool.worker_pids())) == 1


def test_pool_survives_an_idle_worker_killed_from_outside(pool):
    assert pool.score(["Answer: 1"], ["1"]) == [Verdict(True, "ok")]
    victim = pool.worker_pids()[0]
    _kill(victim)
    verdicts = pool.score([f"\\boxed{{{i}}}" for i in range(8)], [str(i) for i in range(8)])
    assert verdicts == [Verdict(True, "ok")] * 8
    assert victim not in pool.worker_pids()
    assert not _alive(victim)


def test_worker_killed_while_judging_scores_its_sample_crashed(pool):
    pool.wait_until_ready()
    victims = pool.worker_pids()

    def kill_both_mid_sample():
        time.sleep(1.0)  # well inside TIMEOUT_S: both are busy on HANG
        for pid in victims:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_both_mid_sample)
    killer.start()
    verdicts = pool.score([HANG, HANG], ["7", "8"])  # two problems: two answers to judge, one per worker
    killer.join()
    assert verdicts == [Verdict(False, "worker_crashed")] * 2
    assert not set(victims) & set(pool.worker_pids())
    assert pool.score(["Answer: -3", "Answer: 3"], ["-3", "-3"]) == [Verdict(True, "ok"), Verdict(False, "wrong")]


def test_close_leaves_no_processes_even_while_a_replacement_starts():
    with RewardPool(RewardConfig(num_workers=2, timeout_s=TIMEOUT_S)) as pool:
        assert pool.score(["Answer: 2"] * 2, ["2"] * 2) == [Verdict(True, "ok")] * 2
        seen = set(pool.worker_pids())
        _kill(pool.worker_pids()[0])
        assert pool.score(["Answer: 2"], ["2"]) == [Verdict(True, "ok")]  # the survivor judges it
        seen.update(pool.worker_pids())  # the replacement, which is still importing sympy
    assert len(seen) == 3
    assert not [pid for pid in seen if _alive(pid)]
    assert not [p for p in multiprocessing.active_children() if p.pid in seen]  # all joined
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["Answer: 2"], ["2"])


def test_bad_inputs_are_refused(pool):
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        pool.score(["Answer: 1", "Answer: 2"], ["1"])
    with pytest.raises(TypeError, match=r"ground_truths\[1\] is int, not str"):
        pool.score(["Answer: 1", "Answer: 2"], ["1", 2])


@pytest.mark.parametrize("key, value", [
    ("num_workers", 0), ("num_workers", -2), ("num_workers", 1.5), ("num_workers", True), ("num_workers", "4"),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", float("inf")), ("timeout_s", float("nan")),
    ("timeout_s", "10"), ("timeout_s", True),
    ("tail_chars", 0), ("tail_chars", 500.0), ("tail_chars", None),
    ("startup_timeout_s", 0), ("max_answers_per_message", 0), ("max_answers_per_message", 2.0),
])
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"^reward.{key}: "):
        RewardConfig(**{key: value})
