"""DAPO's dynamic sampling: keep drawing prompts until the batch holds B groups of mixed correctness.

A group whose G responses are all right or all wrong has zero advantages and teaches nothing, so it
is dropped. Each round samples ceil(groups still needed x oversample_factor) prompts, consumes
groups as the engine completes them, and aborts the round's remaining generation once the batch is
full. After algorithm.max_sampling_rounds the step goes on with what was kept (and a warning), the
batch trimmed so that it divides across data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch

from megatron_dapo.algorithm.advantages import group_advantages, sample_rewards
from megatron_dapo.algorithm.config import AlgorithmConfig
from megatron_dapo.algorithm.overlong import TRUNCATED, overlong_loss_mask
from megatron_dapo.algorithm.rollout_batch import PromptItem, RolloutBatch, SamplingMetrics, ScoredGroup
from megatron_dapo.rollout.engine import Engine, Sample, SamplingParams, sample_seed

log = logging.getLogger(__name__)

PromptSource = Callable[[int], Sequence[PromptItem]]  # k -> the next k prompts
ScoreGroup = Callable[[PromptItem, Sequence[Sample]], Sequence[bool]]  # -> correctness of each response


class DynamicSampler:
    def __init__(self, engine: Engine, score_group: ScoreGroup, next_prompts: PromptSource,
                 cfg: AlgorithmConfig, params: SamplingParams, dp_size: int = 1):
        cfg.check_data_parallel(dp_size)
        self.engine = engine
        self.score_group = score_group
        self.next_prompts = next_prompts
        self.cfg = cfg
        self.params = params
        self.dp_size = dp_size

    def collect(self) -> RolloutBatch:
        """One training batch: up to B groups of G responses with 0 < #correct < G."""
        cfg = self.cfg
        kept: list[ScoredGroup] = []
        tally = _Tally()
        for round_ in range(1, cfg.max_sampling_rounds + 1):
            tally.rounds = round_
            prompts = self._draw_prompts(math.ceil((cfg.batch_size - len(kept)) * cfg.oversample_factor))
            params = self.params
            if params.seed is not None:  # each round draws with its own seeds
                params = dataclasses.replace(params, seed=sample_seed(params.seed, round_))
            stream = self.engine.stream([p.token_ids for p in prompts], cfg.group_size, params)
            try:
                for samples in stream:
                    group = self._score(prompts, samples)
                    tally.add(group)
                    if 0 < group.num_correct < cfg.group_size:  # mixed correctness: the group has contrast
                        kept.append(group)
                    if len(kept) == cfg.batch_size:
                        break
            finally:
                stream.abort()  # the batch is full (or scoring failed): stop generating what is left
            if len(kept) == cfg.batch_size:
                break
        else:  # every round ran without filling the batch
            tally.round_cap_hit = True
            log.warning("dynamic sampling: kept %d of %d groups after %d rounds (algorithm.max_sampling_rounds); "
                        "of %d groups generated, %d were all correct and %d all wrong. Training on what was kept; "
                        "if this persists the data is too easy or too hard for the policy.", len(kept),
                        cfg.batch_size, cfg.max_sampling_rounds, tally.groups, tally.all_correct, tally.all_wrong)

        usable = len(kept) - len(kept) % self.dp_size
        if usable < len(kept):
            log.warning("dynamic sampling: left out %d of %d kept groups so that the batch divides across %d "
                        "data-parallel ranks", len(kept) - usable, len(kept), self.dp_size)
        if usable == 0:
            log.warning("dynamic sampling: the batch is empty; this step has nothing to train on")
        batch = kept[:usable]
        return RolloutBatch(batch, tally.metrics(kept=batch, trimmed=len(kept) - usable))

    def _draw_prompts(self, k: int) -> list[PromptItem]:
        prompts = list(self.next_prompts(k))
        if not prompts:
            raise RuntimeError(f"dynamic sampling: the prompt source returned no prompts (asked for {k})")
        return prompts

    def _score(self, prompts: list[PromptItem], samples: list[Sample]) -> ScoredGroup:
        """Judge one group and turn its verdicts (and lengths) into rewards, advantages and loss masks."""
        g = self.cfg.group_size
        index = {s.prompt_index for s in samples}
        if len(samples) != g or len(index) != 1 or not 0 <= next(iter(index)) < len(prompts):
            raise RuntimeError(f"dynamic sampling: the engine returned a group of {len(samples)} samples for prompt "
                               f"indices {sorted(index)}; expected {g} samples of one prompt in [0, {len(prompts)})")
        for s in samples:
            if len(s.logprobs) != len(s.output_ids):
                raise RuntimeError(f"dynamic sampling: a sample has {len(s.logprobs)} log-probs for "
                                   f"{len(s.output_ids)} tokens; the engine must return one per token")
        prompt = prompts[samples[0].prompt_index]
        correct = [bool(c) for c in self.score_group(prompt, samples)]
        if len(correct) != g:
            raise RuntimeError(f"dynamic sampling: score_group returned {len(correct)} verdicts for {g} responses")
        rewards = sample_rewards(correct, [len(s.output_ids) for s in samples], self.cfg)
        return ScoredGroup(
            prompt=prompt,
            samples=list(samples),
            rollout_logprobs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
            correct=correct,
            rewards=rewards,
            advantages=group_advantages(rewards, self.cfg.advantage_eps),
            loss_mask=overlong_loss_mask([s.finish_reason for s in samples], self.cfg.overlong_filter),
        )


class _Tally:
    """Running counts over every generated group (not kept in memory: most are dropped)."""

    def __init__(self):
        self.rounds = 0
        self.round_cap_hit = False
        self.groups = self.all_correct = self.all_wrong = 0
        self.samples = self.correct = self.truncated = self.len_sum = self.len_max = 0
        self.reward_sum = 0.0

    def add(self, group: ScoredGroup) -> None:
        lens = group.response_lens
        self.groups += 1
        self.all_correct += group.num_correct == len(lens)
        self.all_wrong += group.num_correct == 0
        self.samples += len(lens)
        self.correct += group.num_correct
        self.truncated += sum(s.finish_reason == TRUNCATED for s in group.samples)
        self.len_sum += sum(lens)
        self.len_max = max(self.len_max, *lens)
        self.reward_sum += float(group.rewards.sum())

    def metrics(self, kept: list[ScoredGroup], trimmed: int) -> SamplingMetrics:
        kept_samples = sum(len(g.samples) for g in kept)

        def per_sample(total: float) -> float:
            return total / self.samples if self.samples else math.nan

        return SamplingMetrics(
            rounds=self.rounds,
            round_cap_hit=self.round_cap_hit,
            groups_generated=self.groups,
            groups_kept=len(kept),
            groups_all_correct=self.all_correct,
            groups_all_wrong=self.all_wrong,
            groups_trimmed=trimmed,
            samples_generated=self.samples,
            samples_per_kept_sample=self.samples / kept_samples if kept_samples else math.inf,
            accuracy=per_sample(self.correct),
            reward_mean=per_sample(self.reward_sum),
            response_len_mean=per_sample(self.len_sum),
            response_len_max=self.len_max,
            truncation_rate=per_sample(self.truncated),
        )
