"""DAPO's dynamic sampling: keep drawing prompts until the batch holds B groups of mixed correctness.

A group whose G responses are all right or all wrong says nothing about what makes an answer right, so it is
dropped (its advantages are 0, or with the overlong penalty on, set by the lengths alone). Each round samples
ceil(groups still needed x oversample_factor) prompts. The batch is exactly the
one a full synchronous generation would give: the first B mixed groups in the order the prompts were drawn
(rounds continue that order), never the first B to complete, which would favour prompts with short responses.
Generation still streams: a completed group is taken (kept or dropped) once every group drawn before it has
been, and the groups drawn after the B-th mixed one are aborted as soon as that is known. Counting only the
mixed groups completed so far, the position of the (still needed)-th one is an upper bound on the true one, so
everything drawn after it is aborted at once. A mixed group whose oldest token was sampled by weights older
than `min_version` (set per batch by rollout.mode async) is dropped like an unmixed one. With the in-process
engine a round is generated whole and judged in one call (`score_as_completed`), which takes the same batch. After
algorithm.max_sampling_rounds the step goes on with what was kept (and a warning; an info line if nothing was), the
batch trimmed from its end (in draw order) so that it divides across data-parallel ranks.

With algorithm.dynamic_sampling off (GRPO) every group is usable: the batch is the first B groups drawn, groups
without contrast included (their advantages 0, or the overlong penalty's alone); only stale groups (rollout.mode
async) are dropped and drawn again.
"""

from __future__ import annotations

import bisect
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
from megatron_dapo.samples import version_number

log = logging.getLogger(__name__)

PromptSource = Callable[[int], Sequence[PromptItem]]  # k -> the next k prompts
# groups (a prompt and its responses) -> per group, the correctness of each response
ScoreGroups = Callable[[Sequence[tuple[PromptItem, Sequence[Sample]]]], Sequence[Sequence[bool]]]


class DynamicSampler:
    """`score_as_completed`: judge each group as it completes, so that the groups past the batch are aborted as
    soon as that is known (an engine that generates by itself while groups are judged: SGLang). False: judge a
    round's groups together once its stream has ended, in one call that keeps every reward worker busy (the
    in-process engine, which generates only while its stream is read: judging a group there would stop
    generation, and aborting its rows saves little, as the rows of a batch decode together)."""

    def __init__(self, engine: Engine, score_groups: ScoreGroups, next_prompts: PromptSource,
                 cfg: AlgorithmConfig, params: SamplingParams, dp_size: int = 1, score_as_completed: bool = True):
        cfg.check_data_parallel(dp_size)
        self.engine = engine
        self.score_groups = score_groups
        self.score_as_completed = score_as_completed
        self.next_prompts = next_prompts
        self.cfg = cfg
        self.params = params
        self.dp_size = dp_size
        self.min_version: int | None = None  # groups started by older weights are stale

    def collect(self) -> RolloutBatch:
        """One training batch: the first B usable groups in draw order (with dynamic sampling, those of G responses
        with 0 < #correct < G)."""
        cfg = self.cfg
        kept: list[ScoredGroup] = []  # in draw order
        tally = _Tally()
        for round_ in range(1, cfg.max_sampling_rounds + 1):
            tally.rounds = round_
            prompts = self._draw_prompts(math.ceil((cfg.batch_size - len(kept)) * cfg.oversample_factor), tally)
            params = self.params
            if params.seed is not None:  # each round draws with its own seeds
                params = dataclasses.replace(params, seed=sample_seed(params.seed, round_))
            kept += self._round(prompts, params, cfg.batch_size - len(kept), tally)
            if len(kept) == cfg.batch_size:
                break
        else:  # every round ran without filling the batch
            tally.round_cap_hit = True
            if kept:
                log.warning("dynamic sampling: kept %d of %d groups after %d rounds (algorithm.max_sampling_rounds); "
                            "of %d groups generated, %d were all correct and %d all wrong. Training on what was kept; "
                            "if this persists the data is too easy or too hard for the policy.", len(kept),
                            cfg.batch_size, cfg.max_sampling_rounds, tally.groups, tally.all_correct, tally.all_wrong)

        usable = len(kept) - len(kept) % self.dp_size
        if usable < len(kept):
            log.warning("dynamic sampling: left out %d of %d kept groups so that the batch divides across %d "
                        "data-parallel ranks", len(kept) - usable, len(kept), self.dp_size)
        if usable == 0:
            # Info, not a warning, per step: the trainer's EmptyStepWatch warns once, with the numbers, when
            # empty steps go on.
            log.info("dynamic sampling: the batch is empty after %d rounds (algorithm.max_sampling_rounds): of %d "
                     "groups generated, %d were all correct and %d all wrong; this step has nothing to train on",
                     tally.rounds, tally.groups, tally.all_correct, tally.all_wrong)
        batch = kept[:usable]
        return RolloutBatch(batch, tally.metrics(kept=batch, trimmed=len(kept) - usable))

    def _round(self, prompts: list[PromptItem], params: SamplingParams, need: int, tally: _Tally) -> list[ScoredGroup]:
        """The first `need` mixed groups of these prompts, in their order, generating as little past them as it can."""
        stream = self.engine.stream([p.token_ids for p in prompts], self.cfg.group_size, params)
        if not self.score_as_completed:
            return self._whole_round(stream, prompts, need, tally)
        kept: list[ScoredGroup] = []
        completed: dict[int, ScoredGroup] = {}  # completed, waiting for the groups drawn before them
        mixed: list[int] = []  # the indices in `completed` of usable groups, ascending
        settled = 0  # groups [0, settled) are taken: kept or dropped
        end = len(prompts)  # groups [end, ...) are not needed: aborted, or left out if they completed
        received = 0
        try:
            for samples in stream:
                index = self._check_group(prompts, samples)
                if index >= end:
                    continue  # cancelled, but the engine handed it out all the same: not needed
                if index < settled or index in completed:
                    raise RuntimeError(f"dynamic sampling: the engine returned the group of prompt {index} twice")
                received += 1
                group = self._score([(prompts[index], samples)])[0]
                tally.generated(group)
                completed[index] = group
                if self._usable(group):
                    bisect.insort(mixed, index)
                while settled in completed:  # take groups in draw order
                    group = completed.pop(settled)
                    tally.settle(group)
                    if self._usable(group):
                        kept.append(group)
                        mixed.pop(0)
                    elif self._wanted(group):
                        tally.stale += 1
                    settled += 1
                    if len(kept) == need:
                        break
                if len(kept) == need or settled == end:
                    break
                # The (need - kept)-th usable group completed so far bounds where the last needed one is.
                if len(mixed) >= need - len(kept):
                    cut = mixed[need - len(kept) - 1] + 1
                    if cut < end:
                        stream.abort([i for i in range(cut, end) if i not in completed])
                        for i in [i for i in completed if i >= cut]:
                            del completed[i]
                        del mixed[need - len(kept):]
                        end = cut
        finally:
            stream.abort()  # the batch is full (or scoring failed): stop generating what is left
            tally.aborted += len(prompts) - received
        if len(kept) < need and settled < end:
            raise RuntimeError(f"dynamic sampling: the engine's stream ended with {end - settled - len(completed)} "
                               f"of {len(prompts)} groups never returned")
        return kept

    def _whole_round(self, stream, prompts: list[PromptItem], need: int, tally: _Tally) -> list[ScoredGroup]:
        """The first `need` mixed groups of a round generated whole, judged in one call once all are in (judging
        them during generation, in a thread, measured no faster: on a shared CPU the judge's work and the
        engine's take turns on the same cores)."""
        groups: dict[int, Sequence[Sample]] = {}
        try:
            for samples in stream:
                index = self._check_group(prompts, samples)
                if index in groups:
                    raise RuntimeError(f"dynamic sampling: the engine returned the group of prompt {index} twice")
                groups[index] = samples
        finally:
            stream.abort()  # after a failed check: generate no more
        if len(groups) < len(prompts):
            raise RuntimeError(f"dynamic sampling: the engine's stream ended with {len(prompts) - len(groups)} of "
                               f"{len(prompts)} groups never returned")
        kept: list[ScoredGroup] = []
        for group in self._score([(prompts[i], groups[i]) for i in range(len(prompts))]):  # settled in draw order
            tally.generated(group)
            if len(kept) < need:
                tally.settle(group)
                if self._usable(group):
                    kept.append(group)
                elif self._wanted(group):
                    tally.stale += 1
        return kept

    def _mixed(self, group: ScoredGroup) -> bool:
        """0 < #correct < G: the group has contrast, its advantages are not all zero."""
        return 0 < group.num_correct < self.cfg.group_size

    def _wanted(self, group: ScoredGroup) -> bool:
        """What the rule keeps, staleness aside: a mixed group, or any with dynamic sampling off."""
        return self._mixed(group) or not self.cfg.dynamic_sampling

    def _usable(self, group: ScoredGroup) -> bool:
        """Wanted, and no response started by weights older than min_version."""
        return self._wanted(group) and (self.min_version is None or min(
            version_number(s.weight_version) for s in group.samples) >= self.min_version)

    def _draw_prompts(self, k: int, tally: _Tally) -> list[PromptItem]:
        prompts = list(self.next_prompts(k))
        if not prompts:
            raise RuntimeError(f"dynamic sampling: the prompt source returned no prompts (asked for {k})")
        tally.drawn += len(prompts)
        return prompts

    def _check_group(self, prompts: list[PromptItem], samples: list[Sample]) -> int:
        """The prompt index of a group the engine returned, after checking its shape."""
        g = self.cfg.group_size
        index = {s.prompt_index for s in samples}
        if len(samples) != g or len(index) != 1 or not 0 <= next(iter(index)) < len(prompts):
            raise RuntimeError(f"dynamic sampling: the engine returned a group of {len(samples)} samples for prompt "
                               f"indices {sorted(index)}; expected {g} samples of one prompt in [0, {len(prompts)})")
        for s in samples:
            if len(s.logprobs) != len(s.output_ids):
                raise RuntimeError(f"dynamic sampling: a sample has {len(s.logprobs)} log-probs for "
                                   f"{len(s.output_ids)} tokens; the engine must return one per token")
        return samples[0].prompt_index

    def _score(self, groups: list[tuple[PromptItem, Sequence[Sample]]]) -> list[ScoredGroup]:
        """Judge these groups (in one call) and turn their verdicts into rewards, advantages and loss masks."""
        if not groups:
            return []
        verdicts = self._verdict_lists(self.score_groups(groups), len(groups))
        return [self._scored(prompt, samples, correct) for (prompt, samples), correct in zip(groups, verdicts)]

    @staticmethod
    def _verdict_lists(verdicts, num_groups: int) -> list[Sequence[bool]]:
        verdicts = list(verdicts)
        if len(verdicts) != num_groups:
            raise RuntimeError(f"dynamic sampling: score_groups returned {len(verdicts)} lists of verdicts for "
                               f"{num_groups} groups")
        return verdicts

    def _scored(self, prompt: PromptItem, samples: Sequence[Sample], verdicts: Sequence[bool]) -> ScoredGroup:
        g = self.cfg.group_size
        correct = [bool(c) for c in verdicts]
        if len(correct) != g:
            raise RuntimeError(f"dynamic sampling: score_groups returned {len(correct)} verdicts for a group of {g} "
                               "responses")
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
    """Running counts (not kept in memory: most groups are dropped). Cost counts every group the engine
    completed; the rates count the settled ones, the draw-order prefix the rule took (kept or dropped),
    which is the same whatever order the groups completed in."""

    def __init__(self):
        self.rounds = 0
        self.round_cap_hit = False
        self.generated_groups = self.generated_samples = self.aborted = self.drawn = self.stale = 0
        self.groups = self.all_correct = self.all_wrong = 0
        self.samples = self.correct = self.truncated = self.len_sum = self.len_max = 0
        self.reward_sum = 0.0
        self.entropy_sum: float | None = 0.0  # None once a response comes without its entropies

    def generated(self, group: ScoredGroup) -> None:
        self.generated_groups += 1
        self.generated_samples += len(group.samples)

    def settle(self, group: ScoredGroup) -> None:
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
        entropies = [s.entropy_sum for s in group.samples]
        self.entropy_sum = None if self.entropy_sum is None or None in entropies else self.entropy_sum + sum(entropies)

    def metrics(self, kept: list[ScoredGroup], trimmed: int) -> SamplingMetrics:
        kept_samples = sum(len(g.samples) for g in kept)

        def per_sample(total: float) -> float:
            return total / self.samples if self.samples else math.nan

        return SamplingMetrics(
            rounds=self.rounds,
            round_cap_hit=self.round_cap_hit,
            groups_generated=self.generated_groups,
            groups_aborted=self.aborted,
            groups_settled=self.groups,
            groups_kept=len(kept),
            groups_all_correct=self.all_correct,
            groups_all_wrong=self.all_wrong,
            groups_trimmed=trimmed,
            groups_stale=self.stale,
            prompts_drawn=self.drawn,
            samples_generated=self.generated_samples,
            samples_per_kept_sample=self.generated_samples / kept_samples if kept_samples else math.inf,
            accuracy=per_sample(self.correct),
            reward_mean=per_sample(self.reward_sum),
            response_len_mean=per_sample(self.len_sum),
            response_len_max=self.len_max,
            truncation_rate=per_sample(self.truncated),
            rollout_entropy=None if self.entropy_sum is None or not self.len_sum else self.entropy_sum / self.len_sum,
        )
