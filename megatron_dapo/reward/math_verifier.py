"""Judging a final answer (reward/final_answer.py finds it) against the ground truth with math-verify.

math-verify's own timeouts use SIGALRM (main thread only, one alarm per process), so they are off here; the
reward pool bounds the wall time from outside.
"""

from __future__ import annotations

from functools import lru_cache

from math_verify import parse, verify

from megatron_dapo.reward.verdict import Verdict

_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def _parse_math(value: str) -> list:
    # A bare value ("1/2", "\frac{1}{2}", "5 cm") is read as LaTeX math; text with its own delimiters as is.
    if not any(delimiter in value for delimiter in _MATH_DELIMITERS):
        value = f"${value}$"
    return parse(value, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_ground_truth(ground_truth: str) -> list:
    # The G samples of a group share one ground truth.
    return _parse_math(ground_truth)


@lru_cache(maxsize=65536)
def judge_answer(answer: str, ground_truth: str) -> Verdict:
    """Whether answer equals ground_truth, by math-verify. Cached: the same answer to the same problem recurs
    across a group's responses and across steps, and sympy's simplify is most of a judgement's time."""
    gold = _parse_ground_truth(ground_truth.strip())
    if not gold:
        return Verdict(False, f"error: the ground truth {ground_truth[:80]!r} cannot be parsed by math-verify")
    predicted = _parse_math(answer)
    if not predicted:
        return Verdict(False, "unparsable")
    correct = verify(gold, predicted, timeout_seconds=None)
    return Verdict(correct, "ok" if correct else "wrong")
