"""The rollout modes and colocation at the loop's fixed points (loop/rollout_schedule.py): which batches each mode
queues ahead once a step's batch is taken, when one_step_off waits for the next batch, which syncs are live, and
the colocated servers' memory calls in their order. The runs themselves: test_trainer_loop.py, test_slurm_launch.py."""

import pytest

from megatron_dapo.config import RolloutConfig
from megatron_dapo.loop.rollout_schedule import RolloutSchedule
from megatron_dapo.loop.step_metrics import StepTimer


class Feed:
    """The driver's batch feed as the schedule sees it: the steps whose batches are queued, in order."""

    driver = True

    def __init__(self, calls):
        self.calls, self.queued = calls, []

    def sample_ahead(self, step, through):
        new = [s for s in range(step + 1, through + 1) if s not in self.queued]
        self.queued += new
        self.calls.append(("sample_ahead", step, through))

    def drain(self, word):
        self.calls.append(("drain", word))


class Memory:
    def __init__(self, calls):
        self.calls = calls

    def release(self):
        self.calls.append("release")

    def resume_weights(self):
        self.calls.append("resume_weights")

    def resume_caches(self):
        self.calls.append("resume_caches")


def run(mode, steps=4, colocate=False, **rollout):
    """Every fixed point of `steps` steps in which every update applies: the calls made, the batches queued ahead,
    the syncs (live or not), and the time split's sections."""
    calls = []
    feed = Feed(calls)
    schedule = RolloutSchedule(RolloutConfig(mode=mode, **rollout), steps, feed, Memory(calls) if colocate else None)
    syncs, sections = [], set()
    for step in range(steps):
        timer = StepTimer()
        schedule.batch_taken(step, timer)
        schedule.trained(step + 1, timer)
        if schedule.publishes(applied=True):
            syncs.append("live" if schedule.live else "paused")
        schedule.published(timer)
        sections |= set(timer.seconds)
    return calls, feed.queued, syncs, sections


def test_sync_samples_each_batch_after_the_previous_steps_weights():
    calls, queued, syncs, sections = run("sync")
    assert queued == [] and not [c for c in calls if c[0] == "drain"]
    assert syncs == ["paused"] * 4 and sections == set()


def test_one_step_off_samples_the_next_batch_while_training_and_finishes_it_before_the_sync():
    calls, queued, syncs, sections = run("one_step_off")
    assert queued == [1, 2, 3]  # never past the run's last step
    drains = [i for i, c in enumerate(calls) if c == ("drain", "sampled")]
    assert len(drains) == 3  # not after the last step: nothing is queued then
    assert syncs == ["paused"] * 4 and sections == {"rollout_wait"}


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_async_samples_max_staleness_steps_ahead_and_pushes_live(staleness):
    calls, queued, syncs, _ = run("async", steps=6, max_staleness=staleness)
    assert queued == [1, 2, 3, 4, 5]
    assert ("sample_ahead", 0, min(staleness, 5)) in calls
    assert not [c for c in calls if c[0] == "drain"] and syncs == ["live"] * 6


def test_colocated_servers_lend_their_memory_between_the_batch_and_the_sync_and_always_get_the_weights():
    calls, _, syncs, sections = run("sync", steps=2, colocate=True)
    memory = [c for c in calls if isinstance(c, str)]
    assert memory == ["release", "resume_weights", "resume_caches"] * 2 and syncs == ["paused"] * 2
    schedule = RolloutSchedule(RolloutConfig(), 2, Feed([]), Memory([]))
    assert schedule.publishes(applied=False)  # they released their weights: they get them back unchanged
    assert not RolloutSchedule(RolloutConfig(), 2, Feed([]), None).publishes(applied=False)
    assert sections == {"release", "resume"}
