"""The fallback route: export a Hugging Face checkpoint, then have each SGLang server load it.

Collective over the trainer's ranks. The export streams one tensor at a time to global rank 0,
which writes the folder atomically and then asks every server to load it with
`/update_weights_from_disk`, tagging the weights with `version` (the training step); SGLang flushes
its cache as part of the update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
from megatron_dapo.rollout.sglang_server import post_json


@dataclass
class SyncMetrics:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def sync_weights_via_disk(model, spec, parallel, *, server_urls: list[str], directory, version: str,
                          hf_config: dict, timeout_s: float = 600.0) -> SyncMetrics | None:
    """Returns the metrics on global rank 0, None elsewhere; raises if any server refuses the update."""
    start = time.perf_counter()
    folder = Path(directory) / f"weights-{version}"
    export_hf_checkpoint(model, spec, parallel, folder, hf_config=hf_config)
    metrics = None
    if dist.get_rank() == 0:
        for url in server_urls:
            reply = post_json(f"{url.rstrip('/')}/update_weights_from_disk",
                              {"model_path": str(folder), "weight_version": version, "flush_cache": True}, timeout_s)
            if not reply.get("success"):
                raise RuntimeError(f"{url}: update_weights_from_disk failed: {reply.get('message', reply)}")
        nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        metrics = SyncMetrics(nbytes, time.perf_counter() - start)
    dist.barrier()
    return metrics
