"""One entry point over the three weight-sync routes.

    syncer = make_weight_syncer("distributed", server_urls, spec, parallel, hf_config, bucket_mb=512, work_dir=...)
    metrics = syncer.sync(model, version=str(step))  # collective; SyncMetrics on global rank 0, None elsewhere
    syncer.sync(model, version, skip=[url])  # a server that is down left out (the disk and distributed routes)
    syncer.close()

Routes: "distributed" (servers on other GPUs or machines: a weight-update process group, NCCL/gloo),
"tensor" (colocated servers, each fed by the first trainer rank on its machine: shared memory / CUDA
IPC handles), "disk" (a Hugging Face checkpoint in `work_dir` that each server loads; the fallback).
Create the syncer on every trainer rank; global rank 0 talks to the servers (with "tensor", the first
rank of each node with servers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.weight_sync.buckets import bucket_bytes_from_mb
from megatron_dapo.weight_sync.disk import DiskSyncer
from megatron_dapo.weight_sync.distributed import DistributedSyncer
from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.tensor import TensorSyncer

ROUTES = ("distributed", "tensor", "disk")


class WeightSyncer(Protocol):
    def sync(self, model: torch.nn.Module, version: str, skip: Sequence[str] = ()) -> SyncMetrics | None:
        """Collective; `skip`: servers that are down (global rank 0's word), left out of this push."""

    def close(self) -> None: ...


def make_weight_syncer(route: str, server_urls: list[str], spec: ModelSpec, parallel: ParallelConfig,
                       hf_config: dict, bucket_mb: float = 512, work_dir=None, *,
                       master_address: str = "127.0.0.1", timeout_s: float = 600.0, server_nodes: Sequence[str] = (),
                       node: str | None = None) -> WeightSyncer:
    """`master_address`: where servers reach trainer rank 0 ("distributed" only). `server_nodes`: the node
    of each server, `node`: this rank's ("tensor" only; see TensorSyncer)."""
    if route not in ROUTES:
        raise ValueError(f"rollout.weight_sync must be one of {', '.join(ROUTES)}; got {route!r}")
    if not server_urls:
        raise ValueError("rollout.weight_sync: no server URLs to sync into; start the rollout servers first")
    if route == "disk":
        if work_dir is None:
            raise ValueError("weight_sync work_dir is required for the disk route (where checkpoints are written)")
        return DiskSyncer(server_urls, spec, parallel, hf_config, work_dir, timeout_s)
    bucket_bytes = bucket_bytes_from_mb(bucket_mb)
    if route == "tensor":
        return TensorSyncer(server_urls, spec, parallel, bucket_bytes, timeout_s, server_nodes=server_nodes,
                            node=node)
    return DistributedSyncer(server_urls, spec, parallel, bucket_bytes, master_address=master_address,
                             timeout_s=timeout_s)
