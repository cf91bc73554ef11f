"""megatron-core's distributed checkpoint files (dist_checkpointing, torch_dist), written from Hugging
Face tensors and read back one tensor at a time, without building the model.

dist_checkpointing saves and loads through the model: each rank holds its whole pipeline stage. The
converter streams instead. The writer hands torch.distributed.checkpoint a plan of every stored chunk
and computes each chunk only when the storage layer asks for it, caching just the one full Megatron
tensor whose tensor-parallel chunks are being written. The reader fetches one layer's slice of a
stored tensor at a time. The files are what dist_checkpointing.save writes at the same TP (same keys,
global shapes, chunks and dtypes; tests/test_convert_checkpoint.py compares them), so megatron-core
loads them at any layout. How megatron-core lays the model out:
- a dense model's layer tensors are stacked over all pipeline stages: key `decoder.layers.<suffix>`,
  global shape [num_layers, ...], one chunk per layer and tensor-parallel rank (so pipeline stages
  do not change the files, only which rank writes what);
- a mixture of experts' layers are stored one key per layer, `decoder.layers.<i>.<suffix>` with no
  layer axis (megatron-core's TransformerBlock stores so any model built with a per-layer
  moe_layer_freq, as policy/model.py builds one); each of its experts' linears is one key for all experts,
  `decoder.layers.<i>.mlp.experts.experts.linear_fc1.weight` of global shape [num_experts, ...],
  one chunk set per expert at its global index (experts are never split over TP: expert
  parallelism, like pipeline stages, changes only which rank writes what);
- the local spec's layer norms are stored under Transformer Engine's names and in fp32, as
  megatron-core's local spec keeps them (the pre-MLP norm of a layer with experts too; Transformer
  Engine's spec keeps that one as `pre_mlp_layernorm.weight`, which the reader also takes);
- each linear layer carries an `_extra_state` object per layer and expert (None outside Transformer
  Engine), keyed by its position along the stacked axis (`/shard_<i>_<n>`, `/shard_0_1` with none);
- fc1 is [gate; up] over the whole ffn width: each rank's chunk of both halves is stored apart (an
  expert's two halves too, whole);
- word embeddings and output layer have the vocabulary padded for the saving TP; loading at another
  TP pads or cuts it (megatron-core allows that shape mismatch for them).
"""

from __future__ import annotations

import io
import json
import re
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron_dapo.checkpoint.hf_mapping import (
    TE_FUSED_NORMS,
    expert_of,
    kept_dtype,
    megatron_names,
    megatron_shard,
    megatron_shape,
    tp_dim,
)
from megatron_dapo.checkpoint.safetensors_io import CheckpointError
from megatron_dapo.policy.hf_config import ModelSpec

# Written beside the tensors by dist_checkpointing.save; its loader checks them.
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
BACKEND_FILE, COMMON_FILE = "metadata.json", "common.pt"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LINEAR_WEIGHT = re.compile(r"\.linear_\w+\.weight$")


@contextmanager
def _single_process():
    """Silence torch's notice that it saves or loads in one process, which is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass(frozen=True)
class Stored:
    """Where megatron-core keeps a Megatron tensor: under `key`, at `index` along the key's leading stacked axes
    (layers, or experts) of sizes `stack`; both empty when the key holds the tensor alone."""

    key: str
    index: tuple[int, ...] = ()
    stack: tuple[int, ...] = ()


def layer_of(mname: str) -> int | None:
    match = _LAYER.match(mname)
    return None if match is None else int(match.group(1))


def stored(mname: str, spec: ModelSpec) -> Stored:
    """Where megatron-core stores Megatron tensor `mname` (global layer and expert numbering) of the model."""
    match = _LAYER.match(mname)
    if match is None:
        return Stored(mname)
    layer, suffix = int(match.group(1)), match.group(2)
    # megatron-core stores the local spec's norms under Transformer Engine's names.
    suffix = TE_FUSED_NORMS.get(suffix, suffix)
    if not spec.is_moe:
        return Stored(f"decoder.layers.{suffix}", (layer,), (spec.num_layers,))
    expert = expert_of(mname)
    if expert is None:
        return Stored(f"decoder.layers.{layer}.{suffix}")
    j, linear = expert
    return Stored(f"decoder.layers.{layer}.mlp.experts.experts.{linear}.weight", (j,), (spec.num_experts,))


def stored_dtype(mname: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if "layernorm" in mname else kept_dtype(mname, dtype)


def _tp_chunks(mname: str, shape: tuple[int, ...], tp: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each tensor-parallel rank's part of the full tensor, in rank order."""
    dim = tp_dim(mname)
    if mname.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds a slice of both halves
        ranks = 1 if dim is None else tp  # an expert's fc1 is whole, its halves still stored apart
        half = shape[0] // 2
        step = half // ranks
        return [((base + r * step, 0), (step, shape[1])) for r in range(ranks) for base in (0, half)]
    if dim is None:
        return [((0,) * len(shape), shape)]
    step = shape[dim] // tp
    chunks = []
    for r in range(tp):
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[dim], sizes[dim] = r * step, step
        chunks.append((tuple(offsets), tuple(sizes)))
    return chunks


@dataclass(frozen=True)
class _Chunk:
    mname: str
    offsets: tuple[int, ...]  # within the full Megatron tensor (no layer axis)
    sizes: tuple[int, ...]
    dtype: torch.dtype


def _extra_state_keys(spec: ModelSpec) -> list[str]:
    """The `_extra_state` object of every linear layer (and expert), keyed by its place along the stacked axis."""
    keys = []
    for mname in megatron_names(spec):
        if _LINEAR_WEIGHT.search(mname):
            at = stored(mname, spec)
            offsets, sizes = ".".join(map(str, at.index)) or "0", ".".join(map(str, at.stack)) or "1"
            keys.append(f"{at.key.removesuffix('.weight')}._extra_state/shard_{offsets}_{sizes}")
    return keys


class _StreamingSavePlanner(SavePlanner):
    """Plans every chunk up front, resolves each only when the storage layer writes it."""

    def __init__(self, spec: ModelSpec, get: Callable[[str], torch.Tensor], *, tp: int, padded_vocab: int,
                 dtype: torch.dtype, on_tensor: Callable[[str], None]):
        self.spec, self.get, self.padded_vocab, self.on_tensor = spec, get, padded_vocab, on_tensor
        self.chunks: dict[MetadataIndex, _Chunk] = {}
        self.items: list[WriteItem] = []
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for key in _extra_state_keys(spec):
            self.items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            md[key] = BytesStorageMetadata()
        for mname in megatron_names(spec):
            at = stored(mname, spec)
            shape = megatron_shape(mname, spec, padded_vocab)
            props = TensorProperties(dtype=stored_dtype(mname, dtype))
            size = torch.Size((*at.stack, *shape))
            entry = md.setdefault(at.key, TensorStorageMetadata(properties=props, size=size, chunks=[]))
            for offsets, sizes in _tp_chunks(mname, shape, tp):
                offsets, sizes = (*at.index, *offsets), (*(1,) * len(at.index), *sizes)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                index = MetadataIndex(at.key, chunk.offsets)
                entry.chunks.append(chunk)
                self.chunks[index] = _Chunk(mname, offsets[-len(shape):], sizes[-len(shape):], props.dtype)
                self.items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                            tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size)))
        self.metadata = Metadata(state_dict_metadata=md)
        self._cached: tuple[str, torch.Tensor] | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.metadata.storage_meta = storage_meta

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return all_plans, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)  # dist_checkpointing stores a list of the objects' data
            return buf
        chunk = self.chunks[write_item.index]
        if self._cached is None or self._cached[0] != chunk.mname:
            self._cached = None  # drop the previous tensor before building the next
            full = megatron_shard(chunk.mname, self.get, self.spec, tp_rank=0, tp_size=1,
                                  padded_vocab_size=self.padded_vocab)
            self._cached = (chunk.mname, full.to(chunk.dtype))
            self.on_tensor(chunk.mname)
        part = self._cached[1]
        for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            part = part.narrow(dim, offset, size)
        return part.reshape(write_item.tensor_data.chunk.sizes)


def write_mcore_checkpoint(directory, get: Callable[[str], torch.Tensor], spec: ModelSpec, *, tp: int,
                           padded_vocab: int, dtype: torch.dtype,
                           on_tensor: Callable[[str], None] = lambda _: None) -> None:
    """Write the model, whose HF tensors `get(name)` returns, into the (existing, empty) `directory` as
    dist_checkpointing.save does at tensor-parallel size `tp`. `on_tensor(mname)`: progress."""
    directory = Path(directory)
    planner = _StreamingSavePlanner(spec, get, tp=tp, padded_vocab=padded_vocab, dtype=dtype, on_tensor=on_tensor)
    # One writer thread: chunks are resolved in plan order, so each full tensor is built once.
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1)
    with _single_process():
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    torch.save({}, directory / COMMON_FILE)  # the model has no state outside its sharded tensors
    (directory / BACKEND_FILE).write_text(json.dumps(BACKEND))


class _RegionLoadPlanner(LoadPlanner):
    """Reads given regions of stored tensors into given buffers."""

    def __init__(self, regions: dict[str, tuple[str, tuple[int, ...], torch.Tensor]]):
        self.regions = regions  # name -> (stored key, offsets in the stored tensor, buffer of the region's size)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for name, (key, offsets, out) in self.regions.items():
            covered = 0
            for chunk in self.metadata.state_dict_metadata[key].chunks:
                lo = [max(c, o) for c, o in zip(chunk.offsets, offsets)]
                hi = [min(c + s, o + n) for c, s, o, n in zip(chunk.offsets, chunk.sizes, offsets, out.shape)]
                if any(h <= low for h, low in zip(hi, lo)):
                    continue
                lengths = torch.Size(h - low for h, low in zip(hi, lo))
                covered += lengths.numel()
                items.append(ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(name), dest_offsets=torch.Size(a - o for a, o in zip(lo, offsets)),
                    storage_index=MetadataIndex(key, chunk.offsets),
                    storage_offsets=torch.Size(a - c for a, c in zip(lo, chunk.offsets)), lengths=lengths))
            if covered != out.numel():
                raise CheckpointError(f"{key}: the stored chunks cover {covered} of the {out.numel()} elements "
                                      f"asked for at offsets {offsets} (incomplete checkpoint?)")
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("only tensors are read")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.regions[read_item.dest_index.fqn][2]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, offset, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the buffer: the data is already there


class McoreCheckpointReader:
    """A dist_checkpointing torch_dist folder of the model `spec` (converted, or saved by the trainer at any
    layout), read one Megatron tensor at a time."""

    def __init__(self, directory, spec: ModelSpec):
        self.path, self.spec = Path(directory), spec
        if not (self.path / ".metadata").is_file():
            raise CheckpointError(f"{self.path}: no .metadata; not a megatron-core distributed checkpoint "
                                  "(dist_checkpointing, torch_dist format)")
        self._reader = dcp.FileSystemReader(str(self.path))
        self.metadata = self._reader.read_metadata()
        sizes: dict[str, int] = {}
        for index, info in self.metadata.storage_data.items():
            file = self.path / info.relative_path
            if info.relative_path not in sizes:
                if not file.is_file():
                    raise CheckpointError(f"{self.path}: .metadata lists {info.relative_path}, which is missing")
                sizes[info.relative_path] = file.stat().st_size
            if info.offset + info.length > sizes[info.relative_path]:
                raise CheckpointError(f"{file}: {index.fqn} needs bytes up to {info.offset + info.length} but the "
                                      f"file has {sizes[info.relative_path]} (truncated?)")

    def _stored(self, mname: str) -> Stored:
        at = stored(mname, self.spec)
        md = self.metadata.state_dict_metadata
        te_norm = f"decoder.layers.{layer_of(mname)}.pre_mlp_layernorm.weight"
        if at.key not in md and mname.endswith(".pre_mlp_layernorm.weight") and te_norm in md:
            return Stored(te_norm)  # a layer with experts, saved with Transformer Engine's spec
        return at

    def validate(self) -> None:
        """Every tensor of the model is there with the shape config.json implies."""
        md, spec = self.metadata.state_dict_metadata, self.spec
        for mname in megatron_names(spec):
            at = self._stored(mname)
            entry = md.get(at.key)
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: no tensor {at.key!r}; is config.json the model this checkpoint "
                                      "holds (pass --hf-config with its Hugging Face folder)?")
            shape = megatron_shape(mname, spec, 0)
            want = (*at.stack, *shape)
            got = tuple(entry.size)
            vocab_rows = mname in ("embedding.word_embeddings.weight", "output_layer.weight")
            fits = (got[1:] == want[1:] and got[0] >= spec.vocab_size) if vocab_rows else got == want
            if not fits:
                expected = f"({spec.vocab_size} or more padded rows, {want[1]})" if vocab_rows else str(want)
                raise CheckpointError(f"{self.path}: {at.key} has shape {got} but config.json implies {expected}; is "
                                      "config.json the model this checkpoint holds?")

    def read(self, mnames: Iterable[str]) -> dict[str, torch.Tensor]:
        """The full Megatron tensors `mnames` (a layer's tensors: one slice of each stacked tensor)."""
        where = {mname: self._stored(mname) for mname in mnames}
        regions = {}
        for mname, at in where.items():
            entry = self.metadata.state_dict_metadata[at.key]
            size = (*(1,) * len(at.index), *entry.size[len(at.index):])
            offsets = (*at.index, *(0,) * (len(size) - len(at.index)))
            regions[mname] = (at.key, offsets, torch.empty(size, dtype=entry.properties.dtype))
        if regions:
            with _single_process():
                dcp.load({}, storage_reader=self._reader, planner=_RegionLoadPlanner(regions), no_dist=True)
        return {m: out.reshape(out.shape[len(where[m].index):]) for m, (_, _, out) in regions.items()}
