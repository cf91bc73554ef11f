"""Fused DAPO loss vs the plain PyTorch reference (eager and torch.compile), forward + backward.

Prints, per token count, the median time of each variant, the ratios measured in this same run, and
the peak extra memory of one call. On CPU peak memory is the resident high-water mark (reset through
/proc/self/clear_refs) of a child process whose glibc maps every large buffer afresh
(MALLOC_MMAP_THRESHOLD_), so that no freed memory is silently reused; timings come from this process,
with the default allocator. On CUDA it is torch.cuda.max_memory_allocated. With a GPU, a CUDA section adds achieved
GB/s (17 bytes per token: logp, old_logp, advantages, grad at 4 bytes, the mask at 1) against a
measured device-to-device copy.

    python bench/bench_dapo_loss.py [--tokens 1e5 1e6 1e7] [--device cpu cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference

KW = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
BYTES_PER_TOKEN = 17


def make_inputs(n: int, device: str):
    g = torch.Generator().manual_seed(0)
    logp = (-2.0 + 0.5 * torch.randn(n, generator=g)).to(device)
    old_logp = (logp.cpu() + 0.2 * torch.randn(n, generator=g)).to(device)
    advantages = torch.randn(n, generator=g).to(device)
    mask = (torch.rand(n, generator=g) > 0.1).to(device)
    return logp, old_logp, advantages, mask


def step(fn, logp, old_logp, advantages, mask):
    x = logp.detach().requires_grad_()
    loss, _ = fn(x, old_logp, advantages, mask, normalizer=logp.numel(), **KW)
    loss.backward()
    return x.grad


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, inputs, device, reps):
    for _ in range(2):
        step(fn, *inputs)
    sync(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(fn, *inputs)
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn, inputs, device):
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, *inputs)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(fn, *inputs)
    return (_rss_kib("VmHWM:") - base) / 1024


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def cpu_memory_in_child(token_counts):
    cmd = [sys.executable, __file__, "--memory-child", "--tokens", *map(str, token_counts)]
    out = subprocess.run(cmd, env={**os.environ, **MALLOC_ENV}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_child(token_counts):
    variants = {"fused": dapo_loss, "eager": dapo_loss_reference,
                "compile": torch.compile(dapo_loss_reference, dynamic=False)}
    result = {}
    for n in token_counts:
        inputs = make_inputs(n, "cpu")
        for f in variants.values():
            step(f, *inputs)  # compiles, and touches everything a call needs once
        result[str(n)] = {f"{k}_mib": peak_extra_mib(f, inputs, "cpu") for k, f in variants.items()}
    print(json.dumps(result))


def copy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    return 2 * nbytes / seconds / 1e9  # a copy reads and writes every byte


def run(device: str, token_counts):
    compiled = torch.compile(dapo_loss_reference, dynamic=False)
    variants = {"fused": dapo_loss, "eager": dapo_loss_reference, "compile": compiled}
    fused_vs_ref_max_err = 0.0
    rows = []
    for n in token_counts:
        inputs = make_inputs(n, device)
        reps = 5 if n >= 10**7 else 20
        row = dict(n=n, **{f"{k}_ms": time_ms(f, inputs, device, reps) for k, f in variants.items()})
        g_fused, g_ref = step(dapo_loss, *inputs), step(dapo_loss_reference, *inputs)
        fused_vs_ref_max_err = max(fused_vs_ref_max_err, (g_fused - g_ref).abs().max().item())
        if device == "cuda":
            row["gbps"] = BYTES_PER_TOKEN * n / (row["fused_ms"] / 1e3) / 1e9
            row["copy_gbps"] = copy_gbps(BYTES_PER_TOKEN * n)
        rows.append(row)
    memory = cpu_memory_in_child(token_counts) if device == "cpu" else None
    for row in rows:
        if memory is None:
            inputs = make_inputs(row["n"], device)
            row.update({f"{k}_mib": peak_extra_mib(f, inputs, device) for k, f in variants.items()})
        else:
            row.update(memory[str(row["n"])])
    print(f"\n== {device}: fused forward+backward vs reference (eager, torch.compile); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads ==")
    head = (f"{'tokens':>10} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} {'eager/fused':>11} "
            f"{'compile/fused':>13} {'peak MiB fused':>14} {'eager':>7} {'compile':>7}")
    if device == "cuda":
        head += f" {'fused GB/s':>10} {'copy GB/s':>9} {'of copy':>7}"
    print(head)
    for r in rows:
        line = (f"{r['n']:>10.0e} {r['fused_ms']:>9.3f} {r['eager_ms']:>9.3f} {r['compile_ms']:>10.3f} "
                f"{r['eager_ms'] / r['fused_ms']:>10.2f}x {r['compile_ms'] / r['fused_ms']:>12.2f}x "
                f"{r['fused_mib']:>14.1f} {r['eager_mib']:>7.1f} {r['compile_mib']:>7.1f}")
        if device == "cuda":
            line += f" {r['gbps']:>10.0f} {r['copy_gbps']:>9.0f} {r['gbps'] / r['copy_gbps']:>6.0%}"
        print(line)
    print(f"max |grad fused - grad reference| over the runs: {fused_vs_ref_max_err:.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    parser.add_argument("--device", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens]
    if args.memory_child:
        return memory_child(token_counts)
    for device in args.device:
        if device == "cuda" and not torch.cuda.is_available():
            print("\n== cuda: no GPU here, section skipped ==")
            continue
        run(device, token_counts)


if __name__ == "__main__":
    main()
