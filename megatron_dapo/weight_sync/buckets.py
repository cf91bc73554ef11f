"""Group the model's full Hugging Face tensors into buckets of a bounded size, for the push routes.

A bucket is one flat byte buffer holding its tensors back to back in iteration order, which is the
layout SGLang's `flattened_bucket` format rebuilds on the other side. The buffer is allocated once and
refilled for every bucket, so the extra memory on a receiving rank is one bucket (plus the tensor in
flight from the gather). A tensor larger than a bucket travels alone, in a buffer of its own size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.hf_export import iter_hf_tensors
from megatron_dapo.checkpoint.hf_mapping import hf_names, hf_shape, megatron_names
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec

Allocator = Callable[[int, torch.device], torch.Tensor]  # (nbytes, device) -> uint8 buffer


def plain_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@dataclass
class Bucket:
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    flat: torch.Tensor  # uint8, exactly the bucket's bytes
    last: bool  # the final bucket of this sync

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into `flat`, no copies."""
        out, offset = [], 0
        itemsize = self.dtype.itemsize
        for name, shape in zip(self.names, self.shapes):
            size = itemsize * torch.Size(shape).numel()
            out.append((name, self.flat[offset: offset + size].view(self.dtype).view(shape)))
            offset += size
        return out


def bucket_bytes_from_mb(bucket_mb: float) -> int:
    if not bucket_mb > 0:
        raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0, got {bucket_mb}; 512 is a good default")
    return int(bucket_mb * 2**20)


def model_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """The size of all the model's HF tensors in `dtype`."""
    elements = sum(torch.Size(hf_shape(n, spec)).numel() for m in megatron_names(spec) for n in hf_names(m, spec))
    return elements * dtype.itemsize


def iter_hf_buckets(model: torch.nn.Module, spec: ModelSpec, parallel: ParallelConfig, bucket_bytes: int,
                    allocate: Allocator = plain_buffer, receivers: Sequence[int] = (0,)) -> Iterator[Bucket]:
    """On each global rank in `receivers`: the model's HF tensors in buckets of at most `bucket_bytes` (a
    bigger tensor alone), in buffers from `allocate`. Elsewhere: nothing. Collective: every rank must
    iterate to the end, and a receiver must be done with a bucket before asking for the next one (its
    buffer is reused)."""
    tensors = iter_hf_tensors(model, spec, parallel, receivers)
    if dist.get_rank() not in receivers:
        for _ in tensors:
            pass
        return
    buffer: torch.Tensor | None = None
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    dtype: torch.dtype | None = None
    used = 0
    oversized: Bucket | None = None  # held back until we know whether anything follows it
    for name, tensor in tensors:
        if oversized is not None:
            yield oversized
            oversized = None
        size = tensor.numel() * tensor.element_size()
        if names and (used + size > bucket_bytes or tensor.dtype != dtype):
            yield Bucket(names, shapes, dtype, buffer[:used], last=False)
            names, shapes, used = [], [], 0
        if size > bucket_bytes:  # copied too: the tensor may be a parameter's own storage
            flat = allocate(size, tensor.device)
            flat.view(tensor.dtype).view(tensor.shape).copy_(tensor)
            oversized = Bucket([name], [tuple(tensor.shape)], tensor.dtype, flat, last=False)
            continue
        if buffer is None:  # no bigger than the whole model: a small model gets a small buffer
            buffer = allocate(min(bucket_bytes, model_bytes(spec, tensor.dtype)), tensor.device)
        buffer[used: used + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        names.append(name)
        shapes.append(tuple(tensor.shape))
        dtype = tensor.dtype
        used += size
    if oversized is not None:  # then nothing followed it
        oversized.last = True
        yield oversized
    if names:
        yield Bucket(names, shapes, dtype, buffer[:used], last=True)
