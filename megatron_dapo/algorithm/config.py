"""The algorithm's settings (the `algorithm:` section of the run config), validated with errors naming the key."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.config import ConfigError


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_max_response_len(max_response_len) -> None:
    if not _is_whole(max_response_len) or max_response_len < 1:
        raise ConfigError(f"algorithm.max_response_len: must be a whole number of tokens >= 1, "
                          f"got {max_response_len!r}")


def check_overlong_lengths(max_response_len, overlong_cache_len) -> None:
    check_max_response_len(max_response_len)
    if not _is_whole(overlong_cache_len) or overlong_cache_len < 0:
        raise ConfigError(f"algorithm.overlong_cache_len: must be a whole number of tokens >= 0, "
                          f"got {overlong_cache_len!r}")
    if overlong_cache_len > max_response_len:
        raise ConfigError(f"algorithm.overlong_cache_len: {overlong_cache_len} exceeds algorithm.max_response_len "
                          f"{max_response_len}; the punishment interval must lie inside the maximum length")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Defaults are the paper's: 512 prompts x 16 responses, L_max 20480 with a 4096-token punishment interval."""

    batch_size: int = 512  # B: groups (prompts) per training step
    group_size: int = 16  # G: responses per prompt
    oversample_factor: float = 1.0  # each round draws ceil(groups still needed x this) prompts
    max_sampling_rounds: int = 10  # then train on what was kept, with a warning
    advantage_eps: float = 1e-6  # (r - mean) / (std + eps)
    max_response_len: int = 20480  # L_max, in tokens: also the engine's max_new_tokens
    overlong_cache_len: int = 4096  # L_cache: the soft punishment interval just below L_max
    overlong_penalty: bool = True  # add Eq. 13 to the reward
    overlong_filter: bool = False  # mask truncated responses out of the loss
    # Drop the groups whose responses are all right or all wrong and sample on until the batch holds batch_size
    # groups with contrast. False (GRPO): the batch is the first batch_size groups drawn, such groups included:
    # their tokens count in the loss's normaliser, and their advantages are 0 unless the overlong penalty sets
    # their rewards apart (all right at lengths 6, 7, 9, 12 with L_max 12, L_cache 4: rewards 1, 1, 0.75, 0,
    # advantages 0.66, 0.66, 0.13, -1.45: a push towards shorter answers, none towards right ones).
    dynamic_sampling: bool = True

    def __post_init__(self):
        if not _is_whole(self.batch_size) or self.batch_size < 1:
            raise ConfigError(f"algorithm.batch_size: must be a whole number of groups >= 1, got {self.batch_size!r}")
        if not _is_whole(self.group_size) or self.group_size < 2:
            raise ConfigError(f"algorithm.group_size: must be a whole number >= 2 (a group of one response has no "
                              f"contrast and is always filtered), got {self.group_size!r}")
        if (isinstance(self.oversample_factor, bool) or not isinstance(self.oversample_factor, (int, float))
                or not math.isfinite(self.oversample_factor) or self.oversample_factor < 1):
            raise ConfigError(f"algorithm.oversample_factor: must be a finite number >= 1, "
                              f"got {self.oversample_factor!r}")
        if not _is_whole(self.max_sampling_rounds) or self.max_sampling_rounds < 1:
            raise ConfigError(f"algorithm.max_sampling_rounds: must be a whole number >= 1, "
                              f"got {self.max_sampling_rounds!r}")
        if (isinstance(self.advantage_eps, bool) or not isinstance(self.advantage_eps, (int, float))
                or not 0 < self.advantage_eps < 1):
            raise ConfigError(f"algorithm.advantage_eps: must be a number in (0, 1), got {self.advantage_eps!r}")
        if self.overlong_penalty:
            check_overlong_lengths(self.max_response_len, self.overlong_cache_len)
        else:  # the penalty's interval is unused
            check_max_response_len(self.max_response_len)
        for key in ("overlong_penalty", "overlong_filter", "dynamic_sampling"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"algorithm.{key}: must be true or false, got {getattr(self, key)!r}")
        if not self.dynamic_sampling and self.oversample_factor != 1:
            raise ConfigError(f"algorithm.oversample_factor: {self.oversample_factor:g} draws extra prompts for "
                              "dynamic sampling, which algorithm.dynamic_sampling false turns off; set it to 1, or "
                              "algorithm.dynamic_sampling to true")

    def check_data_parallel(self, dp_size: int) -> None:
        """Every data-parallel rank trains on the same number of whole groups."""
        if not _is_whole(dp_size) or dp_size < 1:
            raise ValueError(f"dp_size: must be a whole number >= 1, got {dp_size!r}")
        if self.batch_size % dp_size:
            raise ConfigError(f"algorithm.batch_size: {self.batch_size} groups do not divide across {dp_size} "
                              f"data-parallel ranks; use a multiple of {dp_size}")
