"""Verifiable-math reward: math-verify judges each response's final answer in a pool of worker processes."""

from megatron_dapo.reward.config import RewardConfig
from megatron_dapo.reward.pool import RewardPool
from megatron_dapo.reward.verdict import Verdict

__all__ = ["RewardConfig", "RewardPool", "Verdict"]
