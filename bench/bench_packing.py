"""Packed against padded micro-batches (model.packing), side by side in one run: a policy trains on a DAPO-like
length distribution (prompts of 32-128 tokens, 16 responses each, long-tailed: log-normal around 20% of the cap,
clipped to 5%-100% of it, so that some hit the cap), with each layout in turn on the same samples. It prints, per
layout:

- padding: padded tokens / all tokens computed (packed: the tails sequence parallelism would add, none here);
- micro-batches per step;
- tokens/s of a training step (forward + backward + optimizer; real tokens, prompts and responses), the median of
  --steps after a warm-up step, the layouts' steps taken in turn, and the line `packed / padded tokens/s: X.XXx`;
- on a GPU, MFU: the model FLOPs of the real tokens (bench_train_step.py's count) per second over the GPU's dense
  bf16 peak, so that what is spent on padding counts as lost;
- the step's peak memory: on a GPU torch.cuda.max_memory_allocated; on the CPU the process's peak resident memory
  over the step (VmHWM, reset before it: both layouts' models and optimizers, and the allocator's cache, count);
- the first step's loss (both start from the same weights: equal up to rounding);

and the max / mean tokens per data-parallel rank at --dp ranks, dealt in draw order (each rank a contiguous run, as a
plain split would), by the greedy longest-first deal this project had before, and by parallel/rank_shares.py's
Karmarkar-Karp deal.

    python bench/bench_packing.py [--device cpu] [--prompts 8] [--max-response 1024] [--steps 3]
    python bench/bench_packing.py --device cuda --prompts 8 --max-response 4096    # Qwen2.5-1.5B's shape
    python bench/bench_packing.py --tiny                                           # the suite's size
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_train_step import PEAK_BF16_TFLOPS, step_flops  # noqa: E402
from model_shapes import model_folder  # noqa: E402

GROUP = 16
# The CPU's model: small enough for a laptop core, wide enough that matmuls, not Python, set the step's time.
CPU_SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": 2048}


def dapo_lengths(prompts: int, max_response: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        prompt = int(torch.randint(32, 129, (1,), generator=g))
        for _ in range(GROUP):
            share = math.exp(math.log(0.2) + 0.8 * float(torch.randn(1, generator=g)))
            out.append((prompt, max(1, round(max_response * min(1.0, max(0.05, share))))))
    return out


def samples_of(spec, shape, seed: int):
    from megatron_dapo.policy.batch import Sequence
    from megatron_dapo.policy.train_step import RolloutSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt, response in shape:
        ids = torch.randint(0, spec.vocab_size, (prompt + response,), generator=g)
        adv = torch.full((response,), float(torch.randn(1, generator=g)))
        out.append(RolloutSample(Sequence(ids, prompt), -torch.rand(response, generator=g) * 3, adv,
                                 torch.ones(response, dtype=torch.bool)))
    return out


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    return 1024 * int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def trainers(spec, parallel, device, dtype, budget: int):
    """A padded and a packed PolicyTrainer with the same weights (the same random initialisation)."""
    from megatron.core import tensor_parallel

    from megatron_dapo.config import LossConfig, OptimConfig
    from megatron_dapo.policy.train_step import PolicyTrainer

    out = {}
    for name, packed in (("padded", False), ("packed", True)):
        torch.manual_seed(parallel.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(parallel.seed, force_reset_rng=True)
        out[name] = PolicyTrainer(spec, parallel, device, OptimConfig(lr=1e-6, warmup_steps=0,
                                                                      distributed_optimizer=False),
                                  LossConfig(), budget, params_dtype=dtype, packed=packed)
    return out


def measure(trainers: dict, samples, budget: int, steps: int, device) -> dict:
    """Steps of each trainer in turn (padded, packed, padded, ...), so that the machine's drift falls on both; the
    median per layout, after a warm-up step each."""
    from megatron_dapo.policy.batch import micro_batches

    cuda = device.type == "cuda" and torch.cuda.is_available()  # not in the device-faithful CPU mode
    real = sum(s.sequence.tokens.numel() for s in samples)
    rows = {}
    for name, trainer in trainers.items():
        mbs = micro_batches([s.sequence for s in samples], budget, packed=trainer.packed)
        rows[name] = {"padding": 1 - real / sum(mb.input_ids.numel() for mb in mbs), "micro_batches": len(mbs),
                      "times": [], "peaks": [], "loss": trainer.step(samples).loss}  # the warm-up's: same weights
    for _ in range(steps):
        for name, trainer in trainers.items():
            gc.collect()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            else:
                peak_rss_reset()
            start = time.perf_counter()
            trainer.step(samples)
            if cuda:
                torch.cuda.synchronize(device)
            rows[name]["times"].append(time.perf_counter() - start)
            rows[name]["peaks"].append(torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes())
    for r in rows.values():
        r["step_s"] = statistics.median(r.pop("times"))
        r["tokens_per_s"] = real / r["step_s"]
        r["peak_gb"] = max(r.pop("peaks")) / 1e9
    return rows


def balance(shape, dp: int) -> dict[str, float]:
    """max / mean tokens per rank, one update: draw order in contiguous runs, the greedy longest-first deal this
    project had before (bench/bench_balance.py's greedy_parts), and rank_shares' Karmarkar-Karp deal."""
    from bench_balance import greedy_parts

    from megatron_dapo.parallel.rank_shares import deal_by_tokens, tokens_max_over_mean
    from megatron_dapo.samples import TrainItem

    per_rank = len(shape) // dp
    items = [TrainItem([0] * p, [0] * r, [0.0] * r, 0.0, True) for p, r in shape[: per_rank * dp]]
    runs = [[items[r * per_rank:(r + 1) * per_rank]] for r in range(dp)]
    return {"draw order": tokens_max_over_mean(runs),
            "greedy": tokens_max_over_mean(deal_by_tokens(items, dp, 1, split=greedy_parts)),
            "Karmarkar-Karp": tokens_max_over_mean(deal_by_tokens(items, dp, 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model and short responses (the suite)")
    parser.add_argument("--prompts", type=int, default=8, help=f"prompts of a step, {GROUP} responses each")
    parser.add_argument("--max-response", type=int, default=1024, help="the response cap (DAPO's: 20480)")
    parser.add_argument("--micro-batch-tokens", type=int, help="default: the longest sequence's worth, twice")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks for the balance figures")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    if args.tiny:
        args.prompts, args.max_response, args.steps = min(args.prompts, 2), min(args.max_response, 96), 1

    from megatron_dapo.config import ParallelConfig, default_training_dtype
    from megatron_dapo.parallel.runtime import builds_for_gpu, free_port, init_runtime, shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    folder = model_folder(args.tiny or args.device == "cpu", "bench_packing_")
    if args.device == "cpu" and not args.tiny:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **CPU_SHAPE}))
    parallel = ParallelConfig(device=args.device)
    runtime = init_runtime(parallel, environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(free_port())})
    dtype = getattr(torch, default_training_dtype(builds_for_gpu(parallel)))
    spec = model_spec_from_hf(folder)
    shape = dapo_lengths(args.prompts, args.max_response, args.seed)
    budget = args.micro_batch_tokens or 2 * max(p + r for p, r in shape)
    samples = samples_of(spec, shape, args.seed)
    try:
        rows = measure(trainers(spec, parallel, runtime.device, dtype, budget), samples, budget, args.steps,
                       runtime.device)
    finally:
        shutdown_runtime()
    tokens = [p + r for p, r in shape]
    print(f"{len(shape)} sequences ({args.prompts} prompts x {GROUP}), {sum(tokens)} tokens, {min(tokens)}-"
          f"{max(tokens)} each (responses capped at {args.max_response}); {spec.num_layers} layers x "
          f"{spec.hidden_size} wide, {dtype}, {runtime.device.type}; {budget} tokens per micro-batch")
    gpu = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else ""
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    print(f"{'layout':<8}{'padding':>9}{'micro-batches':>15}{'tokens/s':>11}{'step s':>9}{'MFU %':>7}{'peak GB':>9}"
          f"{'loss':>11}")
    for name, r in rows.items():
        mfu = f"{100 * step_flops(spec, shape) / r['step_s'] / 1e12 / peak:.1f}" if peak else "-"
        print(f"{name:<8}{r['padding']:>9.3f}{r['micro_batches']:>15}{r['tokens_per_s']:>11.0f}{r['step_s']:>9.3f}"
              f"{mfu:>7}{r['peak_gb']:>9.2f}{r['loss']:>11.6f}")
    print(f"packed / padded tokens/s: {rows['packed']['tokens_per_s'] / rows['padded']['tokens_per_s']:.2f}x")
    print(f"max / mean tokens per rank at DP = {args.dp}: "
          + ", ".join(f"{name} {value:.4f}" for name, value in balance(shape, args.dp).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
