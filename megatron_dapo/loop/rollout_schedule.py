"""When the rollout runs beside training (rollout.mode) and what colocated servers lend the trainer meanwhile
(rollout.colocate). The loop calls the schedule at fixed points of a step, so a new mode changes this module, not
the loop:

- sync: each step's batch is sampled once the previous step's weights are on the servers.
- one_step_off: the next step's batch is sampled while this one trains (with this step's starting weights); the
  servers finish it before they take the new weights.
- async: the batches of the next rollout.max_staleness steps are sampled back to back, and the new weights are
  pushed into the servers while they sample (partial rollouts).
- colocated servers release their memory once the batch is taken, take back their weights' memory before the
  sync and their caches after it (rollout/server_memory.py).
"""

from __future__ import annotations

import torch

from megatron_dapo.config import RolloutConfig
from megatron_dapo.loop.batch_feed import BatchFeed
from megatron_dapo.loop.step_metrics import StepTimer
from megatron_dapo.rollout.server_memory import ServerMemory
from megatron_dapo.run_config import DapoConfig


class RolloutSchedule:
    """`steps`: train.steps, the run's length; `server_memory`: the colocated servers' (None otherwise)."""

    def __init__(self, rollout: RolloutConfig, steps: int, feed: BatchFeed, server_memory: ServerMemory | None):
        self.mode, self.steps, self.feed, self.server_memory = rollout.mode, steps, feed, server_memory
        self.ahead = {"sync": 0, "one_step_off": 1, "async": rollout.max_staleness}[rollout.mode]
        self.live = rollout.mode == "async"  # the weights go into servers that may be sampling

    @classmethod
    def from_config(cls, cfg: DapoConfig, feed: BatchFeed, server_urls: list[str],
                    device: torch.device) -> RolloutSchedule:
        r = cfg.rollout
        memory = ServerMemory(server_urls, device, r.weight_sync_timeout_s) if r.colocate else None
        return cls(r, cfg.train.steps, feed, memory)

    def batch_taken(self, step: int, timer: StepTimer) -> None:
        """Every rank, once step `step`'s batch is dealt out: the driver queues the batches of the steps ahead that
        this step's weights may start; colocated servers lend the trainer their memory until the sync."""
        if self.feed.driver:
            self.feed.sample_ahead(step, min(step + self.ahead, self.steps - 1))
        if self.server_memory is not None:
            with timer("release"):
                self.server_memory.release()

    def trained(self, steps_done: int, timer: StepTimer) -> None:
        """Every rank, after the step's updates, before its weights are published."""
        if self.server_memory is not None:
            with timer("resume"):
                self.server_memory.resume_weights()
        if self.mode == "one_step_off" and steps_done < self.steps:
            with timer("rollout_wait"):  # the servers finish the next batch before they take the new weights
                self.feed.drain("sampled")

    def publishes(self, applied: bool) -> bool:
        """Whether the step's weights go to the servers: when an update was applied, and always to colocated
        servers, which released theirs for the trainer."""
        return applied or self.server_memory is not None

    def published(self, timer: StepTimer) -> None:
        if self.server_memory is not None:
            with timer("resume"):
                self.server_memory.resume_caches()
