"""Settings of the reward pool, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.config import ConfigError


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class RewardConfig:
    num_workers: int = 4  # judging processes
    timeout_s: float = 10.0  # wall-clock limit per sample; past it the worker is killed and the sample is wrong
    tail_chars: int = 1000  # only this many characters at the end of a response are searched for the answer
    startup_timeout_s: float = 120.0  # a worker not ready by then (importing sympy + math-verify) is an error
    max_answers_per_message: int = 32  # answers a worker gets at once: fewer pipe round trips, coarser balance

    def __post_init__(self):
        if not (_is_whole(self.num_workers) and self.num_workers >= 1):
            raise ConfigError(f"reward.num_workers: must be a whole number >= 1, got {self.num_workers!r}")
        if not _is_positive_seconds(self.timeout_s):
            raise ConfigError(f"reward.timeout_s: must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if not (_is_whole(self.tail_chars) and self.tail_chars >= 1):
            raise ConfigError(f"reward.tail_chars: must be a whole number >= 1, got {self.tail_chars!r}; "
                              "it must cover the response's final `Answer:` line or `\\boxed{}`")
        if not (_is_whole(self.max_answers_per_message) and self.max_answers_per_message >= 1):
            raise ConfigError("reward.max_answers_per_message: must be a whole number >= 1, "
                              f"got {self.max_answers_per_message!r}")
        if not _is_positive_seconds(self.startup_timeout_s):
            raise ConfigError("reward.startup_timeout_s: must be a finite number of seconds > 0, "
                              f"got {self.startup_timeout_s!r}")
