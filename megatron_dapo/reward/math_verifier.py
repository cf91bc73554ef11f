"""Judging one response's final answer against the ground truth with math-verify.

The final answer is the last one the response states: DAPO's prompt asks for a last line "Answer: $Answer",
and many models write \\boxed{...}; of the last `Answer:` line and the last balanced \\boxed{}, the later one
counts. A response with neither has no answer, whatever numbers it contains: rewarding "the last number in the
text" would be easy to game. math-verify's own timeouts use SIGALRM (main thread only, one alarm per process),
so they are off here; the reward pool bounds the wall time from outside.
"""

from __future__ import annotations

import re
from functools import lru_cache

from math_verify import parse, verify

from megatron_dapo.reward.verdict import Verdict

# "Answer: 34", "**Answer:** $\frac{1}{2}$", "Final answer:\n34" (the value may start on the next line, as in
# DAPO's reference reward).
_ANSWER = re.compile(r"\banswer\b[ \t*]*:[\s*]*(?P<content>[^\n]+)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def _last_answer_line(text: str) -> tuple[int, str] | None:
    found = None
    for match in _ANSWER.finditer(text):
        content = match.group("content").strip().strip("*").strip().rstrip(".").strip()
        if content:
            found = (match.start(), content)
    return found


def _last_boxed(text: str) -> tuple[int, str] | None:
    """The last \\boxed{...} with its braces balanced; None if the last one never closes."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    last = starts[-1]
    depth = 0
    for i in range(last.end() - 1, len(text)):
        if text[i] == "{" and text[i - 1] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return last.start(), "\\boxed{" + text[last.end():i] + "}"
    return None


def final_answer(text: str) -> str | None:
    """The final answer stated in text (the later of the last `Answer:` line and the last \\boxed{}), or None."""
    candidates = [c for c in (_last_answer_line(text), _last_boxed(text)) if c is not None]
    return max(candidates)[1] if candidates else None


def _parse_math(value: str) -> list:
    # A bare value ("1/2", "\frac{1}{2}", "5 cm") is read as LaTeX math; text with its own delimiters as is.
    if not any(delimiter in value for delimiter in _MATH_DELIMITERS):
        value = f"${value}$"
    return parse(value, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_ground_truth(ground_truth: str) -> list:
    # The G samples of a group share one ground truth.
    return _parse_math(ground_truth)


def judge(text: str, ground_truth: str) -> Verdict:
    """Whether the final answer in text (a response, or its tail) equals ground_truth, by math-verify."""
    gold = _parse_ground_truth(ground_truth.strip())
    if not gold:
        return Verdict(False, f"error: the ground truth {ground_truth[:80]!r} cannot be parsed by math-verify")
    answer = final_answer(text)
    if answer is None:
        return Verdict(False, "no_answer")
    predicted = _parse_math(answer)
    if not predicted:
        return Verdict(False, "unparsable")
    correct = verify(gold, predicted, timeout_seconds=None)
    return Verdict(correct, "ok" if correct else "wrong")
