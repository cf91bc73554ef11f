"""Process-group setup: torch.distributed and megatron-core's parallel_state, from torchrun or SLURM.

`device: cuda` uses NCCL with one GPU per process; `device: cpu` uses gloo and switches on the
megatron-core CPU redirects (megatron_dapo.cpu_compat) before anything of megatron runs.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo import cpu_compat
from megatron_dapo.config import ConfigError, ParallelConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a rendezvous or a server this process starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node: str  # the node this process runs on: its SLURM node name, else its host name


def launch_env(environ=None) -> LaunchEnv:
    """Rank and rendezvous from torchrun's variables, else SLURM's (srun one task per process)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    if world > 1 and "MASTER_ADDR" not in env:
        raise ConfigError("MASTER_ADDR: not set; launch with torchrun, or export MASTER_ADDR/MASTER_PORT for srun")
    return LaunchEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                     env.get("SLURMD_NODENAME") or socket.gethostname())


@dataclass(frozen=True)
class Runtime:
    parallel: ParallelConfig
    env: LaunchEnv
    data_parallel: int

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.parallel.device == "cpu" else torch.device("cuda", self.env.local_rank)


def init_runtime(parallel: ParallelConfig, environ=None, timeout_minutes: int = 30) -> Runtime:
    """Initialise torch.distributed, megatron's parallel groups and its RNG tracker; returns the layout."""
    env = launch_env(environ)
    data_parallel = parallel.data_parallel(env.world_size)
    if parallel.device == "cpu":
        cpu_compat.activate()
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device: 'cuda' but no GPU is visible; use 'cpu' or check CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(env.local_rank)
        backend = "nccl"
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(minutes=timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(parallel.seed, force_reset_rng=True)
    return Runtime(parallel, env, data_parallel)


def reset_parallel_layout() -> None:
    """Drop megatron's parallel groups, keeping torch.distributed, so another layout can be set up."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown_runtime() -> None:
    reset_parallel_layout()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_compat.deactivate()
