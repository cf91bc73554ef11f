"""Steps that keep finding (almost) nothing to train on, said once: the driver's watch over each step's sampling
metrics.

Dynamic sampling drops every group whose responses are all right or all wrong; when every group of every round
is, the step's batch is empty and the weights do not change (dynamic_sampling.py logs one info line per such
step). A step starves when its batch is empty, or when it used every sampling round and kept a quarter of
algorithm.batch_size or less: a collapsed policy still yields the odd mixed group. One starved step can be a bad
draw of prompts; several in a row mean the policy and the data no longer meet: the policy collapsed, or the task
is too hard or too easy for it. After EMPTY_STEPS_TO_WARN of them the watch warns once with their counts summed
and what to do, then stays quiet while the stall lasts; a step that trains on more ends the stall, and a later
one is said again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Three: one or two empty steps happen by chance to a policy near 0 % or 100 % on a small batch; three in a
# row are a trend, and said then the run has not yet spent many steps on nothing.
EMPTY_STEPS_TO_WARN = 3
STARVED_FRACTION = 0.25  # of algorithm.batch_size, kept after every sampling round
COUNTS = ("groups_generated", "groups_all_wrong", "groups_all_correct", "groups_stale", "groups_trimmed", "rounds",
          "groups_kept")


class EmptyStepWatch:
    def __init__(self, max_sampling_rounds: int, batch_size: int):
        self.max_sampling_rounds, self.batch_size = max_sampling_rounds, batch_size
        self.first_step = 0  # of the stall going on; 0: none
        self.steps = 0  # starved steps in a row
        self.sums = dict.fromkeys(COUNTS, 0)

    def starved(self, metrics: Mapping[str, float]) -> bool:
        kept = metrics["groups_kept"]
        return kept == 0 or (bool(metrics["round_cap_hit"]) and kept <= STARVED_FRACTION * self.batch_size)

    def observe(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Step number `step` (1-based) sampled with these metrics (SamplingMetrics.as_dict's keys); returns
        the warning when it is said now (logged), else None."""
        if not self.starved(metrics):
            self.first_step, self.steps = 0, 0
            self.sums = dict.fromkeys(COUNTS, 0)
            return None
        self.first_step = self.first_step or step
        self.steps += 1
        for key in COUNTS:
            self.sums[key] += int(metrics[key])
        if self.steps != EMPTY_STEPS_TO_WARN:
            return None
        message = self._message(step)
        log.warning("%s", message)
        return message

    def _message(self, step: int) -> str:
        s = self.sums
        causes = []
        if s["groups_all_wrong"]:
            causes.append("All wrong means the task is too hard for the policy, or the policy collapsed (accuracy "
                          "falling to 0 after large updates): lower optim.lr, add optim.warmup_steps, keep "
                          "optim.clip_grad on, and check that the reward judges right answers right.")
        if s["groups_all_correct"]:
            causes.append("All correct means the data is too easy for the policy: use harder prompts or a larger "
                          "algorithm.group_size.")
        if s["groups_stale"]:
            causes.append(f"{s['groups_stale']} mixed groups were dropped as stale: raise rollout.max_staleness.")
        if s["groups_trimmed"]:
            causes.append(f"{s['groups_trimmed']} mixed groups were left out so that the batch divides across "
                          "data-parallel ranks: there were fewer of them than ranks.")
        kept = ("none was kept (the weights did not change)" if not s["groups_kept"] else
                f"{s['groups_kept']} were kept of the {self.steps * self.batch_size} their batches wanted "
                f"(algorithm.batch_size = {self.batch_size})")
        return (f"steps {self.first_step}-{step}: {self.steps} steps in a row had little or nothing to train on: of "
                f"the {s['groups_generated']} groups dynamic sampling generated in {s['rounds']} rounds "
                f"(algorithm.max_sampling_rounds = {self.max_sampling_rounds} a step), {s['groups_all_wrong']} were "
                f"all wrong and {s['groups_all_correct']} all correct, and {kept}. {' '.join(causes)} Said once for "
                "this stall; said again if steps train and then stall again.")
