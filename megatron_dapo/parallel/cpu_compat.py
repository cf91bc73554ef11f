"""Run megatron-core on the CPU (gloo) by redirecting its hard-coded CUDA calls.

megatron-core assumes a GPU in many places: `torch.cuda.current_device()` as a device, the CUDA RNG
tracker, `device="cuda"` factories, `Tensor.cuda()`, CUDA type names in the optimizer. This module,
and only this module, maps those onto the CPU. It is switched on by the runtime for `device: cpu`
alone, so GPU runs see stock torch and megatron-core. With `MEGATRON_DAPO_DEVICE_FAITHFUL=1` (the tests)
it also keeps track of which tensors a GPU run would hold on the GPU and fails where the GPU would
(`megatron_dapo.parallel.device_faithful`).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch.overrides import TorchFunctionMode

from megatron_dapo.parallel import device_faithful

# The functions the mode rewrites whatever their keyword arguments; any other goes through untouched unless it
# names a device or pinned memory.
_REWRITTEN = frozenset({torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.to})


class _CpuDeviceMode(TorchFunctionMode):
    """Sends tensor factories and moves aimed at CUDA to the CPU, and reports CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The common case first: every op of every CPU run passes here (a decoding step of the tiny model: 550).
        if func not in _REWRITTEN and (not kwargs or ("device" not in kwargs and not kwargs.get("pin_memory"))):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The optimizer checks `param.type() == "torch.cuda.FloatTensor"`.
            return device_faithful.CUDA_TYPE_NAMES.get(args[0].dtype, args[0].type())
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if "device" in kwargs and device_faithful.is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and device_faithful.is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _HostEvent:
    """torch.cuda.Event for the CPU: timing from the host clock."""

    def __init__(self, enable_timing: bool = False, **_):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end._t - self._t) * 1e3


class _HostStream:
    """torch.cuda.Stream for the CPU: everything is already in order."""

    def __init__(self, *_, **__):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _HostEvent()
        event.record()
        return event

    def synchronize(self):
        pass


_HOST_STREAM = _HostStream()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's moe_utils.maybe_move_tensor_to_cpu for the CPU: the token dispatcher's split sizes must
    reach all_to_all_single as host numbers, but the original converts only CUDA tensors (and records a CUDA
    stream, which the CPU has none of)."""
    if not torch.is_tensor(tensor):
        return tensor
    host = tensor.cpu()
    return host.numpy() if as_numpy else host


class CpuCompat:
    """Installs the redirects on enter and restores everything on exit."""

    def __init__(self, faithful: bool = False, local_rank: int = 0):
        self._saved: list[tuple[object, str, object]] = []
        self._mode: _CpuDeviceMode | device_faithful.DeviceFaithful | None = None
        self.faithful, self.local_rank = faithful, local_rank

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> CpuCompat:
        import megatron.core.tensor_parallel.random as mp_random
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

        cuda = torch.cuda
        self._patch(cuda, "current_device", lambda: torch.device("cpu"))
        self._patch(cuda, "synchronize", lambda device=None: None)
        self._patch(cuda, "empty_cache", lambda: None)
        self._patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        self._patch(cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
        # Must really seed: the tracker derives a distinct model-parallel state per TP rank from it.
        self._patch(cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
        self._patch(cuda, "Event", _HostEvent)
        self._patch(cuda, "Stream", _HostStream)
        self._patch(cuda, "current_stream", lambda device=None: _HOST_STREAM)
        self._patch(cuda, "default_stream", lambda device=None: _HOST_STREAM)
        self._patch(cuda, "stream", lambda stream=None: contextlib.nullcontext())
        self._patch(cuda.nvtx, "range_push", lambda msg: None)
        self._patch(cuda.nvtx, "range_pop", lambda: None)
        self._patch(cuda.nvtx, "mark", lambda msg: None)
        self._patch(mp_random, "_get_cuda_rng_state",
                    lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
        self._patch(mp_random, "_set_cuda_rng_state",
                    lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
        # Without Transformer Engine moe_utils never defines te_general_gemm, which its router GEMM tests for.
        if not hasattr(moe_utils, "te_general_gemm"):
            self._saved.append((moe_utils, "te_general_gemm", None))
            moe_utils.te_general_gemm = None
        self._patch(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)
        # Every fork of the tracker moves the CPU generator, which it then warns about.
        tracker_log = logging.getLogger(mp_random.__name__)
        self._saved.append((tracker_log, "disabled", tracker_log.disabled))
        tracker_log.disabled = True
        self._mode = device_faithful.DeviceFaithful(self.local_rank) if self.faithful else _CpuDeviceMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


_ACTIVE: CpuCompat | None = None


def activate(faithful: bool | None = None, local_rank: int = 0) -> None:
    """Switch the redirects on for the rest of the process (idempotent); `faithful` (default: the
    MEGATRON_DAPO_DEVICE_FAITHFUL variable) adds the device-faithful checks."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = CpuCompat(device_faithful.requested() if faithful is None else faithful, local_rank).__enter__()


def deactivate() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.__exit__(None, None, None)
        _ACTIVE = None


def is_active() -> bool:
    return _ACTIVE is not None


def is_faithful() -> bool:
    """Whether tensors meant for the GPU are kept apart from host tensors (device-faithful mode)."""
    return _ACTIVE is not None and _ACTIVE.faithful
