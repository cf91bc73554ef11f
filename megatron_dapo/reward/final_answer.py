"""The final answer a response states, found without math-verify (so the pool's process never loads sympy).

DAPO's prompt asks for a last line "Answer: $Answer", and many models write \\boxed{...}; of the last `Answer:`
line and the last balanced \\boxed{}, the later one counts. A response with neither has no answer, whatever
numbers it contains: rewarding "the last number in the text" would be easy to game.
"""

from __future__ import annotations

import re

# "Answer: 34", "**Answer:** $\frac{1}{2}$", "Final answer:\n34" (the value may start on the next line, as in
# DAPO's reference reward).
_ANSWER = re.compile(r"\banswer\b[ \t*]*:[\s*]*(?P<content>[^\n]+)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


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
