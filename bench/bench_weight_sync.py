"""Weight-sync time per route into a running SGLang server, next to a memcpy of the same bytes.

In one run, for the tiny test model (fp32) and a random Qwen2.5-0.5B-shaped model (494M parameters,
bf16, about 1 GB): start an SGLang server on it, build the Megatron policy from the same checkpoint
(one trainer rank, TP=1), then time `syncer.sync` through each route (best of --repeats after a warm-up)
and a plain tensor copy of the model's bytes. Seconds include gathering the HF tensors, the transfer,
the server loading them and flushing its cache; the disk route includes writing the checkpoint.

    python bench/bench_weight_sync.py [--repeats 2] [--bucket-mb 512] [--device cpu] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
from bench_convert import make_random_checkpoint  # noqa: E402
from tiny_models import save_with_tokenizer  # noqa: E402

from megatron_dapo.checkpoint.hf_weights import load_hf_weights  # noqa: E402
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint  # noqa: E402
from megatron_dapo.config import ParallelConfig  # noqa: E402
from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime  # noqa: E402
from megatron_dapo.policy.hf_config import model_spec_from_hf  # noqa: E402
from megatron_dapo.policy.model import build_model  # noqa: E402
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig  # noqa: E402
from megatron_dapo.weight_sync import ROUTES, make_weight_syncer  # noqa: E402
from megatron_dapo.weight_sync.buckets import model_bytes  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_model(label: str, model_dir: Path, dtype: str, parallel: ParallelConfig, args, work: Path) -> list[tuple]:
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=DTYPES[dtype],
                        initialize=False)
    with torch.no_grad():
        load_hf_weights(model, ckpt.get, spec, parallel)
    nbytes = model_bytes(spec, DTYPES[dtype])
    copy_s = memcpy_seconds(nbytes, args.repeats + 1)
    config = SGLangServerConfig(str(model_dir), device=args.device, dtype=dtype, max_total_tokens=2048,
                                startup_timeout_s=600)
    rows = []
    with SGLangServer(config, work / f"{label.split()[0]}-server.log") as server:
        version = 0
        for route in ROUTES:
            syncer = make_weight_syncer(route, [server.url], spec, parallel, ckpt.config, bucket_mb=args.bucket_mb,
                                        work_dir=work / f"sync-{route}")
            best = None
            for i in range(args.repeats + 1):
                version += 1
                metrics = syncer.sync(model, str(version))
                if i and (best is None or metrics.seconds < best.seconds):  # the first is the warm-up
                    best = metrics
            syncer.close()
            rows.append((label, route, best.bytes, best.seconds, best.gbps, copy_s, nbytes / copy_s / 1e9))
            shutil.rmtree(work / f"sync-{route}", ignore_errors=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="timed syncs per route, after one warm-up")
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_weight_sync_"))
    parallel = ParallelConfig(device=args.device)
    init_runtime(parallel)
    try:
        tokenizer = save_with_tokenizer(root / "tiny")
        make_random_checkpoint(root / "qwen05")
        tokenizer.save_pretrained(root / "qwen05")
        rows = bench_model("tiny Qwen2 (fp32)", root / "tiny", "float32", parallel, args, root)
        rows += bench_model("Qwen2.5-0.5B shape (bf16)", root / "qwen05", "bfloat16", parallel, args, root)
    finally:
        shutdown_runtime()
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n== weight sync into a running SGLang server ({args.device}, 1 trainer rank, "
          f"bucket {args.bucket_mb:g} MB, best of {args.repeats} after a warm-up) ==")
    print(f"{'model':<27} {'route':<12} {'MB':>8} {'seconds':>8} {'GB/s':>7} {'memcpy s':>9} {'memcpy GB/s':>11} "
          f"{'x memcpy time':>13}")
    for label, route, nbytes, seconds, gbps, copy_s, copy_gbps in rows:
        print(f"{label:<27} {route:<12} {nbytes / 2**20:>8.1f} {seconds:>8.3f} {gbps:>7.3f} {copy_s:>9.4f} "
              f"{copy_gbps:>11.2f} {seconds / copy_s:>13.1f}")


if __name__ == "__main__":
    main()
