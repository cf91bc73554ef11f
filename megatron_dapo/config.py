"""Typed configuration, validated up front: every error names the bad key and says how to fix it."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the policy is split: tensor x pipeline x context x data parallel (data = world / the rest)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    device: str = "cuda"  # "cuda" (NCCL) or "cpu" (gloo)
    seed: int = 1234

    def __post_init__(self):
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            value = getattr(self, key)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"parallel.{key}",
                     f"must be a whole number >= 1, got {value!r}")
        _require(self.device in ("cuda", "cpu"), "parallel.device", f"must be 'cuda' or 'cpu', got {self.device!r}")
        _require(self.context_parallel == 1, "parallel.context_parallel",
                 f"context parallelism is not supported yet, got {self.context_parallel}; set it to 1")
        _require(self.expert_parallel == 1, "parallel.expert_parallel",
                 f"the supported models are dense; got {self.expert_parallel}, set it to 1")

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel(self, world_size: int) -> int:
        _require(world_size % self.model_parallel == 0, "parallel",
                 f"world size {world_size} is not divisible by tensor_parallel x pipeline_parallel x "
                 f"context_parallel = {self.model_parallel}; change the sizes or the number of processes")
        return world_size // self.model_parallel
