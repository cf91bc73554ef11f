"""What a step checks of itself: the updates its share is cut into, and whether their numerics were finite."""

from __future__ import annotations

import itertools
import logging

from megatron_dapo.parallel.rank_shares import PackedShare
from megatron_dapo.policy.finite_weights import NonFiniteTraining

log = logging.getLogger(__name__)


class UpdateCutter:
    """This rank's samples cut into the step's updates (rank_shares.deal_by_tokens); fewer than
    train.updates_per_step when the batch has fewer responses per rank, which is said once."""

    def __init__(self, updates_per_step: int):
        self.wanted = updates_per_step
        self.warned = False

    def cut(self, samples: list, share: PackedShare, step: int) -> list[list]:
        sizes = share.update_sizes.tolist()
        if len(sizes) < self.wanted and not self.warned:
            self.warned = True
            log.warning("step %d: %d responses per data-parallel rank, fewer than train.updates_per_step = %d: %d "
                        "updates this step (said once); a batch that small trains on little", step, len(sizes),
                        self.wanted, len(sizes))
        bounds = [0, *itertools.accumulate(sizes)]
        return [samples[a:b] for a, b in zip(bounds, bounds[1:])]


class BadStepWatch:
    """Every rank (the results agree): an update whose loss or gradients were not finite was skipped; a step with
    one is logged (by the driver) with its batch, and train.max_bad_steps such steps in a row end the run."""

    def __init__(self, max_bad_steps: int, driver: bool):
        self.max_bad_steps, self.driver = max_bad_steps, driver
        self.bad_steps = 0  # rollout steps in a row with a skipped update

    def observe(self, step: int, results, batch_prompts: list[int]) -> None:
        skipped = [j for j, r in enumerate(results) if not r.applied]
        if not skipped:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        if self.driver:
            log.warning("step %d: update(s) %s of %d skipped: the loss or a gradient was not finite (loss %s); "
                        "%s; the batch's prompts (dataset rows): %s", step, skipped, len(results),
                        [results[j].loss for j in skipped],
                        "nothing was applied, the servers keep their weights" if len(skipped) == len(results)
                        else "the other updates were applied", batch_prompts)
        if self.bad_steps >= self.max_bad_steps:
            raise NonFiniteTraining(f"{self.bad_steps} steps in a row had updates with a non-finite loss or gradient "
                               f"(train.max_bad_steps = {self.max_bad_steps}); the last good weights are the "
                               "servers' and the latest checkpoint's. Look at the batches logged above, lower "
                               "optim.lr, or raise train.max_bad_steps")
