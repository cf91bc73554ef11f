"""The model the one-GPU benchmarks build: Qwen2.5-1.5B's shape (its shipped config.json), or a tiny model of the
same architecture for the suite's CPU runs."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

QWEN_1_5B = Path(__file__).resolve().parents[1] / "launch" / "models" / "Qwen2.5-1.5B" / "config.json"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


def model_folder(tiny: bool, prefix: str) -> Path:
    """A new folder holding the model's config.json (what model.path and preflight read)."""
    config = json.loads(QWEN_1_5B.read_text())
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    (folder / "config.json").write_text(json.dumps({**config, **TINY} if tiny else config))
    return folder


@dataclass
class OneRank:
    folder: Path  # the model's config.json
    spec: object  # policy.hf_config.ModelSpec
    parallel: object  # config.ParallelConfig
    device: torch.device  # where the model lives (the GPU a device-faithful CPU run stands for)
    dtype: torch.dtype  # the run's training dtype: bf16 on GPUs and device-faithful CPU runs


def one_rank(device: str, tiny: bool, prefix: str) -> OneRank:
    """A world of one (torch.distributed and megatron's parallel state) on `device`, and the model to build in it."""
    from megatron_dapo.config import ParallelConfig, default_training_dtype
    from megatron_dapo.parallel.runtime import builds_for_gpu, free_port, init_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    folder = model_folder(tiny, prefix)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    parallel = ParallelConfig(device=device)
    runtime = init_runtime(parallel)
    dtype = getattr(torch, default_training_dtype(builds_for_gpu(parallel)))
    return OneRank(folder, model_spec_from_hf(folder), parallel, runtime.device, dtype)
