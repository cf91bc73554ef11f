"""The DAPO algorithm's rules between rollout and loss: length penalty, rewards, advantages, and the batch's record
types. Dynamic sampling, which drives the engine by these rules, is the rollout service's
(service/dynamic_sampler.py)."""

from megatron_dapo.algorithm.advantages import group_advantages, sample_rewards
from megatron_dapo.algorithm.config import AlgorithmConfig
from megatron_dapo.algorithm.overlong import overlong_loss_mask, overlong_penalty
from megatron_dapo.algorithm.rollout_batch import PromptItem, RolloutBatch, SamplingMetrics, ScoredGroup

__all__ = ["AlgorithmConfig", "PromptItem", "RolloutBatch", "SamplingMetrics", "ScoredGroup", "group_advantages",
           "overlong_loss_mask", "overlong_penalty", "sample_rewards"]
