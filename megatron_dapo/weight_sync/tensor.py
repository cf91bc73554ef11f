"""The colocated route: hand SGLang the tensors themselves through `/update_weights_from_tensor`.

A trainer rank fills a shared-memory bucket (a CUDA buffer on GPUs, shared by IPC) and POSTs only a
pickled handle to it; the server maps the same memory and copies it into its weights, so no tensor
data crosses HTTP. So a server takes its weights from a trainer rank on its own machine: the first
rank of each node that hosts servers receives every full tensor and pushes to the servers there (all
servers on global rank 0's node unless their nodes are given).

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
import socket
import sys
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)

from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.rollout.server_weight_loader import LOADER
from megatron_dapo.weight_sync.buckets import iter_hf_buckets, plain_buffer
from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.server_calls import WeightUpdateError, call_all, push_buckets, server_info


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


def _start_shm_manager_without_our_stderr() -> None:
    """Start the manager now, with /dev/null for the stderr it inherits (its stdout is a pipe of torch's own). A
    manager that outlives this process (an os._exit or a SIGKILL runs no exit handler; the servers hold it) would
    hold our stderr open, and a SLURM step ends only once its output closes: slurmstepd waited 60 s for it. A line
    another thread writes to stderr in this instant is lost."""
    sys.stderr.flush()
    ours, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        torch.empty(1).share_memory_()  # the first share starts the manager; later ones reuse its connection
    finally:
        os.dup2(ours, 2)
        os.close(ours)
        os.close(null)


def use_file_system_sharing() -> None:
    """Share CPU tensors by file name, and end the manager that starts when this process exits: the
    servers hold a connection to it, so it would outlive us. (Ending it any earlier breaks this process's
    later shares, which reuse its connection.)"""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")
        _start_shm_manager_without_our_stderr()
        atexit.register(_end_shm_managers)


class TensorSyncer:
    """Collective over the trainer's ranks. `server_nodes[i]` names the node server i runs on, in the terms
    of `node`, this rank's node (default: its host name); no `server_nodes`: all on global rank 0's node."""

    def __init__(self, server_urls: list[str], spec: ModelSpec, parallel: ParallelConfig, bucket_bytes: int,
                 timeout_s: float = 600.0, *, server_nodes: Sequence[str] = (), node: str | None = None):
        self.spec, self.parallel = spec, parallel
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node or socket.gethostname())
        first_rank: dict[str, int] = {}
        for rank, name in enumerate(nodes):
            first_rank.setdefault(name, rank)
        placed = list(server_nodes) or [nodes[0]] * len(server_urls)
        missing = sorted(set(placed) - set(first_rank))
        if missing:
            raise ValueError(f"rollout.server_nodes: no trainer rank runs on {', '.join(missing)} (the trainer's "
                             f"nodes: {', '.join(first_rank)}); the tensor route needs each server beside a "
                             f"trainer rank: place it there, or use the 'disk' route")
        pusher_of = [first_rank[name] for name in placed]
        self.pushers = sorted(set(pusher_of))  # the ranks that receive the full tensors
        self.urls = [u for u, rank in zip(server_urls, pusher_of) if rank == dist.get_rank()]  # this rank's servers
        infos = [server_info(u) for u in self.urls]
        self.tp_sizes = [int(info["tp_size"]) for info in infos]
        refused = [u for u, info in zip(self.urls, infos) if LOADER not in (info.get("custom_weight_loader") or [])]
        if refused:
            raise WeightUpdateError(
                f"{', '.join(refused)}: started without --custom-weight-loader {LOADER}; the tensor route needs it "
                "(without it a server answers before it has read the bucket, and the next one overwrites it). "
                "Start the servers with it (megatron-dapo's own do), or use the 'disk' route")
        if parallel.device == "cpu" and self.urls:
            use_file_system_sharing()

    def sync(self, model: torch.nn.Module, version: str, skip: Sequence[str] = ()) -> SyncMetrics | None:
        """The metrics on each pushing rank, None elsewhere. Colocated servers are pushed to by the rank beside
        them, which cannot leave one out: `skip` (servers down) is refused."""
        if skip:
            raise WeightUpdateError(f"the tensor route cannot push around servers that are down: {', '.join(skip)}; "
                                    "the run resumes from its last checkpoint once they are back")
        def push(bucket):
            named = bucket.named_tensors()
            # One pickle per receiving rank: each unpickling takes back the reference its pickling added.
            payloads = [{"serialized_named_tensors": [serialize(named) for _ in range(tp)], "load_format": LOADER,
                         "flush_cache": bucket.last, "weight_version": version if bucket.last else None}
                        for tp in self.tp_sizes]
            call_all(self.urls, "/update_weights_from_tensor", lambda i: payloads[i], self.timeout_s)

        buckets = iter_hf_buckets(model, self.spec, self.parallel, self.bucket_bytes, shared_buffer, self.pushers)
        return push_buckets(self.urls, buckets, push, self.timeout_s)

    def close(self) -> None:
        """Nothing to release: each sync's bucket buffer died with it (the shared-memory manager stays
        until this process exits: this process's later shares go through it)."""
