"""The device-faithful CPU mode fails where a GPU would, and lets through what a GPU runs."""

import io
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_dapo.parallel.cpu_compat import CpuCompat
from megatron_dapo.parallel.device_faithful import DeviceMixError
from megatron_dapo.parallel.runtime import free_port


@pytest.fixture
def faithful():
    with CpuCompat(faithful=True, local_rank=1):
        yield


@pytest.fixture
def world(faithful):
    """A one-process world: its default group runs NCCL on GPUs, `host` is a gloo group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()


def test_tensors_say_where_a_gpu_run_keeps_them(faithful):
    dev = torch.zeros(3, device="cuda")
    assert dev.device == torch.device("cuda", 1) and dev.is_cuda and dev.get_device() == 1
    assert torch.ones(2).device.type == "cpu" and not torch.ones(2).is_cuda
    assert torch.empty(2, device=dev.device).is_cuda  # devices derived from tensors follow them
    assert torch.empty(2, device=torch.cuda.current_device()).is_cuda
    assert (dev + 1).is_cuda and dev[1:].is_cuda and dev.double().is_cuda and torch.zeros_like(dev).is_cuda
    assert dev.type() == "torch.cuda.FloatTensor" and torch.zeros(1).type() == "torch.FloatTensor"


def test_places_of_freed_storages_are_dropped_and_live_ones_kept(faithful, monkeypatch):
    """The place table is keyed by storage id: the entries of freed storages go when it outgrows its bound (an id
    may be reused by a new storage, which must not inherit the old place), and a live tensor keeps its place. A
    table of its own: the storages earlier tests in this process keep alive (megatron-core's caches) would raise
    the bound."""
    from megatron_dapo.parallel import device_faithful

    monkeypatch.setattr(device_faithful, "_place", {})
    monkeypatch.setattr(device_faithful, "_PURGE_FLOOR", 64)
    monkeypatch.setattr(device_faithful, "_purge_above", [64])
    kept = torch.zeros(3, device="cuda")
    for _ in range(200):
        (torch.ones(4, device="cuda") * 2).sum()  # device tensors made and freed at once
    assert len(device_faithful._place) <= 2 * 64
    assert kept.is_cuda and (kept + 1).is_cuda and not torch.ones(2).is_cuda


class _AllocatesInBackward(torch.autograd.Function):
    """As megatron-core's all-to-all and sequence-parallel backward do: a buffer on torch.cuda.current_device()."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        assert out.is_cuda  # the mode sees the backward: a device buffer, not a CUDA initialisation
        return out.copy_(grad * 2)


@pytest.mark.parametrize("call", ["tensor", "autograd", "nested"])
def test_a_backward_runs_under_the_mode(faithful, call):
    """torch hands torch.autograd.backward to the function mode, which would run it with the mode off: custom
    Functions' backward would then allocate on a real CUDA device (megatron-core's MoE all-to-all), or see device
    tensors as host ones (its router replaced its weight's data with a copy, and the optimizer's updates were
    lost). A backward inside a backward (megatron-core's activation recompute) runs under it too."""
    x = torch.ones(3, device="cuda", requires_grad=True)
    if call == "nested":
        y = torch.ones(3, device="cuda", requires_grad=True)

        class Recompute(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.detach() * 1

            @staticmethod
            def backward(ctx, grad):
                with torch.enable_grad():
                    torch.autograd.backward(_AllocatesInBackward.apply(y), grad)
                return grad

        Recompute.apply(x).sum().backward()
        assert torch.equal(y.grad.cpu(), torch.full((3,), 2.0)) and y.grad.is_cuda
    elif call == "tensor":
        _AllocatesInBackward.apply(x).sum().backward()
    else:
        torch.autograd.backward([_AllocatesInBackward.apply(x)], grad_tensors=[torch.ones(3, device="cuda")])
    assert torch.equal(x.grad.cpu(), torch.full((3,), 2.0 if call != "nested" else 1.0)) and x.grad.is_cuda


def test_the_engines_zeros_for_a_gradient_no_node_made_are_device_memory(faithful):
    """An output of no elements that nothing uses (an expert-parallel rank that received no token: GLM-4.5's grouped
    routing at EP 2 gives one) gets its gradient from the autograd engine itself, zeros with the forward tensor's
    options: GPU memory on a GPU, which megatron-core's all-to-all then sends over NCCL. Python code's own host
    tensors in a backward stay host memory."""
    seen = []

    class Split(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2, t[:0] * 1

        @staticmethod
        def backward(ctx, grad, grad_empty):
            seen.append((grad_empty, torch.zeros(0)))
            return grad * 2

    x = torch.ones(3, device="cuda", requires_grad=True)
    Split.apply(x)[0].sum().backward()
    [(made_by_the_engine, made_by_python)] = seen
    assert made_by_the_engine.numel() == 0 and made_by_the_engine.is_cuda and not made_by_python.is_cuda


def test_moves_copy_between_host_and_device(faithful):
    host = torch.arange(4.0)
    moved = host.cuda()
    assert moved.is_cuda and moved is not host and not host.is_cuda
    assert host.to("cuda").is_cuda and host.to(0).is_cuda and host.to(device="cuda:0", dtype=torch.float64).is_cuda
    assert not moved.cpu().is_cuda and not moved.to("cpu").is_cuda and moved.cuda() is moved
    assert host.to(moved).is_cuda and host.type_as(moved).is_cuda and not moved.to(host).is_cuda
    assert np.array_equal(moved.cpu().numpy(), host.numpy())


def test_mixing_host_and_device_tensors_raises_as_cuda_does(faithful):
    dev, host = torch.zeros(3, device="cuda"), torch.ones(3)
    with pytest.raises(DeviceMixError, match="Expected all tensors to be on the same device"):
        dev - host
    with pytest.raises(DeviceMixError):
        torch.where(host > 0, dev, 0.0)
    with pytest.raises(DeviceMixError):
        torch.maximum(torch.zeros(1), dev.max().reshape(1))
    with pytest.raises(DeviceMixError):
        host.add_(dev)
    with pytest.raises(DeviceMixError):
        torch.zeros((), dtype=torch.float32).add_(dev.sum())  # a host scalar may be read, not written
    with pytest.raises(DeviceMixError):
        torch.cat([dev, host])
    with pytest.raises(DeviceMixError):
        host[torch.tensor([0, 1], device="cuda")]
    with pytest.raises(TypeError, match="can't convert cuda"):
        dev.numpy()


def test_what_cuda_allows_passes(faithful):
    dev = torch.arange(6.0, device="cuda").requires_grad_()
    assert (dev * torch.tensor(2.0)).is_cuda  # 0-dim host tensors are CPU scalars
    assert dev[torch.tensor([0, 2])].is_cuda  # host index tensors
    out = torch.empty(3)
    out.copy_(dev[:3])  # copies cross
    assert not out.is_cuda
    (dev.softmax(0) * torch.arange(6.0).cuda()).sum().backward()  # autograd's own tensors follow
    assert dev.grad.is_cuda
    assert torch.tensor([dev.sum(), dev.max()]).device.type == "cpu"  # torch.tensor reads the values
    g = torch.Generator(device="cuda").manual_seed(0)
    assert torch.empty(4, device="cuda").exponential_(generator=g).is_cuda


def test_collectives_of_nccl_groups_refuse_host_tensors(world):
    host_group = world
    dev = torch.ones(2, device="cuda")
    dist.all_reduce(dev)
    with pytest.raises(DeviceMixError, match="NCCL error.*host tensor"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(DeviceMixError, match="NCCL"):
        dist.broadcast(torch.empty(2), src=0)
    dist.all_reduce(torch.ones(2), group=host_group)  # gloo groups (megatron's *_gloo) take host tensors
    box = [{"a": 1}]
    dist.broadcast_object_list(box, src=0)  # object collectives pick the group's device themselves
    gathered = [None]
    dist.all_gather_object(gathered, "x")
    assert box == [{"a": 1}] and gathered == ["x"]
    dist.barrier()


def test_off_unless_asked(monkeypatch):
    from megatron_dapo.parallel import cpu_compat

    monkeypatch.delenv("MEGATRON_DAPO_DEVICE_FAITHFUL", raising=False)
    cpu_compat.activate()
    try:
        assert not cpu_compat.is_faithful()
        torch.zeros(3, device="cuda") - torch.ones(3)  # the plain CPU redirects
    finally:
        cpu_compat.deactivate()


def _loaded(t: torch.Tensor) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf)


def _gloo_filled(host_group) -> torch.Tensor:
    with torch._C.DisableTorchFunction():  # made out of the modes' sight, as torch's C++ makes buffers: no place
        buf = torch.empty(3)
    dist.broadcast(buf, src=0, group=host_group)
    return buf


# Tensors that come from outside torch's ops: host memory on a GPU, whatever they meet later.
MADE_OUTSIDE = {
    "frombuffer": lambda g: torch.frombuffer(bytearray(12), dtype=torch.float32),
    "from_numpy": lambda g: torch.from_numpy(np.ones(3, dtype=np.float32)),
    "as_tensor": lambda g: torch.as_tensor(np.ones(3, dtype=np.float32)),
    "torch.load": lambda g: _loaded(torch.ones(3)),
    "unpickled": lambda g: pickle.loads(pickle.dumps(torch.ones(3))),
    "gloo-filled": _gloo_filled,
}


@pytest.mark.parametrize("make", MADE_OUTSIDE)
def test_tensors_made_outside_torch_ops_are_host_memory(world, make):
    host = MADE_OUTSIDE[make](world)
    assert not host.is_cuda
    with pytest.raises(DeviceMixError, match="Expected all tensors to be on the same device"):
        torch.zeros(3, device="cuda") + host
    assert (host.cuda() + torch.zeros(3, device="cuda")).is_cuda  # moved, it is device memory


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: t.tolist(), bool, float, int, lambda t: [0, 1][t]])
def test_reading_a_device_tensor_on_the_host_inside_a_no_sync_region_raises(faithful, read):
    """What torch.cuda.set_sync_debug_mode("error") refuses on a GPU, inside the regions that must not stall its
    queue (the fused loss and the loss function); outside them, and of host tensors, such reads are fine."""
    from megatron_dapo.ops.host_sync import no_host_sync

    dev, host = torch.ones((), device="cuda", dtype=torch.long), torch.ones((), dtype=torch.long)
    with no_host_sync("the test's region"):
        with pytest.raises(DeviceMixError, match="inside the test's region, which must not sync the GPU"):
            read(dev)
        read(host)
    read(dev)


def test_the_fused_loss_forward_and_backward_read_nothing_on_the_host(faithful):
    """The op as the training step calls it, on device tensors, in the mode that refuses host reads inside it;
    a normaliser on the device is refused by name (reading it would be such a sync)."""
    from megatron_dapo.ops.dapo_loss import dapo_loss

    n = 64
    logp = torch.randn(n, device="cuda", dtype=torch.float64).requires_grad_()
    old, adv = torch.randn(n, device="cuda", dtype=torch.float64), torch.randn(n, device="cuda", dtype=torch.float64)
    mask = torch.rand(n, device="cuda") > 0.3
    loss, stats = dapo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, normalizer=float(n), dual_clip_c=3.0)
    (2.0 * loss).backward()  # a gradient other than 1: the backward's scaling path
    assert logp.grad.is_cuda and stats.num_tokens.is_cuda
    with pytest.raises(ValueError, match="normalizer is a tensor on the device"):
        dapo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, normalizer=torch.tensor(64.0, device="cuda"))
