"""What dynamic sampling hands the trainer: scored groups of responses and the step's sampling metrics."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from megatron_dapo.samples import PromptItem, Sample, TrainItem


@dataclass(frozen=True)
class ScoredGroup:
    """The G responses to one prompt, judged, with their rewards and group-relative advantages."""

    prompt: PromptItem
    samples: list[Sample]  # in the engine's order; each carries the engine's per-token log-probs
    rollout_logprobs: list[torch.Tensor]  # per response, float32 [len]: the engine's log-probs (mismatch, truncated IS)
    correct: list[bool]
    rewards: torch.Tensor  # [G] float64: +1 / -1 plus the overlong penalty
    advantages: torch.Tensor  # [G] float64, one per response, shared by all its tokens
    loss_mask: torch.Tensor  # [G] bool: False for a response left out of the loss (overlong filtering)

    @property
    def num_correct(self) -> int:
        return sum(self.correct)

    @property
    def response_lens(self) -> list[int]:
        return [len(s.output_ids) for s in self.samples]


@dataclass(frozen=True)
class SamplingMetrics:
    """How one training batch was collected. What it cost counts every group the engine completed; the rates
    and lengths are over the settled groups (the ones dynamic sampling took in draw order, kept or dropped: the
    same whatever order groups completed in), NaN when there were none."""

    rounds: int  # generation rounds used
    round_cap_hit: bool  # the batch was not full after algorithm.max_sampling_rounds
    groups_generated: int  # groups the engine completed, settled or not (aborted ones not counted)
    groups_aborted: int  # groups drawn but cancelled before they completed: not needed for the batch
    groups_settled: int  # groups taken in draw order: kept + trimmed + all correct + all wrong + stale
    groups_kept: int  # groups in the training batch
    groups_all_correct: int  # every response right (dropped, with dynamic sampling)
    groups_all_wrong: int  # every response wrong (dropped, with dynamic sampling)
    groups_trimmed: int  # mixed groups left out so that the batch divides across data-parallel ranks
    groups_stale: int  # usable groups dropped: started by weights older than rollout.max_staleness allows
    prompts_drawn: int  # prompts taken from the data for this batch (settled, aborted or left over)
    samples_generated: int  # responses of the groups generated
    samples_per_kept_sample: float  # samples_generated / responses in the batch (inf if the batch is empty)
    accuracy: float  # fraction of the settled groups' responses judged correct
    reward_mean: float  # over the settled groups' responses, overlong penalty included
    response_len_mean: float  # over the settled groups' responses
    response_len_max: int
    truncation_rate: float  # fraction of the settled groups' responses cut off at max_response_len
    # The entropy of the sampling distribution per token of the settled groups' responses, kept or dropped (the
    # same tokens whatever the recipe keeps); None where the engine does not report it (Sample.entropy_sum).
    rollout_entropy: float | None = None

    @property
    def filter_rate(self) -> float:
        return _ratio(self.groups_all_correct + self.groups_all_wrong, self.groups_settled)

    @property
    def filter_rate_all_correct(self) -> float:
        return _ratio(self.groups_all_correct, self.groups_settled)

    @property
    def filter_rate_all_wrong(self) -> float:
        return _ratio(self.groups_all_wrong, self.groups_settled)

    def as_dict(self) -> dict[str, float]:
        out = {k: float(v) for k, v in asdict(self).items() if v is not None}
        out.update(filter_rate=self.filter_rate, filter_rate_all_correct=self.filter_rate_all_correct,
                   filter_rate_all_wrong=self.filter_rate_all_wrong)
        return out


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


@dataclass(frozen=True)
class RolloutBatch:
    groups: list[ScoredGroup]  # a multiple of the data-parallel size; empty when nothing could be kept
    metrics: SamplingMetrics

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    def train_items(self) -> list[TrainItem]:
        """The batch's responses, groups in prompt order: the order groups completed in does not matter."""
        groups = sorted(self.groups, key=lambda g: g.prompt.index)
        return [TrainItem(g.prompt.token_ids, list(s.output_ids), list(s.logprobs), float(g.advantages[i]),
                          bool(g.loss_mask[i]), s.routes)
                for g in groups for i, s in enumerate(g.samples)]
