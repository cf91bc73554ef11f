"""Rewards and group-relative advantages (GRPO / DAPO): each response against its own group."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.algorithm.config import AlgorithmConfig
from megatron_dapo.algorithm.overlong import overlong_penalty

CORRECT_REWARD = 1.0
WRONG_REWARD = -1.0


def sample_rewards(correct: Sequence[bool], lengths: Sequence[int], cfg: AlgorithmConfig) -> torch.Tensor:
    """Per response, float64: +1 if the verifier accepts its answer, else -1, plus Eq. 13's length penalty."""
    if len(correct) != len(lengths):
        raise ValueError(f"sample_rewards: {len(correct)} verdicts for {len(lengths)} responses")
    rewards = torch.tensor([CORRECT_REWARD if c else WRONG_REWARD for c in correct], dtype=torch.float64)
    if cfg.overlong_penalty:
        rewards = rewards + overlong_penalty(lengths, cfg.max_response_len, cfg.overlong_cache_len)
    return rewards


def group_advantages(rewards: Sequence[float] | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) over one group's G rewards, in float64.

    std is the sample standard deviation (Bessel-corrected, as torch.std), which needs G >= 2. A group
    whose rewards are all equal gets advantages of 0: it carries no direction, which is why dynamic
    sampling drops such groups rather than training on them.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 1 or r.numel() < 2:
        raise ValueError(f"group_advantages: rewards must be 1-D with at least 2 entries (one group of G >= 2 "
                         f"responses), got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError(f"group_advantages: rewards must be finite, got {r.tolist()}")
    if not eps > 0:
        raise ValueError(f"group_advantages: eps must be > 0 (algorithm.advantage_eps), got {eps}")
    return (r - r.mean()) / (r.std() + eps)
