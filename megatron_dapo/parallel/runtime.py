"""Process-group setup: torch.distributed and megatron-core's parallel_state, from torchrun or SLURM.

`device: cuda` uses NCCL with one GPU per process; `device: cpu` uses gloo and switches on the
megatron-core CPU redirects (megatron_dapo.parallel.cpu_compat) before anything of megatron runs.
"""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.parallel import cpu_compat, device_faithful


PORT_FLOOR = 10000  # below it: well-known services (SLURM's 6817-6819, web servers' 8000-9999)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, for a rendezvous or a server this process starts. Drawn at random
    below the kernel's ephemeral range, not from bind(0): a port there is where any process's outgoing
    connections (calls to the servers, the gloo mesh) take their local ports, so one could take it between this
    check and the listener's bind (EADDRINUSE), as the suite's two lanes showed."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # not the seeded module generator: two processes must not draw alike
    for _ in range(100):
        port = draw.randrange(PORT_FLOOR, low) if low > PORT_FLOOR + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"free_port: no free TCP port on {host} in [{PORT_FLOOR}, {low}) after 100 draws")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and the other systems' ranges start above it


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None  # None: a world of one without a launcher, which needs no rendezvous
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
    # A world of one without a launcher has no one to meet: no port (torchrun's 29500, or a free port found first,
    # may be taken by another run on the machine before it binds it).
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else 29500 if world > 1 else None
    return LaunchEnv(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port,
                     env.get("SLURMD_NODENAME") or socket.gethostname())


def builds_for_gpu(parallel: ParallelConfig) -> bool:
    """Whether this run builds what a GPU run builds, its precision included: on GPUs, and in device-faithful CPU
    runs, also in their processes that do not start the mode (a server's, the rollout service's)."""
    return parallel.device == "cuda" or device_faithful.requested()


def tensors_on_gpu(parallel: ParallelConfig) -> bool:
    """Whether the model and its batches live on GPUs; also in device-faithful CPU runs, where host memory
    stands for them."""
    return parallel.device == "cuda" or cpu_compat.is_faithful()


@dataclass(frozen=True)
class Runtime:
    parallel: ParallelConfig
    env: LaunchEnv
    data_parallel: int

    @property
    def device(self) -> torch.device:
        """Where this rank's model and batches live: its GPU (in device-faithful CPU runs, the GPU the
        tensors stand for), else the CPU."""
        return torch.device("cuda", self.env.local_rank) if tensors_on_gpu(self.parallel) else torch.device("cpu")


def init_runtime(parallel: ParallelConfig, environ=None) -> Runtime:
    """Initialise torch.distributed, megatron's parallel groups and its RNG tracker; returns the layout.
    A collective that waits longer than parallel.distributed_timeout_minutes fails the job."""
    env = launch_env(environ)
    timeout_minutes = parallel.distributed_timeout_minutes
    data_parallel = parallel.data_parallel(env.world_size)
    if parallel.device == "cpu":
        cpu_compat.activate(local_rank=env.local_rank)
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device: 'cuda' but no GPU is visible; use 'cpu' or check CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(env.local_rank)
        backend = "nccl"
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        # a world of one keeps its store in-process (no port to bind); any other meets at MASTER_ADDR:MASTER_PORT
        where = {"store": dist.HashStore()} if env.master_port is None else \
            {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
        dist.init_process_group(backend, **where, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(minutes=timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=1,  # each expert whole on its rank (policy.model builds it so)
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(parallel.seed, force_reset_rng=True)
    return Runtime(parallel, env, data_parallel)


class DriverSignal:
    """Global rank 0 (the driver) works alone, for as long as it takes (a rollout, an evaluation), while the
    other ranks wait for its word outside any collective: they poll torch.distributed's key-value store, so
    no collective's watchdog runs out during a rollout of hours. Each `post` on the driver pairs with one
    `wait` on every other rank, in order; the ranks then go on to whatever collective the message names."""

    PREFIX = "megatron_dapo/driver/"

    def __init__(self, poll_s: float = 0.05):
        self.store = dist.distributed_c10d._get_default_store()
        self.poll_s = poll_s
        self.sent = 0

    def _key(self, n: int) -> str:
        return f"{self.PREFIX}{n}"

    def post(self, message: str) -> None:
        """Driver: hand `message` to every other rank (a few bytes a step stay in the store: no rank is
        known to have read a message until it next meets the driver in a collective)."""
        self.sent += 1
        self.store.set(self._key(self.sent), message)

    def wait(self) -> str:
        """Other ranks: the driver's next message."""
        self.sent += 1
        key = self._key(self.sent)
        while not self.store.check([key]):
            time.sleep(self.poll_s)
        return self.store.get(key).decode()


def driver_value(value):
    """Every rank (collective): the driver's (global rank 0's) `value`, a picklable object."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def driver_call(fn):
    """Every rank (collective): what `fn()` returns on the driver, which alone calls it; an exception it raises there
    is raised on every rank (the others would otherwise wait in their next collective until it times out)."""
    payload = None
    if dist.get_rank() == 0:
        try:
            payload = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
            payload = ("error", e)
    status, value = driver_value(payload)
    if status == "error":
        raise value
    return value


def reset_parallel_layout() -> None:
    """Drop megatron's parallel groups, keeping torch.distributed, so another layout can be set up."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown_runtime() -> None:
    reset_parallel_layout()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_compat.deactivate()
