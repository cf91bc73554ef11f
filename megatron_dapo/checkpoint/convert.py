"""Convert checkpoints between Hugging Face and megatron-core's distributed format.

    hf-to-mcore --input HF_DIR --output DIR --tp N --pp M [--ep E]
    mcore-to-hf --input DIR --output HF_DIR [--hf-config HF_DIR]

mcore-to-hf also reads a trainer checkpoint's model: --input OUT/checkpoints/step_000040/model.

Both directions stream in one process (checkpoint/mcore_stream.py): about one full tensor in memory
while writing the distributed checkpoint, one layer's tensors plus one output shard while writing
Hugging Face files. megatron-core loads the result at any TP x EP x PP; TP sets the vocabulary padding
and the chunks, PP and EP (a mixture of experts' expert parallelism) only what is recorded. Everything
is checked before anything is written (input readable and complete, every tensor known and of the
right shape, sizes divisible, output folder free), and output goes to a temporary folder renamed into
place only when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import shutil
import sys
from pathlib import Path

import torch

from megatron_dapo.checkpoint.atomic_output import atomic_output
from megatron_dapo.checkpoint.hf_mapping import (
    HF_EMBEDDING,
    HF_FINAL_NORM,
    hf_names,
    hf_tensors,
    megatron_names,
)
from megatron_dapo.checkpoint.mcore_checkpoint import HF_SUBDIR, read_meta, write_meta
from megatron_dapo.checkpoint.mcore_stream import McoreCheckpointReader, layer_of, write_mcore_checkpoint
from megatron_dapo.checkpoint.safetensors_io import (
    SIDE_FILES,
    CheckpointError,
    HFCheckpoint,
    holds_checkpoint,
    write_hf_checkpoint,
)
from megatron_dapo.checkpoint.trainer_checkpoint import MODEL_DIR, STATE_FILE, complete_checkpoints
from megatron_dapo.config import ParallelConfig
from megatron_dapo.errors import DapoError
from megatron_dapo.policy.hf_config import ModelSpec, model_spec_from_hf, spec_differences
from megatron_dapo.policy.model import check_divisibility, padded_vocab_size
from megatron_dapo.user_files import json_field, read_json

log = logging.getLogger(__name__)


def _check_output(out: Path) -> None:
    if holds_checkpoint(out):
        raise CheckpointError(f"{out}: already holds a checkpoint; choose a new output folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new output folder")


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)


def _checkpoint_dtype(ckpt: HFCheckpoint) -> torch.dtype:
    dtypes = {ckpt.get(n).dtype for n in (HF_EMBEDDING, HF_FINAL_NORM)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{ckpt.path}: tensors of mixed dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def hf_to_mcore(input_dir, output_dir, *, tp: int, pp: int, ep: int = 1) -> Path:
    """Hugging Face folder -> megatron-core distributed checkpoint, as saved at TP=tp x EP=ep x PP=pp."""
    out = Path(output_dir)
    _check_output(out)
    ckpt = HFCheckpoint(input_dir)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    # Sequence parallelism, which a mixture of experts trains with at TP > 1, changes no stored tensor.
    check_divisibility(spec, ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp,
                                            sequence_parallel=spec.is_moe and tp > 1, device="cpu"))
    dtype = _checkpoint_dtype(ckpt)
    with atomic_output(out) as tmp:
        bar = _progress(len(megatron_names(spec)), "hf -> mcore")
        write_mcore_checkpoint(tmp, ckpt.get, spec, tp=tp, padded_vocab=padded_vocab_size(spec.vocab_size, tp),
                               dtype=dtype, on_tensor=lambda _: bar.update(1))
        bar.close()
        write_meta(tmp, tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, dtype=dtype)
        (tmp / HF_SUBDIR).mkdir()
        for name in ("config.json", *SIDE_FILES):
            if (ckpt.path / name).is_file():
                shutil.copy2(ckpt.path / name, tmp / HF_SUBDIR / name)
    return out


def _read_groups(spec: ModelSpec) -> list[list[str]]:
    """The model's Megatron tensors in the groups they are read in: each layer's together."""
    return [list(g) for _, g in itertools.groupby(megatron_names(spec), key=layer_of)]


def _hf_tensors(reader: McoreCheckpointReader, spec: ModelSpec, dtype: torch.dtype, bar):
    for group in _read_groups(spec):
        for mname, full in reader.read(group).items():
            for name, tensor in hf_tensors(mname, [full], spec).items():
                yield name, tensor.to(dtype)  # norms are stored in fp32 whatever the model's dtype
            bar.update(len(hf_names(mname, spec)))


def _recorded_spec(input_dir: Path) -> tuple[dict, Path] | None:
    """The model the checkpoint records it was saved from, and where: a converted checkpoint's own hf/config.json,
    or a trainer checkpoint's trainer_state.json beside its model/ folder; None when it has neither."""
    own = input_dir / HF_SUBDIR / "config.json"
    if own.is_file():
        return dataclasses.asdict(model_spec_from_hf(own)), own
    state = input_dir.parent / STATE_FILE
    if input_dir.name == MODEL_DIR and state.is_file():
        return json_field(read_json(state, error=CheckpointError), "model", dict, state, CheckpointError), state
    return None


def _check_config_matches(input_dir: Path, spec: ModelSpec, hf_dir: Path) -> None:
    """--hf-config's model against the checkpoint's own record: a model of the same shapes with other values
    (rope_theta, rms_norm_eps, max_position_embeddings) would convert without a word into a model that computes
    something else."""
    record = _recorded_spec(input_dir)
    if record is None:
        log.warning("%s: no record of the model it was saved from (hf/config.json, trainer_state.json): --hf-config "
                    "%s taken as it is", input_dir, hf_dir)
        return
    diffs = spec_differences(record[0], spec, "--hf-config")
    if diffs:
        raise CheckpointError(f"--hf-config {hf_dir}: not the model the checkpoint was saved from ({record[1]}): "
                              f"{', '.join(diffs)}; leave --hf-config out to use the checkpoint's own, or pass "
                              "--allow-config-mismatch to write this config.json anyway")


def mcore_to_hf(input_dir, output_dir, *, hf_config=None, allow_config_mismatch: bool = False,
                max_shard_bytes: int = 5 * 2**30) -> Path:
    """megatron-core distributed checkpoint -> Hugging Face folder (safetensors shards, index, config). A
    `hf_config` folder whose model differs from the checkpoint's own record is refused, unless
    `allow_config_mismatch`."""
    out = Path(output_dir)
    _check_output(out)
    meta = read_meta(input_dir)
    hf_dir = Path(hf_config) if hf_config else Path(input_dir) / HF_SUBDIR
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir}: no config.json; pass --hf-config with the model's Hugging Face folder")
    config = read_json(hf_dir / "config.json", error=CheckpointError)
    spec = model_spec_from_hf(config)
    reader = McoreCheckpointReader(input_dir, spec)
    reader.validate()
    if hf_config and not allow_config_mismatch:
        _check_config_matches(Path(input_dir), spec, hf_dir)
    bar = _progress(sum(len(hf_names(m, spec)) for m in megatron_names(spec)), "mcore -> hf")
    write_hf_checkpoint(out, _hf_tensors(reader, spec, meta["dtype"], bar), config=config, side_files_from=hf_dir,
                        max_shard_bytes=max_shard_bytes)
    bar.close()
    return out


def _checkpoints_near(path: Path) -> str:
    """The trainer checkpoints in the checkpoints folder that the nearest existing parent of `path` is, holds,
    or is inside of (a step folder), or where none was found: a step folder's name (step_000040, not step_40)
    or a run's path is the likely mistake."""
    base = next(p for p in path.parents if p.is_dir())
    for folder in (base, base / "checkpoints", base.parent):
        if folder.name == "checkpoints" and folder.is_dir():
            found = complete_checkpoints(folder)
            if not found:
                return f"no complete checkpoints in {folder}"
            return f"checkpoints in {folder}: {', '.join(p.name for p in found)}"
    return f"no checkpoints folder in {base.absolute()}"  # absolute: "in ." would say little


def _check_exists(flag: str, path: str, *, trainer_checkpoint: bool = False) -> None:
    if not Path(path).exists():
        hint = f"; {_checkpoints_near(Path(path))}" if trainer_checkpoint else ""
        raise CheckpointError(f"{flag} {path} does not exist{hint}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face folder -> megatron-core distributed checkpoint")
    a.add_argument("--input", required=True, help="Hugging Face folder (config.json + safetensors)")
    a.add_argument("--output", required=True, help="new folder for the distributed checkpoint")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at (loads at any)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at (loads at any)")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size of a mixture of experts to save at "
                   "(loads at any)")
    b = sub.add_parser("mcore-to-hf", help="megatron-core distributed checkpoint -> Hugging Face folder")
    b.add_argument("--input", required=True, help="distributed checkpoint folder: a converted one, or a trainer "
                   "checkpoint's model folder, e.g. OUT/checkpoints/step_000040/model")
    b.add_argument("--output", required=True, help="new Hugging Face folder")
    b.add_argument("--hf-config", help="Hugging Face folder to take config.json and tokenizer files from "
                   "(default: the copy kept inside the checkpoint); refused if its model differs from the one the "
                   "checkpoint records")
    b.add_argument("--allow-config-mismatch", action="store_true", help="write --hf-config's config.json even where "
                   "its values differ from the checkpoint's own record")


def run(args: argparse.Namespace) -> int:
    # The user's mistakes (a path, a size, a checkpoint that does not fit) as one line, as `train` reports
    # a bad config; anything else is a bug and keeps its traceback.
    try:
        if args.direction == "hf-to-mcore":
            _check_exists("--input", args.input)
            out = hf_to_mcore(args.input, args.output, tp=args.tp, pp=args.pp, ep=args.ep)
        else:
            _check_exists("--input", args.input, trainer_checkpoint=True)
            if args.hf_config:
                _check_exists("--hf-config", args.hf_config)
            out = mcore_to_hf(args.input, args.output, hf_config=args.hf_config,
                              allow_config_mismatch=args.allow_config_mismatch)
    except DapoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
