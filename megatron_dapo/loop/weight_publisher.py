"""Every trainer rank: the policy's weights onto the rollout servers (weight_sync/: disk, distributed or tensor
route), under the version of the rollout step that made them; a server restarted mid-rollout gets them too."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.policy_from_hf import Policy
from megatron_dapo.loop.progress import RunProgress
from megatron_dapo.parallel.runtime import Runtime
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.weight_sync import make_weight_syncer
from megatron_dapo.weight_sync.disk import DiskSyncer
from megatron_dapo.weight_sync.server_calls import call_all, generation_paused, servers_idle

log = logging.getLogger(__name__)


class WeightPublisher:
    """The weights go under the version `progress.steps_done`. Without a syncer (the in-process engine samples
    from the live policy) only `local_engine`'s version is set (the driver's)."""

    def __init__(self, syncer, server_urls: list[str], model: torch.nn.Module, progress: RunProgress, *,
                 timeout_s: float, local_engine=None):
        self.syncer, self.server_urls, self.model, self.progress = syncer, list(server_urls), model, progress
        self.timeout_s, self.local_engine = timeout_s, local_engine

    @classmethod
    def from_config(cls, cfg: DapoConfig, runtime: Runtime, policy: Policy, server_urls: list[str],
                    progress: RunProgress, local_engine=None) -> WeightPublisher:
        """The run's route (rollout.weight_sync) to its servers; none for the in-process engine."""
        r = cfg.rollout
        syncer = None
        if r.engine == "sglang":
            # The servers reach trainer rank 0 (the distributed route's broadcasts) where the trainers rendezvous;
            # colocated servers get the tensor route's weights from the first trainer rank on their node.
            syncer = make_weight_syncer(r.weight_sync, server_urls, policy.spec, cfg.parallel, policy.hf_config,
                                        bucket_mb=r.weight_sync_bucket_mb,
                                        work_dir=Path(cfg.train.output_dir) / "weights",
                                        master_address=runtime.env.master_addr, timeout_s=r.weight_sync_timeout_s,
                                        server_nodes=r.server_nodes, node=runtime.env.node)
        return cls(syncer, server_urls, policy.module, progress, timeout_s=r.weight_sync_timeout_s,
                   local_engine=local_engine)

    def publish(self, live: bool = False) -> None:
        """Every rank. `live`: into servers that may be sampling (their generation paused meanwhile,
        server_calls.generation_paused)."""
        version = str(self.progress.steps_done)
        if self.syncer is None:
            if self.local_engine is not None:
                self.local_engine.weight_version = version
            return
        if dist.get_rank() != 0:
            ready = nullcontext(self.server_urls)
        elif live:
            ready = generation_paused(self.server_urls, self.timeout_s)
        else:  # between batches: the leftovers of the last one's aborted groups gone first
            ready = nullcontext(servers_idle(self.server_urls, self.timeout_s))
        with ready as up:
            # A server down now is left out: the service restarts it, and the driver then resyncs it (RESYNC).
            result = self.syncer.sync(self.model, version, skip=[u for u in self.server_urls if u not in up])
        if result is not None:
            log.info("weight sync %s: %.3f GB in %.2f s (%.2f GB/s)", version, result.bytes / 1e9, result.seconds,
                     result.gbps)

    def reload(self, url: str) -> bool:
        """Driver: the weights onto the restarted server at `url` by itself, where the route allows (disk: the
        folder the others serve, under its own version, which is older than the policy's while one_step_off
        samples the next batch); False when every rank must push them (`publish`)."""
        if not isinstance(self.syncer, DiskSyncer):
            return False
        if self.syncer.loaded is not None:
            call_all([url], "/update_weights_from_disk", {"model_path": str(self.syncer.loaded),
                                                         "weight_version": self.syncer.loaded_version}, self.timeout_s)
        return True

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
