"""The fallback route: export a Hugging Face checkpoint, then have each SGLang server load it.

Collective over the trainer's ranks. The export streams one tensor at a time to global rank 0,
which writes the folder atomically and then asks every server to load it with
`/update_weights_from_disk`, tagging the weights with `version` (the training step); SGLang flushes
its cache as part of the update. The folder of the previous sync is removed once a newer one is loaded.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.server_calls import call_up


def sync_weights_via_disk(model, spec, parallel, *, server_urls: list[str], directory, version: str,
                          hf_config: dict, timeout_s: float = 600.0) -> SyncMetrics | None:
    """Returns the metrics on global rank 0, None elsewhere; raises if any server refuses the update (one that
    does not answer is down, left out)."""
    start = time.perf_counter()
    folder = Path(directory) / f"weights-{version}"
    if dist.get_rank() == 0 and folder.exists():  # left by a run that stopped after exporting this version
        shutil.rmtree(folder)
    dist.barrier()
    export_hf_checkpoint(model, spec, parallel, folder, hf_config=hf_config)
    metrics = None
    if dist.get_rank() == 0:
        # A server killed meanwhile (it may be sampling: rollout.mode async) is left out: its restart loads it.
        call_up(server_urls, "/update_weights_from_disk",
                {"model_path": str(folder), "weight_version": version, "flush_cache": True}, timeout_s)
        nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        metrics = SyncMetrics(nbytes, time.perf_counter() - start)
    dist.barrier()
    return metrics


class DiskSyncer:
    """`sync_weights_via_disk` behind the common syncer interface."""

    def __init__(self, server_urls: list[str], spec: ModelSpec, parallel: ParallelConfig, hf_config: dict,
                 work_dir, timeout_s: float = 600.0):
        self.urls, self.spec, self.parallel, self.hf_config = list(server_urls), spec, parallel, hf_config
        self.work_dir, self.timeout_s = Path(work_dir), timeout_s
        self.loaded: Path | None = None  # the folder the servers serve now
        self.loaded_version: str | None = None  # the version it was loaded under

    def sync(self, model: torch.nn.Module, version: str, skip: Sequence[str] = ()) -> SyncMetrics | None:
        """`skip`: servers down, left out (a server's restart loads `loaded`)."""
        metrics = sync_weights_via_disk(model, self.spec, self.parallel,
                                        server_urls=[u for u in self.urls if u not in skip],
                                        directory=self.work_dir, version=version, hf_config=self.hf_config,
                                        timeout_s=self.timeout_s)
        folder = self.work_dir / f"weights-{version}"
        if dist.get_rank() == 0 and self.loaded is not None and self.loaded != folder:
            shutil.rmtree(self.loaded, ignore_errors=True)
        self.loaded, self.loaded_version = folder, version
        return metrics

    def close(self) -> None:
        """The last folder stays: the servers serve it."""
