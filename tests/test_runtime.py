"""The runtime's launch-environment parsing and the megatron-core CPU compatibility layer."""

import random
import socket

import pytest
import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.parallel import cpu_compat
from megatron_dapo.parallel.runtime import PORT_FLOOR, free_port, launch_env


def test_torchrun_environment():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "6000"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "node7", 6000)


def test_slurm_environment():
    env = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "MASTER_ADDR": "n1",
                      "SLURMD_NODENAME": "gpu-017"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port, env.node) == (5, 16, 5, 29500, "gpu-017")


def test_the_node_is_the_host_outside_slurm():
    assert launch_env({}).node == socket.gethostname()


def test_single_process_without_launcher():
    assert launch_env({}).world_size == 1


def test_a_single_process_without_launcher_binds_no_port():
    """Issue 52: a one-process `megatron-dapo mismatch` failed with EADDRINUSE on 29500, which a run beside it
    held; then a free port found first was taken by another lane's process before the rendezvous bound it
    (test_bad_input's resume case in the suite). A world of one keeps its store in-process: no port at all."""
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime

    assert launch_env({}).master_port is None
    runtime = init_runtime(ParallelConfig(device="cpu"), environ={})
    try:
        assert runtime.env.world_size == 1 and torch.distributed.get_world_size() == 1
        t = torch.ones(3, device=runtime.device)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        shutdown_runtime()


def test_free_ports_lie_below_the_ephemeral_range_and_differ_whatever_the_seed():
    """A port inside the ephemeral range may be taken by any process's outgoing connection before the listener
    binds it (the suite's lanes failed so); two processes seeded alike must not draw the same port."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = []
    for _ in range(20):
        random.seed(0)
        ports.append(free_port())
    assert all(PORT_FLOOR <= p < low for p in ports) and len(set(ports)) > 10, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_multi_process_needs_master_addr():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        launch_env({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.fixture
def compat():
    cpu_compat.activate(faithful=False)
    try:
        yield
    finally:
        cpu_compat.deactivate()


def test_cuda_factories_and_moves_land_on_cpu(compat):
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2, device=0).device.type == "cpu"
    t = torch.arange(4)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu" and t.pin_memory() is t
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert torch.zeros(2, dtype=torch.float32).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # with an argument: the real conversion
    torch.cuda.synchronize()


def test_cuda_rng_calls_drive_the_cpu_generator(compat):
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.manual_seed(123)
    a = torch.rand(3)
    torch.cuda.manual_seed(123)
    assert torch.equal(torch.rand(3), a)
    state = mp_random._get_cuda_rng_state()
    b = torch.rand(3)
    mp_random._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), b)


def test_host_events_time_on_the_host_clock(compat):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.current_stream().wait_stream(torch.cuda.current_stream())
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)


def test_deactivate_restores_stock_torch():
    before = torch.cuda.current_device
    cpu_compat.activate(faithful=False)
    assert cpu_compat.is_active() and torch.cuda.current_device is not before
    cpu_compat.deactivate()
    assert not cpu_compat.is_active() and torch.cuda.current_device is before
    assert torch.zeros(2).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # no GPU here: stock torch refuses


def test_ranks_wait_for_the_driver_outside_collectives(tmp_path):
    """A rollout outlasts every collective's watchdog: the waiting ranks must not sit in one meanwhile."""
    from torchrun_launch import torchrun

    torchrun("driver_signal_worker.py", 2, str(tmp_path / "out.txt"), timeout=120)
    first, second, groups, waited = (tmp_path / "out.txt").read_text().split()
    assert (first, second, groups) == ("resync", "batch", "3")
    assert float(waited) >= 10.0  # five times the group's 2 s timeout
