"""Every trainer rank's side of the rollout service. Global rank 0 (the driver) asks the service
(service/rollout_service.py: in a process of its own over SGLang, or inline over the in-process engine) for each
step's batch and hands each rank its data-parallel share (parallel/share_scatter.py); the other ranks wait for the
driver's word outside any collective (runtime.DriverSignal: a paper-scale rollout outlasts any collective's
watchdog). A server restarted while the service waits on it gets the weights from the publisher: from every rank,
or, with the disk route, from the driver alone."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_dapo.parallel.rank_shares import PackedShare, deal_by_tokens, tokens_max_over_mean
from megatron_dapo.parallel.runtime import DriverSignal
from megatron_dapo.parallel.share_scatter import ShareScatter
from megatron_dapo.service.rollout_service import RESYNC, ReadyBatch


class BatchFeed:
    """Collective to construct (every rank, same order). `service`: the driver's rollout service, up (None on the
    other ranks); `publisher`: what puts the weights onto a restarted server (loop/weight_publisher.py)."""

    def __init__(self, service, publisher, *, dp_rank: int, dp_size: int, updates_per_step: int,
                 timeout: timedelta):
        self.service, self.publisher = service, publisher
        self.driver = dist.get_rank() == 0
        self.dp_size, self.updates_per_step = dp_size, updates_per_step
        self.signal = DriverSignal()  # the driver's word to the ranks waiting on its rollout
        self.scatter = ShareScatter(dp_rank, timeout)
        # The driver's: batches sampled ahead of their step (the overlapping modes), taken from the service and
        # not yet trained on, oldest first; and the dataset rows of the batch being trained on.
        self.ready: list[ReadyBatch] = []
        self.batch_prompts: list[int] = []

    @property
    def queued(self) -> int:
        """Driver: batches sampled or being sampled for the steps ahead."""
        return len(self.ready) + len(self.service.pending)

    def next_share(self, step: int) -> tuple[PackedShare, dict[str, float]]:
        """Every rank: its data-parallel share of step `step`'s kept batch, and on the driver the batch's sampling
        metrics ({} elsewhere). Sampled now, unless sampled ahead."""
        if self.driver and not self.ready and not self.service.pending:
            self.service.start_batch(step)
        self.ready += self._await("batch", jobs=0 if self.ready else 1)
        if not self.driver:
            return self.scatter.receive(), {}
        batch = self.ready.pop(0)
        if batch.step != step:
            raise RuntimeError(f"the rollout service handed the batch of step {batch.step + 1} to step {step + 1}")
        self.batch_prompts = batch.prompts
        shares = deal_by_tokens(batch.items, self.dp_size, self.updates_per_step)
        metrics = {**batch.metrics, "rollout_buffer": float(self.queued),
                   "balance/tokens_max_over_mean": tokens_max_over_mean(shares)}
        return self.scatter.send([PackedShare.pack(share) for share in shares]), metrics

    def sample_ahead(self, step: int, through: int) -> None:
        """Driver, once step `step`'s batch is taken: queue the batches of the steps after it, through step
        `through`, that are not queued yet."""
        for ahead in range(step + 1 + self.queued, through + 1):
            self.service.start_batch(ahead)

    def drain(self, word: str) -> None:
        """Every rank: until the service has sampled every batch queued (the driver keeps them)."""
        self.ready += self._await(word, jobs=len(self.service.pending) if self.driver else 0)

    def evaluate(self) -> dict[str, float]:
        """Every rank: the held-out evaluation, queued behind the batches sampled ahead (which the driver keeps);
        its metrics on the driver, {} elsewhere."""
        if self.driver:
            self.service.start_eval()
        results = self._await("evaluated", jobs=len(self.service.pending) if self.driver else 0)
        if not self.driver:
            return {}
        self.ready += results[:-1]
        return results[-1]

    def state_dict(self) -> tuple[dict | None, list[dict]]:
        """Driver, with nothing being sampled (after `drain`): the service's data position, and the batches
        sampled ahead (the resumed run trains on them and draws no prompt twice)."""
        return self.service.state_dict(), [b.state_dict() for b in self.ready]

    def load_state_dict(self, sampler: dict, ready: list[dict]) -> None:
        """Driver: the data position and the batches ahead of a checkpoint."""
        self.service.load_state_dict(sampler)
        self.ready = [ReadyBatch.from_state_dict(b) for b in ready]

    def _await(self, word: str, jobs: int) -> list:
        """Every rank: until the driver's service has done its `jobs` oldest jobs (then the driver says `word`
        and has their results; [] elsewhere); a server restarted meanwhile gets the weights."""
        if not self.driver:
            while self.signal.wait() == RESYNC:
                self.publisher.publish(live=True)
            return []
        results = []
        for _ in range(jobs):
            while self.service.wait() == RESYNC:
                if not self.publisher.reload(self.service.restarted):  # else every rank pushes them
                    self.signal.post(RESYNC)
                    self.publisher.publish(live=True)
                self.service.resynced()
            results.append(self.service.take())
        self.signal.post(word)
        return results
