"""Colocated SGLang servers lend the trainer their accelerator memory while it trains.

After the rollout, `release`: the servers pause (a request still in flight is retracted: SGLang's release
asserts an idle scheduler and fails the whole server otherwise), then free their weights, KV cache and
CUDA graphs. After the optimizer steps, `resume_weights` maps the weights back, empty, for the weight sync
to fill; after the sync, `resume_caches` restores the KV cache and CUDA graphs and lets generation go on.
On GPUs the memory really goes back to the device (`--enable-memory-saver`); CPU servers run the same
calls without freeing anything.

Collective over the trainer's ranks, like the weight syncers: only global rank 0 talks to the servers,
and no rank goes on before they have answered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.weight_sync.server_calls import call_all

WEIGHTS = ["weights"]
CACHES = ["kv_cache", "cuda_graph"]


class ServerMemory:
    def __init__(self, server_urls: list[str], device: torch.device, timeout_s: float = 600.0):
        self.urls = list(server_urls) if dist.get_rank() == 0 else []
        self.device, self.timeout_s = device, timeout_s

    def _call(self, endpoint: str, payload: dict) -> None:
        call_all(self.urls, endpoint, payload, self.timeout_s)

    def release(self) -> None:
        self._call("/pause_generation", {"mode": "retract"})
        self._call("/release_memory_occupation", {"tags": WEIGHTS + CACHES})
        dist.barrier()

    def resume_weights(self) -> None:
        if self.device.type == "cuda":  # what training left in torch's cache goes back to the device for the servers
            torch.cuda.empty_cache()
        dist.barrier()
        self._call("/resume_memory_occupation", {"tags": WEIGHTS})
        dist.barrier()  # every node's pushing rank may start the sync now

    def resume_caches(self) -> None:
        self._call("/resume_memory_occupation", {"tags": CACHES})
        self._call("/continue_generation", {})
