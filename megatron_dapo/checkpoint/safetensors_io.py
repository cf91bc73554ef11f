"""Hugging Face checkpoints on disk: a validating, lazy safetensors reader and an atomic, streaming writer.

Reading checks every file's header against its size (a truncated download is refused before any
tensor is read), that the index and the files agree, and that every tensor is one the architecture
has, with the shape config.json implies. Tensors are then read one at a time, on demand, with plain
reads rather than a memory map, so the bytes of tensors already used do not stay resident.

Writing fills shards up to a size limit and holds at most one shard in memory; everything goes to a
temporary folder beside the output, renamed into place only once complete, so a crash never leaves a
checkpoint that looks whole.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_dapo.checkpoint.atomic_output import atomic_output
from megatron_dapo.checkpoint.hf_mapping import (
    HF_DERIVED_SUFFIXES,
    HF_EMBEDDING,
    HF_OUTPUT,
    MappingError,
    expected_hf_names,
    hf_shape,
    mtp_layer,
)
from megatron_dapo.errors import DapoError
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.user_files import json_field, read_json

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files besides the weights that make a checkpoint usable by transformers and SGLang.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")


# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(DapoError, ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the file or tensor."""


def _read_header(path: Path) -> tuple[dict, int]:
    """The file's tensor entries, and where its data section starts."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: header of {n} bytes runs past the end of the {size}-byte file (truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: tensors need {8 + n + end} bytes but the file has {size} (truncated?)")
    for tensor, info in header.items():
        if info.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {tensor!r} has dtype {info.get('dtype')!r}, which this reader "
                                  f"does not know ({', '.join(_DTYPES)})")
    return header, 8 + n


class HFCheckpoint:
    """A Hugging Face checkpoint folder (config.json + model.safetensors or sharded with an index)."""

    def __init__(self, path):
        self.path = Path(path)
        config = self.path / "config.json"
        if not config.is_file():
            raise CheckpointError(f"{self.path}: no config.json")
        self.config = read_json(config, error=CheckpointError)
        if (self.path / INDEX).is_file():
            index = read_json(self.path / INDEX, error=CheckpointError)
            weight_map = json_field(index, "weight_map", dict, self.path / INDEX, CheckpointError)
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX} nor {SINGLE}")
        self._file_of: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[torch.dtype, int, int]] = {}  # dtype, first byte, byte count
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{self.path / INDEX} lists {name}, which is missing")
            header, data_start = _read_header(file)
            for tensor, info in header.items():
                self._file_of[tensor] = name
                self._shape[tensor] = tuple(info["shape"])
                begin, end = info["data_offsets"]
                self._where[tensor] = (_DTYPES[info["dtype"]], data_start + begin, end - begin)
        if weight_map is not None:
            for tensor, name in weight_map.items():
                if self._file_of.get(tensor) != name:
                    raise CheckpointError(f"{self.path / INDEX}: {tensor} is listed in {name} but is not there")

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise MappingError(f"{self.path}: no tensor {name!r} in the checkpoint")
        dtype, start, nbytes = self._where[name]
        data = torch.empty(nbytes, dtype=torch.uint8)
        with (self.path / self._file_of[name]).open("rb", buffering=0) as f:
            f.seek(start)
            if f.readinto(memoryview(data.numpy())) != nbytes:
                raise CheckpointError(f"{self.path / self._file_of[name]}: ended inside tensor {name!r} (truncated?)")
        return data.view(dtype).reshape(self._shape[name])

    def validate(self, spec: ModelSpec) -> None:
        """Every expected tensor is there with the shape config.json implies, and nothing else is."""
        expected = expected_hf_names(spec)
        for name in self.names():
            if name in expected or name.endswith(HF_DERIVED_SUFFIXES) or mtp_layer(name, spec):
                continue
            if name == HF_OUTPUT and spec.tie_word_embeddings:
                if not torch.equal(self.get(name), self.get(HF_EMBEDDING)):
                    raise CheckpointError(f"{self.path}: tie_word_embeddings is true but {HF_OUTPUT} differs from "
                                          f"{HF_EMBEDDING}")
                continue
            raise MappingError(f"{self.path}: tensor {name!r} is not part of a {spec.architecture} with this "
                               "config.json (unknown name, or more layers than num_hidden_layers)")
        for name in sorted(expected):
            if name not in self._shape:
                raise MappingError(f"{self.path}: tensor {name!r} is missing")
            if self._shape[name] != hf_shape(name, spec):
                raise MappingError(f"{self.path}: {name} has shape {self._shape[name]} but config.json implies "
                                   f"{hf_shape(name, spec)}")
        for name in self.names():
            if name.endswith(HF_DERIVED_SUFFIXES):
                log.warning("%s: ignoring %s, which the config's rotary settings define", self.path, name)
        if spec.mtp_layers and any(mtp_layer(n, spec) for n in self.names()):
            log.warning("%s: leaving out its %d multi-token prediction layer(s) (model.layers.%d on, "
                        "num_nextn_predict_layers): they are not trained, and exports do not hold them (SGLang "
                        "serves without speculative MTP from them)", self.path, spec.mtp_layers, spec.num_layers)


def holds_checkpoint(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("config.json", INDEX, SINGLE, "metadata.json"))


def write_hf_checkpoint(out_dir, tensors: Iterable[tuple[str, torch.Tensor]], *, config: dict,
                        side_files_from=None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write `tensors` (name, tensor), in order, as safetensors shards + index + config.json, atomically. A tensor
    holding a NaN or an inf is refused by name, and nothing is left behind: a Hugging Face folder of broken weights
    would load and sample garbage without a word."""
    out = Path(out_dir)
    if holds_checkpoint(out):
        raise CheckpointError(f"{out}: already holds a checkpoint; choose a new output folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new output folder")
    with atomic_output(out) as tmp:
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, files, weight_map, total = 0, [], {}, 0

        def flush():
            nonlocal shard, shard_bytes
            name = f"shard-{len(files):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append((name, list(shard)))
            shard, shard_bytes = {}, 0

        for name, tensor in tensors:
            if name in weight_map or name in shard:
                raise CheckpointError(f"tensor {name!r} written twice")
            if tensor.is_floating_point() and not torch.isfinite(tensor.sum(dtype=torch.float32)):
                raise CheckpointError(f"{out}: not written: tensor {name!r} holds NaN or inf values; export a "
                                      "checkpoint from before the weights went non-finite")
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor.detach().contiguous().cpu()
            shard_bytes += nbytes
            total += nbytes
            weight_map[name] = None
        if shard:
            flush()
        for i, (name, names) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            (tmp / name).rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if side_files_from is not None:
            for name in SIDE_FILES:
                src = Path(side_files_from) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
    return out
