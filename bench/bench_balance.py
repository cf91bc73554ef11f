"""How evenly a step's kept responses are dealt to the data-parallel ranks: the split before issue 37 (each response,
longest first, to the rank with the fewest tokens so far) against Karmarkar-Karp's largest differencing method
(rank_shares.balanced_parts), side by side on the same batches.

Each batch: --prompts x --group responses of DAPO-like lengths, prompt + response between 5% and 100% of --budget
tokens and long-tailed (a prompt's responses log-normal around a length of its own, itself log-normal; those past
the budget are cut at it, as max_response_len cuts them), one update's worth (rank_shares.deal_by_tokens cuts a step
into updates first, the same runs for both splits), dealt at each DP of --dp by both splits. For each: the step's
metric balance/tokens_max_over_mean (rank_shares.tokens_max_over_mean: the most loaded rank's tokens over the mean
rank's), its mean over --batches batches and the worst; the same ratio of the ranks' training FLOPs at
Qwen2.5-1.5B's shape (bench_train_step.step_flops: the matmuls, and causal attention's square per sequence), which
the split that evens tokens leaves less even than the greedy one did; and the median milliseconds of a deal.

    python bench/bench_balance.py [--prompts 32] [--group 16] [--budget 20480] [--dp 2 4 8 16 32 64] [--batches 50]
"""

from __future__ import annotations

import argparse
import heapq
import random
import shutil
import statistics
import time

from bench_train_step import step_flops
from model_shapes import model_folder

from megatron_dapo.parallel.rank_shares import balanced_parts, deal_by_tokens, tokens_max_over_mean
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.samples import TrainItem


def greedy_parts(weights: list[int], parts: int) -> list[list[int]]:
    """The split before issue 37, for comparison only: the heaviest first, each to the part with the least so far
    (ties: the part with fewer weights, then the lower index)."""
    loads = [(0, 0, r) for r in range(parts)]
    dealt: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        load, n, r = heapq.heappop(loads)
        dealt[r].append(i)
        heapq.heappush(loads, (load + weights[i], n + 1, r))
    return dealt


def dapo_lengths(prompts: int, group: int, budget: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) token counts of a kept batch in draw order, a prompt's `group` responses together."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = rng.randint(64, 512)
        typical = rng.lognormvariate(0, 0.8) * budget / 5  # a hard prompt's responses are all long
        for _ in range(group):
            total = round(prompt + rng.lognormvariate(0, 0.5) * typical)
            out.append((prompt, min(max(total, budget // 20), budget) - prompt))
    return out


def items_of(lengths: list[tuple[int, int]]) -> list[TrainItem]:
    return [TrainItem([0] * p, [0] * r, [], 0.0, True) for p, r in lengths]


def flops_max_over_mean(spec, shares) -> float:
    flops = [step_flops(spec, [(len(it.prompt_ids), len(it.output_ids)) for it in share[0]]) for share in shares]
    return max(flops) / statistics.mean(flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32], help="prompts an update, a row group each")
    parser.add_argument("--group", type=int, default=16, help="responses per prompt")
    parser.add_argument("--budget", type=int, default=20480, help="tokens: the longest prompt + response")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args()
    folder = model_folder(tiny=False, prefix="bench_balance_")
    spec = model_spec_from_hf(folder)
    shutil.rmtree(folder)
    splits = {"greedy": greedy_parts, "KK": balanced_parts}
    print(f"== token balance over DP ranks: {args.batches} batches of PROMPTS x {args.group} responses (one update), "
          f"prompt + response {args.budget // 20}-{args.budget} tokens, long-tailed; FLOPs at Qwen2.5-1.5B's shape ==")
    print(f"{'responses':>9} | {'DP':>3} | {'per rank':>8} | {'greedy max/mean':>15} | {'KK max/mean':>11} | "
          f"{'greedy worst':>12} | {'KK worst':>8} | {'FLOPs greedy':>12} | {'FLOPs KK':>8} | {'KK ms':>6}")
    for prompts in args.prompts:
        batches = [dapo_lengths(prompts, args.group, args.budget, seed) for seed in range(args.batches)]
        for dp in args.dp:
            tokens, flops, ms = {name: [] for name in splits}, {name: [] for name in splits}, []
            for lengths in batches:
                items = items_of(lengths)
                for name, split in splits.items():
                    start = time.perf_counter()
                    shares = deal_by_tokens(items, dp, 1, split)
                    if split is balanced_parts:
                        ms.append((time.perf_counter() - start) * 1e3)
                    tokens[name].append(tokens_max_over_mean(shares))
                    flops[name].append(flops_max_over_mean(spec, shares))
            mean = {name: statistics.mean(v) for name, v in tokens.items()}
            worst = {name: max(v) for name, v in tokens.items()}
            print(f"{len(batches[0]):>9} | {dp:>3} | {len(batches[0]) // dp:>8} | {mean['greedy']:>15.4f} | "
                  f"{mean['KK']:>11.4f} | {worst['greedy']:>12.4f} | {worst['KK']:>8.4f} | "
                  f"{statistics.mean(flops['greedy']):>12.4f} | {statistics.mean(flops['KK']):>8.4f} | "
                  f"{statistics.median(ms):>6.2f}")


if __name__ == "__main__":
    main()
