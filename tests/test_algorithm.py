"""The algorithm between rollout and loss: Eq. 13, overlong filtering, group advantages, dynamic sampling.

Dynamic sampling runs against a scripted engine: each prompt's token ids spell its group's outcomes
(C correct, W wrong, L correct but in the overlong interval, T truncated and wrong), and a group
completes when its longest response does: short groups first, ties in reverse prompt order, as a real
engine returns them in any order. The kept batch must not depend on that order.
"""

import dataclasses
import logging
import math
import statistics

import pytest
import torch

from megatron_dapo.algorithm import (
    AlgorithmConfig,
    PromptItem,
    group_advantages,
    overlong_loss_mask,
    overlong_penalty,
    sample_rewards,
)
from megatron_dapo.config import ConfigError
from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.rollout.engine import Sample, SamplingParams
from megatron_dapo.service.dynamic_sampler import DynamicSampler

L_MAX, L_CACHE = 16, 8
LENGTHS = {"C": 3, "W": 5, "L": 12, "T": L_MAX}  # L: 4 tokens into the 8-token interval, penalty -0.5
SAMPLER_LOG = "megatron_dapo.service.dynamic_sampler"


# --- a scripted engine and prompt source ---------------------------------------------------------------


class ScriptedStream:
    def __init__(self, groups):
        # Completion order: by the group's longest response, ties in reverse prompt order.
        self.pending = sorted(groups, key=lambda g: (max(len(s.output_ids) for s in g), -g[0].prompt_index))
        self.handed_out = []  # prompt indices, in the order handed out
        self.aborted = []  # prompt indices cancelled one by one, before they were handed out
        self.pending_at_abort = None  # groups still pending at the first abort()

    def __iter__(self):
        while self.pending:
            group = self.pending.pop(0)
            self.handed_out.append(group[0].prompt_index)
            yield group

    def abort(self, indices=None):
        if indices is None:
            if self.pending_at_abort is None:
                self.pending_at_abort = len(self.pending)
            self.pending.clear()
            return
        indices = set(indices)
        assert not indices & set(self.handed_out), "cancelled a group that was handed out already"
        self.aborted += sorted(indices)
        self.pending = [g for g in self.pending if g[0].prompt_index not in indices]


class ScriptedEngine:
    def __init__(self, group_size_override=None, entropy_per_token=None):
        self.streams = []
        self.group_size_override = group_size_override
        self.entropy_per_token = entropy_per_token  # outcome -> nats a token, reported as the local engine does

    def stream(self, prompts, n, params):
        groups = []
        for i, ids in enumerate(prompts):
            pattern = "".join(map(chr, ids))
            assert len(pattern) == n
            groups.append([_sample(i, j, c, self.entropy_per_token) for j, c in enumerate(pattern)]
                          [: self.group_size_override or n])
        self.streams.append(ScriptedStream(groups))
        return self.streams[-1]


def _sample(prompt_index, j, outcome, entropy_per_token=None):
    n = LENGTHS[outcome]
    logprobs = [-0.1 * (j + 1) - 0.01 * t for t in range(n)]
    entropy = None if entropy_per_token is None else n * entropy_per_token[outcome]
    return Sample(prompt_index, list(range(100, 100 + n)), logprobs, "length" if outcome == "T" else "stop", "v0",
                  entropy_sum=entropy)


class Prompts:
    """Cycles through outcome patterns; records how many prompts each round asked for."""

    def __init__(self, patterns, then=None):
        self.patterns, self.then = patterns, then
        self.asked = []
        self.next_index = 0

    def __call__(self, k):
        self.asked.append(k)
        items = []
        for _ in range(k):
            i = self.next_index
            self.next_index += 1
            if self.then is not None and i >= len(self.patterns):
                pattern = self.then
            else:
                pattern = self.patterns[i % len(self.patterns)]
            items.append(PromptItem(i, [ord(c) for c in pattern], pattern))
        return items


def score_groups(groups):
    return [[prompt.ground_truth[j] in "CL" for j in range(len(samples))] for prompt, samples in groups]


def make_sampler(patterns, then=None, dp_size=1, engine=None, score_as_completed=True, **cfg):
    cfg = {"batch_size": 4, "group_size": 4, "max_response_len": L_MAX, "overlong_cache_len": L_CACHE, **cfg}
    prompts = Prompts(patterns, then)
    engine = engine or ScriptedEngine()
    sampler = DynamicSampler(engine, score_groups, prompts, AlgorithmConfig(**cfg),
                             SamplingParams(max_new_tokens=L_MAX), dp_size=dp_size,
                             score_as_completed=score_as_completed)
    return sampler, engine, prompts


# --- Eq. 13 ---------------------------------------------------------------------------------------------


def test_overlong_penalty_at_the_boundaries():
    # L_max 16, L_cache 8: free up to 8 tokens, then -1/8 per token, -1 from 16 on.
    got = overlong_penalty([0, 8, 9, 12, 15, 16, 17, 100], max_response_len=16, cache_len=8)
    assert got.dtype == torch.float64
    assert got.tolist() == [0.0, 0.0, -0.125, -0.5, -0.875, -1.0, -1.0, -1.0]


def test_overlong_penalty_paper_defaults():
    got = overlong_penalty(torch.tensor([16384, 16385, 18432, 20479, 20480, 20481]), 20480, 4096)
    assert got.tolist() == [0.0, -1 / 4096, -0.5, -4095 / 4096, -1.0, -1.0]


def test_overlong_penalty_without_a_cache_is_a_step():
    assert overlong_penalty([0, 16, 17], 16, 0).tolist() == [0.0, 0.0, -1.0]
    assert overlong_penalty([0, 1, 8, 16, 17], 16, 16).tolist() == [0.0, -1 / 16, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("l_max, l_cache, key", [
    (16, 17, "algorithm.overlong_cache_len"),
    (16, -1, "algorithm.overlong_cache_len"),
    (0, 0, "algorithm.max_response_len"),
    (16.0, 8, "algorithm.max_response_len"),
    (True, 0, "algorithm.max_response_len"),
])
def test_overlong_bad_lengths_name_the_key(l_max, l_cache, key):
    with pytest.raises(ConfigError, match=key):
        overlong_penalty([1, 2], l_max, l_cache)
    with pytest.raises(ConfigError, match=key):
        AlgorithmConfig(max_response_len=l_max, overlong_cache_len=l_cache)


def test_overlong_penalty_rejects_negative_lengths():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        overlong_penalty([3, -1], 16, 8)


# --- overlong filtering -----------------------------------------------------------------------------------


def test_overlong_loss_mask():
    reasons = ["stop", "length", "stop", "length"]
    assert overlong_loss_mask(reasons, filter_truncated=True).tolist() == [True, False, True, False]
    assert overlong_loss_mask(reasons, filter_truncated=False).tolist() == [True] * 4


def _token_grads(group):
    """d dapo_loss / d logp for the group's responses packed into one micro-batch (as the trainer packs them)."""
    lens = torch.tensor(group.response_lens)
    old = torch.cat(group.rollout_logprobs).double()
    logp = (old + 0.01 * torch.sin(torch.arange(old.numel(), dtype=torch.float64))).requires_grad_()
    adv = group.advantages.repeat_interleave(lens)
    mask = group.loss_mask.repeat_interleave(lens)
    loss, stats = dapo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, normalizer=int(mask.sum()))
    loss.backward()
    assert stats.num_tokens.item() == mask.sum().item()
    return logp.grad, lens


@pytest.mark.parametrize("overlong_filter", [True, False])
def test_filtered_samples_get_no_gradient_through_the_fused_loss(overlong_filter):
    sampler, _, _ = make_sampler(["CWTL"], batch_size=1, overlong_filter=overlong_filter)
    (group,) = sampler.collect().groups
    assert group.loss_mask.tolist() == [True, True, not overlong_filter, True]
    grad, lens = _token_grads(group)
    per_sample = grad.split(lens.tolist())
    assert (per_sample[2] == 0).all() == overlong_filter  # the truncated response
    for i in (0, 1, 3):
        assert (per_sample[i] != 0).all()


# --- rewards and advantages ---------------------------------------------------------------------------------


def test_rewards_are_correctness_plus_overlong_penalty():
    cfg = AlgorithmConfig(max_response_len=16, overlong_cache_len=8)
    lens = [LENGTHS[c] for c in "CLWT"]
    assert sample_rewards([True, True, False, False], lens, cfg).tolist() == [1.0, 0.5, -1.0, -2.0]
    off = AlgorithmConfig(max_response_len=16, overlong_cache_len=8, overlong_penalty=False)
    assert sample_rewards([True, True, False, False], lens, off).tolist() == [1.0, 1.0, -1.0, -1.0]


@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_match_a_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.randn(16, generator=g, dtype=torch.float64) * 3).tolist()
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    expected = torch.tensor([(r - mean) / (std + 1e-6) for r in rewards], dtype=torch.float64)
    got = group_advantages(rewards, eps=1e-6)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
    # Invariant to a shift and (up to eps) a positive scale of the rewards.
    torch.testing.assert_close(group_advantages([5 * r + 7 for r in rewards], eps=1e-12),
                               group_advantages(rewards, eps=1e-12), rtol=1e-10, atol=1e-10)


def test_group_advantages_of_plus_minus_one():
    # 2 right, 2 wrong: mean 0, sample std sqrt(4/3).
    got = group_advantages([1.0, 1.0, -1.0, -1.0], eps=1e-6)
    torch.testing.assert_close(got, torch.tensor([1, 1, -1, -1], dtype=torch.float64) / (math.sqrt(4 / 3) + 1e-6))
    assert group_advantages([1.0] * 4).tolist() == [0.0] * 4


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


# --- dynamic sampling ---------------------------------------------------------------------------------------


def test_uniform_groups_are_dropped_and_the_batch_fills_over_rounds():
    sampler, _, prompts = make_sampler(["CCCC", "CWWW", "WWWW"])
    batch = sampler.collect()
    m = batch.metrics
    # Rounds draw 4, 3, 2, 1, 1 prompts (one in three is mixed); the fifth round fills the batch.
    assert prompts.asked == [4, 3, 2, 1, 1]
    assert sorted(g.prompt.index for g in batch.groups) == [1, 4, 7, 10]
    assert all(0 < g.num_correct < 4 for g in batch.groups)
    assert (m.rounds, m.round_cap_hit, m.groups_generated, m.groups_kept) == (5, False, 11, 4)
    assert (m.groups_all_correct, m.groups_all_wrong, m.groups_trimmed) == (4, 3, 0)
    assert m.filter_rate == pytest.approx(7 / 11)
    assert m.filter_rate_all_correct == pytest.approx(4 / 11)
    assert m.filter_rate_all_wrong == pytest.approx(3 / 11)
    assert m.samples_generated == 44
    assert m.samples_per_kept_sample == pytest.approx(44 / 16)
    assert m.accuracy == pytest.approx((4 * 4 + 4 * 1) / 44)


@pytest.mark.parametrize("score_as_completed", [True, False])
def test_without_dynamic_sampling_the_batch_is_the_first_groups_drawn_uniform_ones_included(score_as_completed):
    """algorithm.dynamic_sampling false (GRPO): one round of batch_size prompts, every group kept in draw order,
    those without contrast with advantages of 0; one sample generated per sample trained on."""
    sampler, engine, prompts = make_sampler(["CCCC", "CWWW", "WWWW", "TTTT", "LLWW"], dynamic_sampling=False,
                                            score_as_completed=score_as_completed)
    batch = sampler.collect()
    assert prompts.asked == [4] and len(engine.streams) == 1
    assert [g.prompt.index for g in batch.groups] == [0, 1, 2, 3]
    assert [g.num_correct for g in batch.groups] == [4, 1, 0, 0]
    for uniform in (batch.groups[0], batch.groups[2]):
        assert uniform.advantages.abs().max() == 0
    assert batch.groups[1].advantages.abs().min() > 0
    m = batch.metrics
    assert (m.rounds, m.groups_kept, m.groups_all_correct, m.groups_all_wrong) == (1, 4, 1, 2)
    assert m.samples_generated == 16 and m.samples_per_kept_sample == 1.0
    # The same prompts with it on: uniform groups dropped, more drawn.
    on, _, on_prompts = make_sampler(["CCCC", "CWWW", "WWWW", "TTTT", "LLWW"], score_as_completed=score_as_completed)
    assert all(0 < g.num_correct < 4 for g in on.collect().groups) and len(on_prompts.asked) > 1


def test_without_dynamic_sampling_an_all_right_group_is_pushed_by_the_overlong_penalty_alone():
    """A group without contrast gets advantages of 0 only while its rewards are equal: with the soft overlong
    penalty on, an all-right group whose answers reach into the interval is trained towards its shorter answers
    (dynamic sampling drops it: it is all right)."""
    sampler, _, _ = make_sampler(["CCLL", "CWWW", "WWWW", "CWCW"], dynamic_sampling=False)
    uniform = sampler.collect().groups[0]
    assert uniform.num_correct == 4
    assert uniform.rewards.tolist() == [1.0, 1.0, 0.5, 0.5]
    assert uniform.advantages[:2].min() > 0 > uniform.advantages[2:].max()
    on, _, _ = make_sampler(["CCLL", "CWWW", "WWWW", "CWCW"])
    assert 0 not in [g.prompt.index for g in on.collect().groups]


def test_without_dynamic_sampling_stale_groups_are_still_dropped_and_drawn_again():
    class Versioned(ScriptedEngine):
        def stream(self, prompts, n, params):
            stream = super().stream(prompts, n, params)
            stream.pending = [[dataclasses.replace(s, weight_version="1" if s.prompt_index == 1 else "3")
                               for s in g] for g in stream.pending]
            return stream

    sampler, _, prompts = make_sampler(["CCCC", "CWWW"], batch_size=2, dynamic_sampling=False, engine=Versioned())
    sampler.min_version = 2
    batch = sampler.collect()
    assert prompts.asked == [2, 1] and [g.prompt.index for g in batch.groups] == [0, 2]
    assert batch.metrics.groups_stale == 1


def test_oversampling_draws_more_prompts_per_round():
    sampler, _, prompts = make_sampler(["CCCC", "CWWW"], oversample_factor=1.5)
    batch = sampler.collect()
    # 4 needed -> 6 drawn (3 mixed); 1 needed -> 2 drawn (1 mixed).
    assert prompts.asked == [6, 2]
    assert batch.metrics.groups_kept == 4


# Mixed groups: CCWW (short, 5 tokens), LLWW and LWWW (long, 12). Uniform: CCCC (3), WWWW (5), LLLL (12), TTTT (16).


@pytest.mark.parametrize("oversample_factor, asked", [(1.0, [4, 2]), (2.0, [8])])
def test_the_batch_is_the_first_mixed_groups_in_draw_order(oversample_factor, asked):
    # Mixed: 0, 2, 4, 5 (then 6, ...); 0 and 4 complete after 2 and 5.
    sampler, engine, prompts = make_sampler(["LLWW", "CCCC", "CCWW", "TTTT", "LWWW", "CCWW"],
                                            oversample_factor=oversample_factor)
    batch = sampler.collect()
    assert prompts.asked == asked
    assert [g.prompt.index for g in batch.groups] == [0, 2, 4, 5]
    assert engine.streams[0].handed_out[:2] != [0, 1]  # groups did complete out of draw order


def test_groups_past_the_known_last_needed_one_are_aborted_and_never_kept():
    sampler, engine, prompts = make_sampler(["LLWW", "CCCC", "CCWW", "CCWW", "LWWW", "TTTT"], batch_size=2,
                                            oversample_factor=3.0)
    batch = sampler.collect()
    (stream,) = engine.streams
    assert prompts.asked == [6]
    # 1, 3, 2 complete first: with 2 and 3 mixed, the second mixed group is at 3 at the latest, so 4 and 5
    # are aborted while 0 is still generating; 0 then makes 2 the last one needed, and 3 is left out.
    assert [g.prompt.index for g in batch.groups] == [0, 2]
    assert stream.handed_out == [1, 3, 2, 0] and stream.aborted == [4, 5]
    m = batch.metrics
    assert (m.groups_generated, m.groups_aborted, m.groups_settled, m.groups_kept) == (4, 2, 3, 2)
    assert (m.groups_all_correct, m.groups_all_wrong, m.samples_generated) == (1, 0, 16)
    assert m.samples_per_kept_sample == 2.0 and m.filter_rate == pytest.approx(1 / 3)
    assert m.response_len_mean == pytest.approx((12 + 12 + 5 + 5 + 4 * 3 + 3 + 3 + 5 + 5) / 12)  # settled: 0, 1, 2


def test_abort_once_the_batch_is_full():
    sampler, engine, _ = make_sampler(["LLWW", "CCCC", "TTTT"], batch_size=1, oversample_factor=3.0)
    batch = sampler.collect()
    (stream,) = engine.streams
    assert [g.prompt.index for g in batch.groups] == [0]
    assert stream.handed_out == [1, 0] and stream.aborted == [] and stream.pending_at_abort == 1
    assert (batch.metrics.groups_generated, batch.metrics.groups_aborted, batch.metrics.samples_generated) == (2, 1, 8)
    assert batch.metrics.samples_per_kept_sample == 2.0


def test_groups_started_by_weights_older_than_the_bound_are_dropped_and_counted():
    """rollout.mode async: a mixed group with a response started by weights older than min_version is dropped
    like an unmixed one (counted as stale), and the batch fills with the next mixed groups in draw order."""
    versions = ["default", "1", "4", "2", "2", "3"]  # of each prompt's responses; a server's own name is 0

    class Versioned(ScriptedEngine):
        def stream(self, prompts, n, params):
            stream = super().stream(prompts, n, params)
            stream.pending = [[dataclasses.replace(s, weight_version=versions[s.prompt_index]) for s in g]
                              for g in stream.pending]
            return stream

    sampler, _, prompts = make_sampler(["LLWW", "CCWW", "CCWW", "LWWW", "CCWW", "CCWW"], batch_size=2,
                                       oversample_factor=3.0, engine=Versioned())
    sampler.min_version = 2
    batch = sampler.collect()
    assert [g.prompt.index for g in batch.groups] == [2, 3]
    m = batch.metrics
    assert (m.groups_stale, m.groups_kept, m.groups_settled, m.prompts_drawn) == (2, 2, 4, 6)
    sampler.min_version = None  # the other modes
    assert [g.prompt.index for g in sampler.collect().groups] == [6, 7]


def test_a_batch_filled_in_round_two_continues_the_draw_order():
    # Round 1 (0-7) has two mixed groups, round 2 (8-11) three: the first two of them in draw order are kept.
    sampler, _, prompts = make_sampler(["LLWW", "CCCC", "TTTT", "WWWW", "CCWW", "CCCC", "LLLL", "WWWW",
                                        "LWWW", "CCCC", "CCWW", "CCWW"], oversample_factor=2.0)
    batch = sampler.collect()
    assert prompts.asked == [8, 4] and batch.metrics.rounds == 2
    assert [g.prompt.index for g in batch.groups] == [0, 4, 8, 10]


def test_the_round_cap_and_data_parallel_trimming_keep_the_first_groups_in_draw_order(caplog):
    # Round 1 (0-5): mixed 0 (long), 2, 4 (long); round 2 (6, 7): none. 3 kept, trimmed to 2 for dp_size 2.
    sampler, _, prompts = make_sampler(["LLWW", "CCCC", "CCWW", "TTTT", "LWWW", "WWWW"], then="CCCC",
                                       oversample_factor=1.5, max_sampling_rounds=2, dp_size=2)
    with caplog.at_level(logging.WARNING, logger=SAMPLER_LOG):
        batch = sampler.collect()
    assert prompts.asked == [6, 2]
    assert [g.prompt.index for g in batch.groups] == [0, 2]
    m = batch.metrics
    assert m.round_cap_hit and (m.groups_kept, m.groups_trimmed, m.groups_settled, m.groups_aborted) == (2, 1, 8, 0)
    assert "kept 3 of 4 groups after 2 rounds" in caplog.text and "left out 1 of 3" in caplog.text


def test_too_easy_data_reports_an_empty_batch_in_one_line(caplog):
    sampler, engine, prompts = make_sampler(["CCCC"], max_sampling_rounds=3)
    with caplog.at_level(logging.INFO, logger=SAMPLER_LOG):
        batch = sampler.collect()
    assert batch.groups == [] and batch.num_samples == 0
    m = batch.metrics
    assert (m.rounds, m.round_cap_hit, m.groups_kept, m.groups_all_correct) == (3, True, 0, 12)
    assert m.filter_rate == 1.0 and m.filter_rate_all_correct == 1.0 and m.accuracy == 1.0
    assert m.samples_per_kept_sample == math.inf
    # One info line per empty step: the trainer's EmptyStepWatch warns once when empty steps go on.
    (line,) = [r for r in caplog.records if r.name == SAMPLER_LOG]
    assert line.levelno == logging.INFO
    assert "max_sampling_rounds" in line.message and "12 were all correct" in line.message
    assert "nothing to train on" in line.message
    assert all(s.pending_at_abort == 0 for s in engine.streams)  # each round ran to its end


def test_round_cap_trains_on_what_was_kept(caplog):
    sampler, _, _ = make_sampler(["CCCC"] * 5 + ["CWWW"], max_sampling_rounds=3)
    with caplog.at_level(logging.WARNING, logger=SAMPLER_LOG):
        batch = sampler.collect()
    assert [g.prompt.index for g in batch.groups] == [5]
    assert batch.metrics.round_cap_hit and batch.metrics.groups_kept == 1
    assert "kept 1 of 4 groups after 3 rounds" in caplog.text


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_batch_divides_across_data_parallel_ranks(dp_size, caplog):
    # 7 mixed groups then only easy ones: the round cap leaves 7, trimmed to a multiple of dp_size.
    sampler, _, _ = make_sampler(["CCWW"] * 7, then="CCCC", batch_size=12, max_sampling_rounds=2,
                                 dp_size=dp_size)
    batch = sampler.collect()
    assert len(batch.groups) % dp_size == 0
    assert len(batch.groups) == 7 - 7 % dp_size
    assert batch.metrics.groups_trimmed == 7 % dp_size
    assert batch.metrics.samples_generated == 17 * 4  # 12 in the first round, 5 in the second
    assert batch.metrics.samples_per_kept_sample == pytest.approx(68 / (4 * len(batch.groups)))
    # A full batch needs no trimming.
    full, _, _ = make_sampler(["CWWW"], batch_size=12, dp_size=dp_size)
    assert len(full.collect().groups) == 12


def test_batch_contents_and_metrics():
    sampler, _, _ = make_sampler(["CLWT"], batch_size=2, overlong_filter=True)
    batch = sampler.collect()
    assert batch.num_samples == 8
    for g in batch.groups:
        assert g.correct == [True, True, False, False]
        assert g.rewards.tolist() == [1.0, 0.5, -1.0, -2.0]
        torch.testing.assert_close(g.advantages, group_advantages(g.rewards, 1e-6), rtol=0, atol=0)
        assert g.loss_mask.tolist() == [True, True, True, False]
        for s, lp in zip(g.samples, g.rollout_logprobs):
            assert lp.dtype == torch.float32 and lp.tolist() == pytest.approx(s.logprobs)
    m = batch.metrics
    assert m.accuracy == 0.5 and m.truncation_rate == 0.25
    assert m.response_len_mean == (3 + 12 + 5 + 16) / 4 and m.response_len_max == 16
    assert m.reward_mean == pytest.approx((1 + 0.5 - 1 - 2) / 4)
    d = m.as_dict()
    assert d["filter_rate"] == 0.0 and d["round_cap_hit"] == 0.0 and d["samples_per_kept_sample"] == 1.0


def test_the_rollout_entropy_covers_every_settled_token_kept_or_dropped():
    """The entropy per generated token over the settled groups, the dropped ones included, so that recipes that keep
    different groups are measured on the same tokens; absent where the engine reports no entropies."""
    per_token = {"C": 0.5, "W": 2.0, "L": 1.0, "T": 3.0}
    engine = ScriptedEngine(entropy_per_token=per_token)
    sampler, _, _ = make_sampler(["CCCC", "CWWW", "WWWW", "CLWT"], batch_size=2, engine=engine)
    m = sampler.collect().metrics
    assert m.groups_settled == 4 and m.groups_kept == 2  # two dropped: all right, all wrong
    tokens = {c: LENGTHS[c] * "CCCCCWWWWWWWCLWT".count(c) for c in per_token}
    assert m.rollout_entropy == pytest.approx(sum(per_token[c] * tokens[c] for c in tokens) / sum(tokens.values()))
    assert m.as_dict()["rollout_entropy"] == m.rollout_entropy
    plain, _, _ = make_sampler(["CWWW"], batch_size=1)
    without = plain.collect().metrics
    assert without.rollout_entropy is None and "rollout_entropy" not in without.as_dict()


@pytest.mark.parametrize("kwargs, key", [
    ({"batch_size": 0}, "algorithm.batch_size"),
    ({"group_size": 1}, "algorithm.group_size"),
    ({"oversample_factor": 0.5}, "algorithm.oversample_factor"),
    ({"oversample_factor": float("inf")}, "algorithm.oversample_factor"),
    ({"max_sampling_rounds": 0}, "algorithm.max_sampling_rounds"),
    ({"advantage_eps": 0.0}, "algorithm.advantage_eps"),
    ({"overlong_filter": "yes"}, "algorithm.overlong_filter"),
    ({"overlong_penalty": 1}, "algorithm.overlong_penalty"),
    ({"dynamic_sampling": "no"}, "algorithm.dynamic_sampling"),
    ({"dynamic_sampling": False, "oversample_factor": 1.5},
     "algorithm.oversample_factor: 1.5 draws extra prompts for dynamic sampling, which algorithm.dynamic_sampling "
     "false turns off"),
])
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        AlgorithmConfig(**kwargs)


def test_batch_size_must_divide_across_ranks():
    with pytest.raises(ConfigError, match="algorithm.batch_size: 6 groups do not divide across 4"):
        make_sampler(["CCWW"], batch_size=6, dp_size=4)


def test_a_malformed_group_is_an_error_and_aborts_the_round():
    engine = ScriptedEngine(group_size_override=3)
    sampler, _, _ = make_sampler(["CCWW"], engine=engine)
    with pytest.raises(RuntimeError, match="group of 3 samples"):
        sampler.collect()
    assert engine.streams[0].pending_at_abort == 3


def test_score_groups_must_judge_every_response_of_every_group():
    sampler, _, _ = make_sampler(["CCWW"])
    sampler.score_groups = lambda groups: [[True] for _ in groups]
    with pytest.raises(RuntimeError, match="1 verdicts for a group of 4 responses"):
        sampler.collect()
    sampler, _, _ = make_sampler(["CCWW"], score_as_completed=False)
    sampler.score_groups = lambda groups: [[True] * 4]
    with pytest.raises(RuntimeError, match=r"1 lists of verdicts for \d+ groups"):
        sampler.collect()


@pytest.mark.parametrize("patterns,batch_size,rounds", [(["CCWW", "CCCC", "WWWW", "CWWW"], 4, 4),
                                                        (["WWWW", "CCCC", "CCCW"], 3, 2),
                                                        (["CCCC", "WWWW"], 2, 3)])
def test_judging_a_round_at_once_keeps_the_batch_judging_as_completed_keeps(patterns, batch_size, rounds):
    """The in-process engine's way (the whole round judged in one call) and SGLang's (each group as it
    completes, the rest aborted once the batch is known): the same batch, the same settled-group counts."""
    batches = []
    for as_completed in (True, False):
        sampler, calls, _ = make_sampler(patterns, batch_size=batch_size, max_sampling_rounds=rounds,
                                         score_as_completed=as_completed)
        judged = []
        sampler.score_groups = lambda groups, judged=judged: judged.append(len(groups)) or score_groups(groups)
        batch = sampler.collect()
        m = batch.metrics
        batches.append(([g.prompt.index for g in batch.groups], [g.correct for g in batch.groups], m.groups_settled,
                         m.groups_all_correct, m.groups_all_wrong, m.rounds))
        assert set(judged) == {1} if as_completed else len(judged) == m.rounds  # a call per group / per round
    assert batches[0] == batches[1]
