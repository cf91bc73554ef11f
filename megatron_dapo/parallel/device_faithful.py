"""Device-faithful CPU mode: on the CPU, fail where the GPU would.

The CPU redirects (`cpu_compat`) turn every CUDA tensor into a host tensor, so a host tensor mixed with
a device tensor, or a host tensor handed to an NCCL collective, passes on the CPU and crashes on the
first GPU step. In this mode every storage carries the place the GPU path would have given it:

- *device*: made with a CUDA device (`device="cuda"`, an int, `runtime.device`, `x.device` of a device
  tensor), moved there (`.cuda()`, `.to(cuda)`), or computed from device tensors;
- *host*: made by a Python-level torch call without a CUDA device (`torch.tensor(list)`,
  `torch.zeros(n)`), or moved there (`.cpu()`, `.to("cpu")`, which copy, as they do from a GPU);
- *host* too: whatever comes from outside torch's ops, as on a GPU: `torch.from_numpy`, `torch.frombuffer`,
  `torch.as_tensor` of an array, a `torch.load`-ed or unpickled tensor (its storage takes the place of the
  host tensor it is set into), a buffer that a gloo collective fills;
- *unknown*: made inside torch's C++ (backward formulas), which on a GPU follows the tensors it is used
  with; it takes the place of the first tensor it meets.

An op that mixes device and host tensors raises the error CUDA raises (0-dim host tensors are allowed,
as CUDA allows CPU scalars; so are cross-device copies and host index tensors); `.numpy()` of a device
tensor raises; so does reading a device tensor on the host (`.item()`, `.tolist()`, `bool()`, `float()`,
`int()`) inside a region that must not sync the GPU (ops/host_sync.py: the fused loss and the loss function),
as `torch.cuda.set_sync_debug_mode("error")` does there; a collective over a group that runs NCCL on GPUs (every group not created with an
explicit gloo backend) refuses host tensors, as NCCL does. `x.device` of a device tensor reports
`cuda:LOCAL_RANK`, so code that derives devices from tensors follows the GPU path.

Switched on with `MEGATRON_DAPO_DEVICE_FAITHFUL=1` for CPU runs (the test suite sets it); it costs a
Python call per tensor op, so plain CPU runs (the demo) leave it off.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.ops.host_sync import current_region

ENV = "MEGATRON_DAPO_DEVICE_FAITHFUL"

DEVICE, HOST = True, False
# id(untyped storage) -> (a weak reference to it, DEVICE / HOST); absent or dead: unknown. Looked up on every op:
# a plain dict checked through the reference (an id outlives its storage and may be reused) takes a third of the
# time of torch's WeakIdKeyDictionary, which builds a weak reference for each lookup.
_place: dict[int, tuple[weakref.ref, bool]] = {}
_PURGE_FLOOR = 1 << 16
_purge_above = [_PURGE_FLOOR]  # entries of dead storages are dropped when the table outgrows this
_host_groups: set[str] = set()  # names of process groups that stay gloo on GPUs
_local = [0]  # this process's GPU ordinal (LOCAL_RANK)
_in_engine = threading.local()  # .depth: autograd engine runs (backward passes) under way on this thread


def requested(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(ENV, "0") == "1"


def local_device() -> torch.device:
    """The GPU this process's device tensors stand for."""
    return torch.device("cuda", _local[0])


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta: no plain storage
        return None


def place(t: torch.Tensor) -> bool | None:
    s = _storage(t)
    if s is None:
        return None
    entry = _place.get(id(s))
    return entry[1] if entry is not None and entry[0]() is s else None


def is_device(t: torch.Tensor) -> bool:
    return place(t) is DEVICE


def _set(t: torch.Tensor, where: bool) -> torch.Tensor:
    s = _storage(t)
    if s is not None:
        _place[id(s)] = (weakref.ref(s), where)
        if len(_place) > _purge_above[0]:
            _purge()
    return t


def _purge() -> None:
    """Drop the entries of storages that are gone; the next purge waits until the table has doubled (amortised).
    The items are copied in one call (atomic under the GIL): another thread may tag tensors meanwhile."""
    for key, (ref, _) in list(_place.items()):
        if ref() is None:
            _place.pop(key, None)
    _purge_above[0] = max(_PURGE_FLOOR, 2 * len(_place))


def mark_device(t: torch.Tensor) -> torch.Tensor:
    """Tag `t`'s storage as device memory (what `.cuda()` would give)."""
    return _set(t, DEVICE)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among `values` and in their lists and tuples (a list, not a generator: this runs on every op)."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(x for x in v if isinstance(x, torch.Tensor))
    return found


def _has_tensor(values) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple))
                                           and any(isinstance(x, torch.Tensor) for x in v)):
            return True
    return False


def is_cuda_device(device) -> bool:
    """Whether a `device=` argument names a GPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare int as a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _describe(t: torch.Tensor, where: str) -> str:
    return f"{where} tensor {t.dtype} {tuple(t.shape)}"


class DeviceMixError(RuntimeError):
    """What CUDA or NCCL would have raised on a GPU."""


# -- the Python-level calls -------------------------------------------------------------------------

CUDA_TYPE_NAMES = {  # what the no-argument Tensor.type() of a GPU tensor says
    torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor", torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}
_NEW_TENSOR_FUNCS = {torch.tensor, torch.as_tensor}  # copy Python data: on the host unless told otherwise


def _backward_under(mode, func, args, kwargs):
    """torch.autograd.backward / Tensor.backward with `mode` on. torch (2.14) hands a backward to the torch function
    mode, which runs it with the mode off, so custom autograd Functions' backward would run without it: megatron-core's
    all-to-all and sequence-parallel backward allocate on torch.cuda.current_device() (a CUDA ordinal here), and its
    MoE router, seeing its weight on the host, would replace the weight's data with a copy the optimizer never
    updates. So the engine is called here, as torch.autograd.backward calls it, inside the mode."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    bound = inspect.signature(func).bind(*args, **kwargs).arguments
    tensors = bound.get("tensors", bound.get("self"))
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = bound.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    create = bound.get("create_graph", False)
    retain = bound.get("retain_graph")
    _in_engine.depth = getattr(_in_engine, "depth", 0) + 1
    try:
        with mode:
            grads = _tensor_or_tensors_to_tuple(bound.get("grad_tensors", bound.get("gradient")), len(tensors))
            _engine_run_backward(tensors, _make_grads(tensors, grads, is_grads_batched=False),
                                 create if retain is None else retain, create, inputs, allow_unreachable=True,
                                 accumulate_grad=True)
    finally:
        _in_engine.depth -= 1


def _engine_allocation(func) -> bool:
    """An aten factory called by the autograd engine itself (Python code calls torch.zeros, not the op): the zeros
    it makes for a gradient no node produced (an output of no elements, as an expert-parallel rank that received no
    token has), with the options of the forward tensor, so on a GPU on the GPU."""
    return getattr(_in_engine, "depth", 0) > 0 and isinstance(func, torch._ops.OpOverload)


def _getter(prop) -> object:
    return prop.__get__  # compared by ==: each access makes a new method-wrapper


class FaithfulFunctionMode(TorchFunctionMode):
    """Sends CUDA factories and moves to the CPU (as cpu_compat does) and records where each result lives."""

    def __init__(self):
        super().__init__()
        self._device_get = _getter(torch.Tensor.device)
        self._is_cuda_get = _getter(torch.Tensor.is_cuda)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == self._device_get:
            return local_device() if is_device(args[0]) else func(*args)
        if func == self._is_cuda_get:
            return is_device(args[0])
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func in (torch.autograd.backward, torch.Tensor.backward):
            return _backward_under(self, func, args, kwargs)
        device = kwargs.get("device")
        if device is not None:
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and (device is not None or func in _NEW_TENSOR_FUNCS
                                              or not _has_tensor(args)):
            inputs = {id(_storage(t)) for t in _tensors(args)}
            if id(_storage(out)) not in inputs:  # a new tensor: not a view of an input
                if device is not None:
                    _set(out, is_cuda_device(device) or _engine_allocation(func))
                elif place(out) is None:
                    _set(out, HOST)
        return out


def _type(func, args, kwargs):
    if len(args) == 1 and not kwargs:  # the optimizer checks `param.type() == "torch.cuda.FloatTensor"`
        t = args[0]
        return CUDA_TYPE_NAMES.get(t.dtype, func(t)) if is_device(t) else func(t)
    return func(*args, **kwargs)


def _get_device(func, args, kwargs):
    return local_device().index if is_device(args[0]) else func(*args, **kwargs)


def _numpy(func, args, kwargs):
    if is_device(args[0]):
        raise TypeError(f"can't convert {local_device()} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first. (device-faithful CPU mode)")
    return func(*args, **kwargs)


def _host_read(func, args, kwargs):
    where = current_region()
    if where is not None and is_device(args[0]):
        raise DeviceMixError(f"{func.__name__}() of a {_describe(args[0], 'device')} inside {where}, which must not "
                             "sync the GPU: keep the value on the device (device-faithful CPU mode)")
    return func(*args, **kwargs)


def _cuda(func, args, kwargs):
    t = args[0]
    return t if is_device(t) else mark_device(t.clone())


def _cpu(func, args, kwargs):
    t = args[0]
    return _set(t.clone(), HOST) if is_device(t) else t


def _identity(func, args, kwargs):
    return args[0]


def _is_device_arg(a) -> bool:
    return isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool))


def _to(func, args, kwargs):
    """`.to()`: a move to the other memory always copies (as from or to a GPU); a dtype change keeps the place."""
    t, rest = args[0], args[1:]
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's place and dtype
        other = rest[0]
        target = place(other)
        rest = (other.dtype, *rest[1:])
    else:
        device = torch._C._nn._parse_to(*rest, **kwargs)[0]
        target = None if device is None else (DEVICE if is_cuda_device(device) else HOST)
        rest = tuple("cpu" if _is_device_arg(a) else a for a in rest)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
    here = place(t)
    moving = target is not None and target != (HOST if here is None else here)
    out = func(t, *rest, **({**kwargs, "copy": True} if moving else kwargs))
    if out is not t and target is not None:
        _set(out, target)
    return out


def _type_as(func, args, kwargs):
    t, other = args[0], args[1]
    return _to(torch.Tensor.to, (t, other), {})


_HANDLERS = {
    torch.Tensor.type: _type,
    torch.Tensor.get_device: _get_device,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _numpy,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu,
    torch.Tensor.to: _to,
    torch.Tensor.type_as: _type_as,
    torch.Tensor.pin_memory: _identity,
    **{read: _host_read for read in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                                     torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__)},
}


# -- the ops -----------------------------------------------------------------------------------------

_aten = torch.ops.aten
# Ops CUDA runs across memories: copies (into an unknown tensor they give it the source's place) and
# pointing a tensor at other storage.
_COPIES = {_aten.copy_.default, _aten._copy_from.default, _aten._copy_from_and_resize.default}
_CROSS_DEVICE = {_aten._local_scalar_dense.default, _aten.set_.source_Storage,
                 _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor}
_SET_STORAGE = {_aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default, _aten._unsafe_index.Tensor, _aten._unsafe_index_put.default}
_NOT_CHECKED_COLLECTIVES = {"barrier", "monitored_barrier"}


def _group_name(script_object) -> str | None:
    try:
        return dist.ProcessGroup.unbox(script_object).group_name
    except RuntimeError:  # a ReduceOp or another custom class
        return None


_inplace: dict = {}


def _is_inplace(func) -> bool:
    """Whether the op writes its first argument."""
    known = _inplace.get(func)
    if known is None:
        args = func._schema.arguments
        known = _inplace[func] = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return known


class DeviceCheckMode(TorchDispatchMode):
    """Refuses ops that mix device and host tensors, and host tensors in collectives of NCCL groups."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._check_collective(func, args)
            return func(*args, **kwargs)
        if func in _COPIES:
            if place(args[0]) is None and isinstance(args[1], torch.Tensor) and place(args[1]) is not None:
                _set(args[0], place(args[1]))
            return func(*args, **kwargs)
        if func in _CROSS_DEVICE:
            before = place(args[0]) if func in _SET_STORAGE else None
            out = func(*args, **kwargs)
            if before is not None and place(args[0]) is None:  # a storage of no place (unpickled) takes the
                _set(args[0], before)  # tensor's: torch.load and pickle make it a host tensor, then set it there
            return out
        tensors = _tensors(args) + _tensors(kwargs.values()) if kwargs else _tensors(args)
        if not tensors:
            return func(*args, **kwargs)
        places = [place(t) for t in tensors]
        on_device = DEVICE in places
        if on_device and HOST in places:
            self._check_mix(func, args, tensors, places)
        out = func(*args, **kwargs)
        if on_device:
            for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
                _set(t, DEVICE)
            if _is_inplace(func):  # unknown tensors written with device data are device memory
                for t in _tensors(args[:1]):
                    if place(t) is None:
                        _set(t, DEVICE)
        elif HOST in places:
            for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
                if place(t) is None:
                    _set(t, HOST)
        return out

    @staticmethod
    def _check_mix(func, args, tensors, places):
        if func in _INDEXING and place(args[0]) is DEVICE:  # CUDA takes host index tensors; the rest: device
            index_ids = {id(t) for t in _tensors(args[1:2])}
            tensors, places = zip(*[(t, p) for t, p in zip(tensors, places) if id(t) not in index_ids])
        # An empty tensor holds no memory to be wrong about: its tag follows whatever storage torch gave it (an
        # expert that received no token has empty slices, whose gradients' tags are this mode's guess, not CUDA's).
        mixed = [t for t, p in zip(tensors, places)
                 if p is HOST and t.numel() > 0 and (t.dim() > 0 or _is_first_written(func, t, args))]
        if DEVICE in places and mixed:
            device = next(t for t, p in zip(tensors, places) if p is DEVICE)
            raise DeviceMixError(
                f"Expected all tensors to be on the same device, but found at least two devices, {local_device()} "
                f"and cpu! ({func}: {_describe(device, 'device')} with {_describe(mixed[0], 'host')}; "
                "device-faithful CPU mode: move the host tensor with .to(device) or make it on the device)")

    @staticmethod
    def _check_collective(func, args):
        if func._opname in _NOT_CHECKED_COLLECTIVES:  # no data: NCCL's barrier makes its own device tensor
            return
        groups = [g for g in (_group_name(a) for a in args if isinstance(a, torch.ScriptObject)) if g is not None]
        if not groups:
            return
        if groups[0] in _host_groups:  # gloo on GPUs too: what it reads and fills is host memory
            for t in _tensors(args):
                if place(t) is None:
                    _set(t, HOST)
            return
        host = [t for t in _tensors(args) if place(t) is HOST]
        if host:
            raise DeviceMixError(
                f"NCCL error: {func} on process group {groups[0]!r} got a {_describe(host[0], 'host')}; NCCL "
                "communicates device memory only (device-faithful CPU mode: this group runs NCCL on GPUs; put "
                "the tensor on the rank's device, or use a gloo group for host tensors)")


def _is_first_written(func, t, args) -> bool:
    """A 0-dim host tensor may be read by a CUDA op, not written by one."""
    return _is_inplace(func) and any(w is t for w in _tensors(args[:1]))


# -- installing ------------------------------------------------------------------------------------------


def _record_new_group(new_group):
    def wrapped(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER) and backend is not None and "gloo" in str(backend):
            _host_groups.add(group.group_name)
        return group
    return wrapped


def _object_coll_device(original):
    def device_for(group=None):
        group = group or dist.distributed_c10d._get_default_group()
        return "cpu" if group.group_name in _host_groups else "cuda"
    return device_for


class _DeviceGenerator(torch.Generator):
    """torch.Generator(device="cuda") for the CPU: a host generator (the tensors it fills are host memory)."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu" if is_cuda_device(device) else device)


def _host_factory(factory):
    """A factory that torch's modes do not see (it takes no tensor): what it makes is host memory."""
    def made(*args, **kwargs):
        return _set(factory(*args, **kwargs), HOST)
    return made


class DeviceFaithful:
    """Installs the modes and patches on enter; restores everything on exit."""

    def __init__(self, local_rank: int = 0):
        self._saved: list[tuple[object, str, object]] = []
        self._modes: list = []
        self.local_rank = local_rank

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> DeviceFaithful:
        _local[0] = self.local_rank
        c10d = dist.distributed_c10d
        self._patch(dist, "new_group", _record_new_group(dist.new_group))
        self._patch(c10d, "new_group", dist.new_group)
        self._patch(c10d, "_get_object_coll_device", _object_coll_device(c10d._get_object_coll_device))
        self._patch(torch, "Generator", _DeviceGenerator)
        self._patch(torch.cuda, "current_device", lambda: local_device().index)
        for name in ("from_numpy", "frombuffer"):
            self._patch(torch, name, _host_factory(getattr(torch, name)))
        self._modes = [FaithfulFunctionMode(), DeviceCheckMode()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)
