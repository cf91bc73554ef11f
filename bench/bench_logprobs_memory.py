"""Peak memory (and time) of per-token log-probs + entropy: vocab-parallel chunked vs naive.

Both paths start from the output layer's logits, [tokens, vocab / TP] in bf16 (the training dtype on
GPU), and run forward + backward of sum(log p(target)) with the entropy as a metric, down to the
gradient of the logits that the output layer's backward would consume:
- ours: megatron_dapo.policy.logprobs.vocab_parallel_logprobs (fp32 one chunk at a time, the
  gradient written over the logits);
- naive: all-gather the vocabulary, log_softmax in fp32, gather the targets, entropy from the full
  distribution.
TP ranks are processes over gloo. Peak memory is per rank: the resident high-water mark above the
inputs (reset through /proc/self/clear_refs, glibc mapping every large buffer afresh), or
torch.cuda.max_memory_allocated on a GPU. A run that would not fit in this machine's memory is
measured at the largest token count that does and scaled linearly (every buffer of both paths is
[tokens, vocab]); such rows are marked "*".

    python bench/bench_logprobs_memory.py [--tokens 8192] [--vocab 152064] [--tp 1 2] [--device cpu cuda]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker_results import result_of

from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.policy.logprobs import vocab_parallel_logprobs

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
NAIVE_FULL_COPIES = 5.0  # fp32 [tokens, vocab] buffers the naive path holds at its peak, for the fit check


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable")


class _OutputLayer(torch.autograd.Function):
    """Stands in for the output layer: hands out the logits, then takes their gradient and drops it."""

    @staticmethod
    def forward(ctx, anchor, logits):
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(1, device=grad.device), None


def _anchor(logits):
    """The output layer's stand-in weight: on the logits' device, where its gradient (made from theirs) lands."""
    return torch.zeros(1, device=logits.device, requires_grad=True)


def ours(logits, targets, vocab, tp_rank, group):
    x = _OutputLayer.apply(_anchor(logits), logits)
    logp, entropy = vocab_parallel_logprobs(x, targets, vocab_start=tp_rank * logits.shape[1], vocab_size=vocab,
                                            group=group, inplace_backward=True)
    logp.sum().backward()


def naive(logits, targets, vocab, tp_rank, group):
    x = _OutputLayer.apply(_anchor(logits), logits)
    if group is not None and dist.get_world_size(group) > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        x = gather_from_tensor_model_parallel_region(x)
    logp_all = torch.log_softmax(x[:, :vocab].float(), dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    with torch.no_grad():
        -(logp_all.exp() * logp_all).sum(-1)
    logp.sum().backward()


def measure(fn, logits, targets, vocab, tp_rank, group, device):
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn(logits, targets, vocab, tp_rank, group)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    base = _kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    fn(logits, targets, vocab, tp_rank, group)
    return time.perf_counter() - t0, (_kib("VmHWM:") - base) * 1024


def worker(rank, world, port, tokens, vocab, device, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    runtime = init_runtime(ParallelConfig(tensor_parallel=world, device=device))
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    dev = runtime.device  # a device-faithful CPU run (the suite's) follows the GPU's placement
    g = torch.Generator().manual_seed(0)
    padded = -(-vocab // (128 * world)) * 128 * world
    cols = padded // world
    out = {}
    for name, n in tokens.items():
        full = (3 * torch.randn(n, padded, generator=g)).to(torch.bfloat16)
        logits = full[:, rank * cols:(rank + 1) * cols].contiguous().to(dev)
        targets = torch.randint(0, vocab, (n,), generator=g).to(dev)
        del full
        fn = ours if name == "ours" else naive
        fn(logits[:64].clone(), targets[:64], vocab, rank, group)  # warm-up, outside the measurement
        seconds, peak = measure(fn, logits, targets, vocab, rank, group, device)
        out[name] = {"tokens": n, "seconds": seconds, "peak_bytes": peak}
        del logits, targets
    if rank == 0:
        results.put(out)
    shutdown_runtime()


def tokens_that_fit(tokens: int, vocab: int, tp: int, device: str) -> dict[str, int]:
    """Token count per path; the naive one halves until tp copies of its peak fit in memory."""
    naive = tokens
    if device == "cpu":
        budget = 0.7 * _available_bytes()
        while naive > 256 and tp * NAIVE_FULL_COPIES * 4 * naive * vocab > budget:
            naive //= 2
    return {"ours": tokens, "naive": naive}


def run(device: str, tokens: int, vocab: int, tp_sizes: list[int]):
    rows = []
    for tp in tp_sizes:
        if device == "cuda" and torch.cuda.device_count() < tp:
            print(f"cuda: TP={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible: skipped")
            continue
        counts = tokens_that_fit(tokens, vocab, tp, device)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, tp, port, counts, vocab, device, results)) for r in range(tp)]
        for p in procs:
            p.start()
        out = result_of(procs, results, f"TP={tp}")
        rows.append((tp, out))
    print(f"\n== {device}: log-probs + entropy, forward + backward, {tokens} tokens, vocab {vocab}, bf16 logits; "
          "peak extra memory per TP rank ==")
    print(f"{'TP':>3} {'ours GiB':>9} {'naive GiB':>10} {'ours/naive':>10} {'ours s':>7} {'naive s':>8} "
          f"{'naive/ours time':>15}")
    for tp, out in rows:
        o, nv = out["ours"], out["naive"]
        scale = tokens / nv["tokens"]
        mark = "*" if scale != 1 else " "
        o_gib, n_gib = o["peak_bytes"] / 2**30, nv["peak_bytes"] * scale / 2**30
        n_sec = nv["seconds"] * scale
        print(f"{tp:>3} {o_gib:>9.2f} {n_gib:>9.2f}{mark} {o_gib / n_gib:>10.3f} {o['seconds']:>7.2f} "
              f"{n_sec:>7.2f}{mark} {n_sec / o['seconds']:>14.2f}x")
    for tp, out in rows:
        if out["naive"]["tokens"] != tokens:
            print(f"* TP={tp}: naive measured at {out['naive']['tokens']} tokens (the full count does not fit in "
                  "this machine's memory) and scaled linearly")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    for device in args.device:
        if device == "cuda" and not torch.cuda.is_available():
            print("\n== cuda: no GPU here, section skipped ==")
            continue
        run(device, args.tokens, args.vocab, args.tp)


if __name__ == "__main__":
    main()
