"""The DAPO algorithm between rollout and loss: length penalty, rewards, advantages, dynamic sampling."""

from megatron_dapo.algorithm.advantages import group_advantages, sample_rewards
from megatron_dapo.algorithm.config import AlgorithmConfig
from megatron_dapo.algorithm.dynamic_sampling import DynamicSampler
from megatron_dapo.algorithm.overlong import overlong_loss_mask, overlong_penalty
from megatron_dapo.algorithm.rollout_batch import PromptItem, RolloutBatch, SamplingMetrics, ScoredGroup

__all__ = ["AlgorithmConfig", "DynamicSampler", "PromptItem", "RolloutBatch", "SamplingMetrics", "ScoredGroup",
           "group_advantages", "overlong_loss_mask", "overlong_penalty", "sample_rewards"]
