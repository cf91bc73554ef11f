"""Convert checkpoints between Hugging Face and megatron-core's distributed format, at any TP x PP.

    hf-to-mcore --input HF_DIR --output DIR --tp N --pp M
    mcore-to-hf --input DIR --output HF_DIR [--hf-config HF_DIR]

Conversion runs on the CPU in N x M worker processes over gloo, each building its own stage of the
model with megatron-core itself, so the result is exactly what the trainer saves and loads.
Everything is checked before any worker starts (input readable and complete, every tensor known
and of the right shape, sizes divisible, output folder free), and output goes to a temporary folder
renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_dapo.checkpoint.hf_mapping import HF_EMBEDDING, HF_FINAL_NORM
from megatron_dapo.checkpoint.mcore_checkpoint import HF_SUBDIR, read_meta, write_meta
from megatron_dapo.checkpoint.safetensors_io import SIDE_FILES, CheckpointError, HFCheckpoint, holds_checkpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import check_divisibility
from megatron_dapo.runtime import free_port


def _check_output(out: Path) -> None:
    if holds_checkpoint(out):
        raise CheckpointError(f"{out}: already holds a checkpoint; choose a new output folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new output folder")


def _run_workers(world: int, fn, *args) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_worker_entry, args=(world, port, fn, args), nprocs=world, join=True, start_method="spawn")


def _worker_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    fn(*args)


def _progress(total: int, desc: str):
    import torch.distributed as dist
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=dist.get_rank() != 0, file=sys.stderr)


def _hf_to_mcore_worker(input_dir: str, tmp: str, tp: int, pp: int, dtype: torch.dtype) -> None:
    from megatron.core import parallel_state

    from megatron_dapo.checkpoint.hf_mapping import hf_names
    from megatron_dapo.checkpoint.hf_weights import global_name, layer_offset, load_hf_weights
    from megatron_dapo.checkpoint.mcore_checkpoint import save_model
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.runtime import init_runtime, shutdown_runtime

    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu")
    init_runtime(parallel)
    ckpt = HFCheckpoint(input_dir)
    spec = model_spec_from_hf(ckpt.config)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=dtype,
                        initialize=False)
    offset = layer_offset(spec, parallel, parallel_state.get_pipeline_model_parallel_rank())
    reads = sum(len(hf_names(global_name(n, offset), spec)) for n, _ in model.named_parameters())
    bar = _progress(reads, "hf -> mcore (rank 0's stage)")

    def get(name):
        bar.update(1)
        return ckpt.get(name)

    load_hf_weights(model, get, spec, parallel)
    bar.close()
    save_model(model, tmp)
    shutdown_runtime()


def _mcore_to_hf_worker(input_dir: str, out: str, hf_dir: str, tp: int, pp: int, dtype: torch.dtype,
                        max_shard_bytes: int) -> None:
    from megatron.core import parallel_state

    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.checkpoint.mcore_checkpoint import load_model
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.runtime import init_runtime, shutdown_runtime

    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu")
    init_runtime(parallel)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    spec = model_spec_from_hf(config)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=dtype,
                        initialize=False)
    load_model(model, input_dir)
    export_hf_checkpoint(model, spec, parallel, out, hf_config=config, side_files_from=hf_dir,
                         max_shard_bytes=max_shard_bytes)
    shutdown_runtime()


def _checkpoint_dtype(ckpt: HFCheckpoint) -> torch.dtype:
    dtypes = {ckpt.get(n).dtype for n in (HF_EMBEDDING, HF_FINAL_NORM)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{ckpt.path}: tensors of mixed dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def hf_to_mcore(input_dir, output_dir, *, tp: int, pp: int) -> Path:
    """Hugging Face folder -> megatron-core distributed checkpoint saved at TP=tp x PP=pp."""
    out = Path(output_dir)
    _check_output(out)
    ckpt = HFCheckpoint(input_dir)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    check_divisibility(spec, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu"))
    dtype = _checkpoint_dtype(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _run_workers(tp * pp, _hf_to_mcore_worker, str(ckpt.path), str(tmp), tp, pp, dtype)
        write_meta(tmp, tensor_parallel=tp, pipeline_parallel=pp, dtype=dtype)
        (tmp / HF_SUBDIR).mkdir()
        for name in ("config.json", *SIDE_FILES):
            if (ckpt.path / name).is_file():
                shutil.copy2(ckpt.path / name, tmp / HF_SUBDIR / name)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def mcore_to_hf(input_dir, output_dir, *, hf_config=None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """megatron-core distributed checkpoint -> Hugging Face folder (safetensors shards, index, config)."""
    out = Path(output_dir)
    _check_output(out)
    meta = read_meta(input_dir)
    hf_dir = Path(hf_config) if hf_config else Path(input_dir) / HF_SUBDIR
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir}: no config.json; pass --hf-config with the model's Hugging Face folder")
    model_spec_from_hf(json.loads((hf_dir / "config.json").read_text()))
    _run_workers(meta["tensor_parallel"] * meta["pipeline_parallel"], _mcore_to_hf_worker, str(input_dir), str(out),
                 str(hf_dir), meta["tensor_parallel"], meta["pipeline_parallel"], meta["dtype"], max_shard_bytes)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face folder -> megatron-core distributed checkpoint")
    a.add_argument("--input", required=True, help="Hugging Face folder (config.json + safetensors)")
    a.add_argument("--output", required=True, help="new folder for the distributed checkpoint")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at (loads at any)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at (loads at any)")
    b = sub.add_parser("mcore-to-hf", help="megatron-core distributed checkpoint -> Hugging Face folder")
    b.add_argument("--input", required=True, help="distributed checkpoint folder")
    b.add_argument("--output", required=True, help="new Hugging Face folder")
    b.add_argument("--hf-config", help="Hugging Face folder to take config.json and tokenizer files from "
                   "(default: the copy kept inside the checkpoint)")


def run(args: argparse.Namespace) -> int:
    if args.direction == "hf-to-mcore":
        out = hf_to_mcore(args.input, args.output, tp=args.tp, pp=args.pp)
    else:
        out = mcore_to_hf(args.input, args.output, hf_config=args.hf_config)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
