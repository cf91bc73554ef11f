"""Peak memory (and time) of one causal core-attention forward + backward: SdpaAttention vs megatron's local
DotProductAttention (the local layer spec's attention before SdpaAttention replaced it).

Both get the same GQA inputs, query [s, 1, heads, head_dim] and key / value [s, 1, groups, head_dim] (fp32
on CPU, bf16 on GPU), and run forward + backward down to the q / k / v gradients. Each (attention, length)
case runs in a fresh spawned process (a world of one: megatron's attention needs its parallel state), so no
case inherits another's heap. Peak memory is the extra over the inputs: on CPU the resident high-water mark
(VmHWM, reset through /proc/self/clear_refs after the inputs and a small warm-up call) minus the resident
size before the call, with glibc mapping every large buffer afresh; on a GPU torch.cuda.max_memory_allocated
minus the memory allocated before. Megatron's path holds several [heads, s, s] fp32 buffers (scores,
probabilities, their gradients); the defaults keep it near 5 GiB at 8k tokens. Each case is warmed up at
the measured shape (a first call at a new shape builds the backend's plan on a GPU) and measured --repeats times:
the median time, the highest peak. The SDPA kernel that ran is read from torch's profiler.

With MEGATRON_DAPO_DEVICE_FAITHFUL=1 on the CPU (as the suite runs it, at tiny sizes) the cases follow the GPU's
placement and fail where it would; its per-op bookkeeping is timed too, so leave it off to measure.

    python bench/bench_attention_memory.py [--tokens 2048 4096 8192] [--heads 4] [--groups 2] [--head-dim 64]
                                           [--repeats 3] [--device cpu cuda]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from worker_results import result_of

from megatron_dapo.parallel.runtime import free_port

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
IMPLS = ("megatron", "sdpa")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def attention(impl: str, heads: int, groups: int, head_dim: int, dtype: torch.dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.policy.sdpa_attention import SdpaAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, masked_softmax_fusion=False,
                               attention_softmax_in_fp32=True, use_cpu_initialization=True)
    cls = DotProductAttention if impl == "megatron" else SdpaAttention
    return cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def inputs(tokens: int, heads: int, groups: int, head_dim: int, dtype, dev):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 1, heads, head_dim, generator=g)
    k, v = (torch.randn(tokens, 1, groups, head_dim, generator=g) for _ in range(2))
    grad = torch.randn(tokens, 1, heads * head_dim, generator=g)
    return [t.to(dev, dtype).requires_grad_(i < 3) for i, t in enumerate((q, k, v, grad))]


def forward_backward(module, q, k, v, grad):
    module(q, k, v, None).backward(grad)


def measure(module, args, device: str) -> tuple[float, int]:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        forward_backward(module, *args)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    base = _kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    t0 = time.perf_counter()
    forward_backward(module, *args)
    return time.perf_counter() - t0, (_kib("VmHWM:") - base) * 1024


# torch's SDPA kernels, by the op its dispatcher picks (the profiler names it)
SDPA_KERNELS = {"aten::_scaled_dot_product_flash_attention": "flash",
                "aten::_scaled_dot_product_cudnn_attention": "cudnn",
                "aten::_scaled_dot_product_efficient_attention": "mem-efficient",
                "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
                "aten::_scaled_dot_product_attention_math": "math"}


def sdpa_kernel(module, q, k, v) -> str:
    """The SDPA kernel a forward of `module` runs."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        module(q, k, v, None)
    ran = [SDPA_KERNELS[e.name] for e in prof.events() if e.name in SDPA_KERNELS]
    return ran[0] if ran else "none"


def case(impl, tokens, heads, groups, head_dim, device, repeats, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime

    runtime = init_runtime(ParallelConfig(device=device))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module = attention(impl, heads, groups, head_dim, dtype)
    args = inputs(tokens, heads, groups, head_dim, dtype, runtime.device)
    forward_backward(module, *args)  # warm-up at the measured shape, outside the measurement
    runs = []
    for _ in range(repeats):
        for t in args[:3]:
            t.grad = None  # each backward allocates its gradients, as the first did
        runs.append(measure(module, args, device))
    results.put({"seconds": statistics.median(s for s, _ in runs), "peak_bytes": max(p for _, p in runs),
                 "kernel": sdpa_kernel(module, *args[:3]) if impl == "sdpa" else "-"})
    shutdown_runtime()


def run(device: str, token_counts: list[int], heads: int, groups: int, head_dim: int, repeats: int) -> None:
    ctx = mp.get_context("spawn")
    rows = []
    for tokens in token_counts:
        out = {}
        for impl in IMPLS:
            results = ctx.Queue()
            p = ctx.Process(target=case, args=(impl, tokens, heads, groups, head_dim, device, repeats, free_port(),
                                               results))
            p.start()
            out[impl] = result_of([p], results, f"{impl} at {tokens} tokens")
        rows.append((tokens, out))
    dtype = "bf16" if device == "cuda" else "fp32"
    print(f"\n== {device}: causal attention forward + backward, {heads} heads / {groups} KV groups, head_dim "
          f"{head_dim}, batch 1, {dtype}; peak extra memory, median time of {repeats} ==")
    print(f"{'tokens':>7} {'megatron GiB':>12} {'sdpa GiB':>9} {'sdpa/megatron':>13} {'megatron s':>10} "
          f"{'sdpa s':>7} {'sdpa/megatron time':>18} {'sdpa kernel':>13}")
    for tokens, out in rows:
        m, s = out["megatron"], out["sdpa"]
        m_gib, s_gib = m["peak_bytes"] / 2**30, s["peak_bytes"] / 2**30
        print(f"{tokens:>7} {m_gib:>12.3f} {s_gib:>9.3f} {s_gib / m_gib:>13.4f} {m['seconds']:>10.4f} "
              f"{s['seconds']:>7.4f} {s['seconds'] / m['seconds']:>17.2f}x {s['kernel']:>13}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    for device in args.device:
        if device == "cuda" and not torch.cuda.is_available():
            print("\n== cuda: no GPU here, section skipped ==")
            continue
        run(device, args.tokens, args.heads, args.groups, args.head_dim, args.repeats)


if __name__ == "__main__":
    main()
