"""The judgement of one response."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """correct: the final answer equals the ground truth. reason: "ok", "wrong", "no_answer" (no `Answer:` line
    or balanced `\\boxed{}` in the tail), "unparsable", "timeout", "worker_crashed", or "error: ..."."""

    correct: bool
    reason: str

    @property
    def reward(self) -> float:
        """DAPO's rule-based reward: +1 if correct, -1 otherwise."""
        return 1.0 if self.correct else -1.0
