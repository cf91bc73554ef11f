"""EmptyStepWatch: a run whose steps keep finding (almost) nothing to train on says so once, with the numbers."""

import logging

from megatron_dapo.algorithm.empty_step_watch import EMPTY_STEPS_TO_WARN, EmptyStepWatch

LOG = "megatron_dapo.algorithm.empty_step_watch"


BATCH = 4  # algorithm.batch_size


def sampled(kept=0, all_wrong=0, all_correct=0, rounds=3, stale=0, trimmed=0) -> dict[str, float]:
    """A step's sampling metrics as the trainer has them on the driver (SamplingMetrics.as_dict and more); every
    round used when the batch came out short."""
    settled = kept + all_wrong + all_correct + stale + trimmed
    return {"groups_kept": float(kept), "round_cap_hit": float(kept < BATCH), "groups_all_wrong": float(all_wrong),
            "groups_all_correct": float(all_correct),
            "groups_stale": float(stale), "groups_trimmed": float(trimmed), "groups_generated": float(settled),
            "groups_settled": float(settled), "rounds": float(rounds), "accuracy": 0.0, "rollout_buffer": 0.0}


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING]


def test_says_it_once_after_steps_in_a_row_with_the_summed_numbers(caplog):
    watch = EmptyStepWatch(max_sampling_rounds=3, batch_size=BATCH)
    with caplog.at_level(logging.INFO, logger=LOG):
        said = [watch.observe(1, sampled(kept=4, all_wrong=2))]
        said += [watch.observe(step, sampled(all_wrong=12)) for step in range(2, 2 + EMPTY_STEPS_TO_WARN - 1)]
        assert said == [None] * EMPTY_STEPS_TO_WARN and warnings(caplog) == []  # not yet: one bad draw is chance
        said = watch.observe(1 + EMPTY_STEPS_TO_WARN, sampled(all_wrong=11, all_correct=1))
        quiet = [watch.observe(step, sampled(all_wrong=12)) for step in range(2 + EMPTY_STEPS_TO_WARN, 20)]
    assert warnings(caplog) == [said] and quiet == [None] * len(quiet)
    n = EMPTY_STEPS_TO_WARN
    assert f"steps 2-{1 + n}: {n} steps in a row had little or nothing to train on" in said
    assert "none was kept (the weights did not change)" in said
    assert f"of the {12 * n} groups dynamic sampling generated in {3 * n} rounds" in said
    assert f"{12 * n - 1} were all wrong and 1 all correct" in said
    assert "algorithm.max_sampling_rounds = 3" in said
    assert "optim.lr" in said and "optim.warmup_steps" in said and "reward" in said  # all wrong: what to do
    assert "too easy" in said  # the one all-correct group's meaning too


def test_all_correct_steps_say_the_data_is_too_easy():
    watch = EmptyStepWatch(max_sampling_rounds=4, batch_size=BATCH)
    said = [watch.observe(step, sampled(all_correct=8, rounds=4)) for step in range(1, 1 + EMPTY_STEPS_TO_WARN)][-1]
    assert f"0 were all wrong and {8 * EMPTY_STEPS_TO_WARN} all correct" in said
    assert "too easy" in said and "optim.lr" not in said


def test_stale_and_trimmed_groups_are_named_when_they_emptied_the_batch():
    watch = EmptyStepWatch(max_sampling_rounds=2, batch_size=BATCH)
    said = [watch.observe(step, sampled(all_wrong=1, stale=2, trimmed=1, rounds=2))
            for step in range(1, 1 + EMPTY_STEPS_TO_WARN)][-1]
    assert "rollout.max_staleness" in said and "data-parallel" in said


def test_a_step_that_trains_ends_the_stall_and_a_new_stall_is_said_again(caplog):
    watch = EmptyStepWatch(max_sampling_rounds=3, batch_size=BATCH)
    n = EMPTY_STEPS_TO_WARN
    with caplog.at_level(logging.WARNING, logger=LOG):
        for step in range(1, n):  # a stall one step too short, broken by a step that trains: never said
            watch.observe(step, sampled(all_wrong=12))
        watch.observe(n, sampled(kept=4))
        assert warnings(caplog) == []
        for step in range(n + 1, 2 * n + 1):
            watch.observe(step, sampled(all_wrong=12))
        watch.observe(2 * n + 1, sampled(kept=BATCH, all_wrong=8))
        for step in range(2 * n + 2, 3 * n + 2):
            watch.observe(step, sampled(all_correct=12))
    said = warnings(caplog)
    assert len(said) == 2
    assert f"steps {n + 1}-{2 * n}:" in said[0] and f"steps {2 * n + 2}-{3 * n + 1}:" in said[1]
    assert f"0 were all wrong and {12 * n} all correct" in said[1]  # counts start afresh with the new stall


def test_steps_that_kept_a_quarter_of_the_batch_or_less_after_every_round_starve_too(caplog):
    """A collapsed policy still yields the odd mixed group: 1 of 4 kept after every round is a stall as well (the
    former tiny-cpu settings' run went 0, 1, 0, 1, 0 groups kept); a full batch, or more than a quarter of it,
    is not."""
    watch = EmptyStepWatch(max_sampling_rounds=3, batch_size=BATCH)
    with caplog.at_level(logging.WARNING, logger=LOG):
        said = [watch.observe(step, sampled(kept=step % 2, all_wrong=12 - step % 2)) for step in range(1, 4)][-1]
    assert warnings(caplog) == [said]
    assert "steps 1-3: 3 steps in a row had little or nothing to train on" in said
    assert f"and 2 were kept of the {3 * BATCH} their batches wanted (algorithm.batch_size = {BATCH})" in said
    fed = EmptyStepWatch(max_sampling_rounds=3, batch_size=16)
    assert [fed.starved({**sampled(kept=k, all_wrong=40), "round_cap_hit": 1.0}) for k in (0, 4, 5)] == \
        [True, True, False]
    assert not fed.starved({**sampled(kept=2), "round_cap_hit": 0.0})  # rounds left: the batch was not short
