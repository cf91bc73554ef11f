"""The colocated route: hand SGLang the tensors themselves through `/update_weights_from_tensor`.

Global rank 0 fills a shared-memory bucket (a CUDA buffer on GPUs, shared by IPC) and POSTs only a
pickled handle to it; the server maps the same memory and copies it into its weights, so no tensor
data crosses HTTP. The server must run on the same machine as trainer rank 0.

On the CPU, the handles need torch's "file_system" sharing strategy (the default one passes file
descriptors with an auth key SGLang's scheduler does not hold, and the scheduler dies). The strategy
is process-wide and starts a `torch_shm_manager` daemon that lives as long as its clients (the
servers among them); it is ended when this process exits.
"""

from __future__ import annotations

import atexit
import base64
import io
import os
import signal
from multiprocessing.reduction import ForkingPickler

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)

from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.weight_sync.buckets import iter_hf_buckets, plain_buffer
from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.server_calls import call_all, push_buckets, server_tp_size


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A bucket buffer another process on this machine can map."""
    if device.type == "cpu":
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return plain_buffer(nbytes, device)  # CUDA tensors travel as IPC handles as they are


def serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The handles of the tensors, as SGLang's scheduler unpickles them (base64 for JSON)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


def _end_shm_managers() -> None:
    """End the torch_shm_manager daemons this process started."""
    for child in psutil.Process().children(recursive=True):
        if child.name() == "torch_shm_manager":
            os.kill(child.pid, signal.SIGTERM)


def use_file_system_sharing() -> None:
    """Share CPU tensors by file name, and end the manager that starts when this process exits: the
    servers hold a connection to it, so it would outlive us and keep our stdout open. (Ending it any
    earlier breaks this process's later shares, which reuse its connection.)"""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")
        atexit.register(_end_shm_managers)


class TensorSyncer:
    """Collective over the trainer's ranks; only global rank 0 talks to the servers."""

    def __init__(self, server_urls: list[str], spec: ModelSpec, parallel: ParallelConfig, bucket_bytes: int,
                 timeout_s: float = 600.0):
        self.urls, self.spec, self.parallel = list(server_urls), spec, parallel
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.tp_sizes = [server_tp_size(u) for u in self.urls] if dist.get_rank() == 0 else []
        if parallel.device == "cpu" and dist.get_rank() == 0:
            use_file_system_sharing()

    def sync(self, model: torch.nn.Module, version: str) -> SyncMetrics | None:
        def push(bucket):
            named = bucket.named_tensors()
            # One pickle per receiving rank: each unpickling takes back the reference its pickling added.
            payloads = [{"serialized_named_tensors": [serialize(named) for _ in range(tp)],
                         "flush_cache": bucket.last, "weight_version": version if bucket.last else None}
                        for tp in self.tp_sizes]
            call_all(self.urls, "/update_weights_from_tensor", lambda i: payloads[i], self.timeout_s)

        buckets = iter_hf_buckets(model, self.spec, self.parallel, self.bucket_bytes, shared_buffer)
        return push_buckets(self.urls, buckets, push, self.timeout_s)

    def close(self) -> None:
        """Nothing to release: each sync's bucket buffer died with it (the shared-memory manager stays
        until this process exits: this process's later shares go through it)."""
