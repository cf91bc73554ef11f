"""Checkpoint conversion throughput next to a plain copy of the same bytes, and its peak memory.

Makes a random Qwen2.5-0.5B-shaped model (494M parameters, bf16, about 1 GB) as a Hugging Face
folder, then, in one run: copies its safetensors files (in the kernel, and read + written by
Python), converts hf-to-mcore at TP=1 and at TP=2 x PP=2, and mcore-to-hf back. GB/s counts the checkpoint's bytes. Each conversion runs in a fresh process that
reports its time and how far its resident memory rose above what the imports left (Linux VmHWM after
resetting it), next to the model's largest tensor and the size of one layer.

    python bench/bench_convert.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_dapo.checkpoint.hf_mapping import expected_hf_names, hf_shape
from megatron_dapo.checkpoint.safetensors_io import write_hf_checkpoint
from megatron_dapo.policy.hf_config import model_spec_from_hf

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}

SHARD_BYTES = 500 * 2**20  # safetensors shards, read and written


def make_random_checkpoint(path: Path) -> int:
    spec = model_spec_from_hf(CONFIG)
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name in sorted(expected_hf_names(spec)):
            yield name, (0.02 * torch.randn(hf_shape(name, spec), generator=g)).to(torch.bfloat16)

    write_hf_checkpoint(path, tensors(), config=CONFIG, max_shard_bytes=SHARD_BYTES)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


_MEASURE = """
import json, time
from megatron_dapo.checkpoint.convert import hf_to_mcore, mcore_to_hf

def kb(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

open("/proc/self/clear_refs", "w").write("5")
before = kb("VmRSS:")
t0 = time.perf_counter()
{call}
print(json.dumps({{"seconds": time.perf_counter() - t0, "growth_mb": (kb("VmHWM:") - before) / 1024}}))
"""


def measured(call: str) -> tuple[float, float]:
    """(seconds, peak resident memory growth in MB) of `call` in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE.format(call=call)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{call} failed:\n{proc.stderr[-5000:]}")
    result = json.loads(proc.stdout.splitlines()[-1])
    return result["seconds"], result["growth_mb"]


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

        def copy_through_memory():  # what a converter does: read into memory, write from it
            (root / "copy2").mkdir()
            for f in files:
                (root / "copy2" / f.name).write_bytes(f.read_bytes())

        rows = [("plain copy of the safetensors files", timed(copy), None),
                ("same, read + written by Python", timed(copy_through_memory), None)]
        steps = [("hf-to-mcore TP=1", f"hf_to_mcore({str(root / 'hf')!r}, {str(root / 'm1')!r}, tp=1, pp=1)"),
                 ("hf-to-mcore TP=2 x PP=2", f"hf_to_mcore({str(root / 'hf')!r}, {str(root / 'm4')!r}, tp=2, pp=2)"),
                 ("mcore-to-hf (from TP=1)", f"mcore_to_hf({str(root / 'm1')!r}, {str(root / 'b1')!r}, max_shard_bytes={SHARD_BYTES})"),
                 ("mcore-to-hf (from TP=2 x PP=2)", f"mcore_to_hf({str(root / 'm4')!r}, {str(root / 'b4')!r}, max_shard_bytes={SHARD_BYTES})")]
        rows += [(name, *measured(call)) for name, call in steps]
        spec = model_spec_from_hf(CONFIG)
        largest = max(torch.Size(hf_shape(n, spec)).numel() for n in expected_hf_names(spec)) * 2 / 2**20
        layer = sum(torch.Size(hf_shape(n, spec)).numel() for n in expected_hf_names(spec)
                    if n.startswith("model.layers.0.")) * 2 / 2**20
        copy_gbps = nbytes / rows[0][1] / 1e9
        print(f"\n== checkpoint conversion, random Qwen2.5-0.5B shape, {nbytes / 1e9:.2f} GB of bf16 tensors "
              f"(largest tensor {largest:.0f} MB, one layer {layer:.0f} MB, HF shards of {SHARD_BYTES / 2**20:.0f} MB) ==")
        print(f"{'step':<32} {'seconds':>8} {'GB/s':>7} {'vs copy':>8} {'peak memory growth MB':>22}")
        for name, seconds, growth in rows:
            gbps = nbytes / seconds / 1e9
            mem = "" if growth is None else f"{growth:.0f}"
            print(f"{name:<32} {seconds:>8.2f} {gbps:>7.3f} {gbps / copy_gbps:>7.3f}x {mem:>22}")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
