"""Checkpoint conversion throughput next to a plain copy of the same bytes, on this machine.

Makes a random Qwen2.5-0.5B-shaped model (494M parameters, bf16, about 1 GB) as a Hugging Face
folder, then times, in one run: copying its safetensors files, hf-to-mcore at TP=1 and at TP=2 x PP=2,
and mcore-to-hf back. GB/s counts the checkpoint's bytes; the conversions include starting their
worker processes (importing megatron-core, about 10 s each on 2 cores), reported apart.

    python bench/bench_convert.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_dapo.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_dapo.checkpoint.hf_mapping import expected_hf_names, hf_shape
from megatron_dapo.checkpoint.safetensors_io import write_hf_checkpoint
from megatron_dapo.policy.hf_config import model_spec_from_hf

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def make_random_checkpoint(path: Path) -> int:
    spec = model_spec_from_hf(CONFIG)
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name in sorted(expected_hf_names(spec)):
            yield name, (0.02 * torch.randn(hf_shape(name, spec), generator=g)).to(torch.bfloat16)

    write_hf_checkpoint(path, tensors(), config=CONFIG, max_shard_bytes=500 * 2**20)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def worker_startup_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import megatron.core, megatron_dapo.runtime"], check=True,
                   capture_output=True)
    return time.perf_counter() - t0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        nbytes = make_random_checkpoint(root / "hf")
        files = sorted((root / "hf").glob("*.safetensors"))

        def copy():
            (root / "copy").mkdir()
            for f in files:
                shutil.copyfile(f, root / "copy" / f.name)

        rows = [("plain copy of the safetensors files", timed(copy), 0)]
        startup = worker_startup_seconds()
        rows.append(("hf-to-mcore TP=1", timed(lambda: hf_to_mcore(root / "hf", root / "m1", tp=1, pp=1)), 1))
        rows.append(("hf-to-mcore TP=2 x PP=2", timed(lambda: hf_to_mcore(root / "hf", root / "m4", tp=2, pp=2)), 4))
        rows.append(("mcore-to-hf (from TP=1)", timed(lambda: mcore_to_hf(root / "m1", root / "back1")), 1))
        rows.append(("mcore-to-hf (from TP=2 x PP=2)", timed(lambda: mcore_to_hf(root / "m4", root / "back4")), 4))
        copy_gbps = nbytes / rows[0][1] / 1e9
        print(f"\n== checkpoint conversion, random Qwen2.5-0.5B shape, {nbytes / 1e9:.2f} GB of bf16 tensors; "
              f"a worker's start (import megatron-core) takes {startup:.1f} s ==")
        print(f"{'step':<32} {'seconds':>8} {'GB/s':>7} {'vs copy':>8}   {'GB/s without worker start':>25}")
        for name, seconds, workers in rows:
            gbps = nbytes / seconds / 1e9
            net = nbytes / max(seconds - (startup if workers else 0), 1e-9) / 1e9
            print(f"{name:<32} {seconds:>8.2f} {gbps:>7.3f} {gbps / copy_gbps:>7.3f}x   {net:>25.3f}")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
