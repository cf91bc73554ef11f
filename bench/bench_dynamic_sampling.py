"""What the unbiased dynamic-sampling rule costs against keeping groups in the order they complete.

DynamicSampler keeps the first B mixed groups (0 < #correct < G) in the order the prompts were drawn,
streaming and aborting what it knows it will not need. The rule it replaced kept the first B mixed
groups to *complete* and aborted the rest of the round: cheaper, but a group completes when its
longest response does, so it favours prompts with short responses. This runs both on a real SGLang
server (CPU flags on the CPU; --enable-deterministic-inference, so a request's samples depend only on
its seed) with responses of very different lengths (ten stop tokens, up to --max-new-tokens), the same
prompts and seeds for both, "correct" meaning an even first token. For each rule: samples generated
per kept sample, rollout seconds per step, and the kept batch's mean response length against the batch
a full synchronous generation keeps (every drawn prompt generated, then the first B mixed in draw
order; the unbiased rule's batch must be exactly it).

    python bench/bench_dynamic_sampling.py [--steps 3] [--batch 8] [--group 4] [--oversample 2.0]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_dapo.algorithm import AlgorithmConfig, PromptItem
from megatron_dapo.rollout.engine import SamplingParams, sample_seed
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig
from megatron_dapo.service.dynamic_sampler import DynamicSampler

TESTS = Path(__file__).resolve().parent.parent / "tests" / "distributed"
SEED = 1234


class CompletionOrderSampler(DynamicSampler):
    """The rule before issue 13, for comparison only: mixed groups kept as they complete, the rest aborted."""

    def _round(self, prompts, params, need, tally):
        kept, received = [], 0
        stream = self.engine.stream([p.token_ids for p in prompts], self.cfg.group_size, params)
        try:
            for samples in stream:
                received += 1
                group = self._score(prompts[self._check_group(prompts, samples)], samples)
                tally.generated(group)
                tally.settle(group)
                kept += [group] if self._mixed(group) else []
                if len(kept) == need:
                    break
        finally:
            stream.abort()
            tally.aborted += len(prompts) - received
        return kept


def score(prompt, samples) -> list[bool]:
    return [s.output_ids[0] % 2 == 0 for s in samples]


def mixed(groups) -> list[bool]:
    return [0 < sum(score(None, g)) < len(g) for g in groups]


def full_generation_batch(engine, pool: list[PromptItem], cfg: AlgorithmConfig, params: SamplingParams) -> list:
    """The batch of a synchronous rollout: each round generated whole, its first mixed groups in draw order."""
    kept, drawn = [], 0
    for round_ in range(1, cfg.max_sampling_rounds + 1):
        k = math.ceil((cfg.batch_size - len(kept)) * cfg.oversample_factor)
        prompts, drawn = pool[drawn:drawn + k], drawn + k
        groups = engine.generate([p.token_ids for p in prompts], cfg.group_size,
                                 dataclasses.replace(params, seed=sample_seed(params.seed, round_)))
        kept += [(p.index, g) for p, g, m in zip(prompts, groups, mixed(groups)) if m][: cfg.batch_size - len(kept)]
        if len(kept) == cfg.batch_size:
            break
    return kept


def mean_len(groups) -> float:
    lens = [len(s.output_ids) for g in groups for s in g]
    return sum(lens) / len(lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="B: groups per step")
    parser.add_argument("--group", type=int, default=4, help="G: responses per prompt")
    parser.add_argument("--oversample", type=float, default=2.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: the tests' tiny Qwen2)")
    args = parser.parse_args()
    cfg = AlgorithmConfig(batch_size=args.batch, group_size=args.group, oversample_factor=args.oversample,
                          max_sampling_rounds=3, max_response_len=args.max_new_tokens, overlong_cache_len=0)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            sys.path.insert(0, str(TESTS))
            from tiny_models import save_with_tokenizer

            model_dir = Path(tmp) / "model"
            save_with_tokenizer(model_dir)
        from megatron_dapo.policy.hf_config import model_spec_from_hf

        vocab = model_spec_from_hf(model_dir).vocab_size
        params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=list(range(3, vocab, vocab // 10)))
        g = torch.Generator().manual_seed(SEED)
        per_step = math.ceil(args.batch * args.oversample) * cfg.max_sampling_rounds  # enough for every round
        pools = [[PromptItem(i, torch.randint(3, vocab, (int(torch.randint(8, 25, (1,), generator=g)),),
                                              generator=g).tolist(), "") for i in range(per_step)]
                 for _ in range(args.steps)]
        config = SGLangServerConfig(str(model_dir), device="cpu", dtype="float32", max_total_tokens=65536,
                                    startup_timeout_s=900, extra_args=["--enable-deterministic-inference"])
        rules = {"completion order": CompletionOrderSampler, "draw order (unbiased)": DynamicSampler}
        stats = {name: {"samples": 0, "kept_samples": 0, "seconds": 0.0, "kept": [], "full": []} for name in rules}
        identical = True
        with SGLangServer(config, Path(tmp) / "server.log") as server:
            engine = SGLangEngine(server.url)
            engine.generate([p.token_ids for p in pools[0][:2]], 2, SamplingParams(max_new_tokens=4))  # warm-up
            for step, pool in enumerate(pools):
                step_params = dataclasses.replace(params, seed=sample_seed(SEED, step))
                full = full_generation_batch(engine, pool, cfg, step_params)
                for name, rule in rules.items():
                    source = iter(pool)
                    sampler = rule(engine, score, lambda k, source=source: [next(source) for _ in range(k)], cfg,
                                   step_params)
                    t0 = time.perf_counter()
                    batch = sampler.collect()
                    st = stats[name]
                    st["seconds"] += time.perf_counter() - t0
                    st["samples"] += batch.metrics.samples_generated
                    st["kept_samples"] += batch.num_samples
                    st["kept"] += [g.samples for g in batch.groups]
                    st["full"] += [g for _, g in full]
                    if rule is DynamicSampler:
                        identical &= ([(g.prompt.index, [s.output_ids for s in g.samples]) for g in batch.groups]
                                      == [(i, [s.output_ids for s in g]) for i, g in full])
                    print(f"step {step}: {name}: {batch.metrics.groups_generated} groups generated, "
                          f"{batch.metrics.groups_aborted} aborted, kept {[g.prompt.index for g in batch.groups]}",
                          flush=True)

    print(f"== dynamic sampling, B {args.batch} x G {args.group}, oversample {args.oversample}, {args.steps} steps, "
          f"responses of 1-{args.max_new_tokens} tokens, SGLang CPU server (deterministic), {args.threads} thread(s) ==")
    print(f"{'rule':>24} | {'samples / kept sample':>21} | {'rollout s / step':>16} | {'kept len mean':>13} | "
          f"{'full-gen len mean':>17} | {'kept / full len':>15}")
    rows = {}
    for name, st in stats.items():
        row = (st["samples"] / st["kept_samples"], st["seconds"] / args.steps, mean_len(st["kept"]),
               mean_len(st["full"]))
        rows[name] = row
        print(f"{name:>24} | {row[0]:>21.2f} | {row[1]:>16.1f} | {row[2]:>13.1f} | {row[3]:>17.1f} | "
              f"{row[2] / row[3]:>15.2f}")
    (a, b) = rows.values()
    print(f"{'unbiased / completion':>24} | {b[0] / a[0]:>20.2f}x | {b[1] / a[1]:>15.2f}x | "
          f"{b[2] / a[2]:>12.2f}x | {'':>17} | {(b[2] / b[3]) / (a[2] / a[3]):>14.2f}x")
    print(f"the unbiased batch equals the full-generation batch (prompts and samples): {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
