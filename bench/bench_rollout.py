"""Rollout tokens/s: a real SGLang server vs the in-process local engine, same prompts, same model.

Makes the tiny random Qwen2 of the tests (with its trained tokenizer) unless --model names a Hugging
Face folder, then, in one run: starts an SGLang server on it (CPU flags on the CPU), samples every
case through SGLangEngine, stops the server, loads the same weights into the Megatron policy
(TP = PP = 1, gloo world of one) and samples the same cases through LocalEngine. Responses have a
fixed length (ignore_eos), so both engines produce the same number of tokens; a warm-up request
first for each. tokens/s counts generated tokens over the wall time of `generate`.

    python bench/bench_rollout.py [--cases 8x4x64,32x8x64] [--threads 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig

TESTS = Path(__file__).resolve().parent.parent / "tests" / "distributed"


@dataclass(frozen=True)
class Case:
    prompts: int
    n: int
    new_tokens: int

    @classmethod
    def parse(cls, text: str) -> Case:
        try:
            prompts, n, new_tokens = (int(x) for x in text.split("x"))
        except ValueError:
            raise SystemExit(f"--cases: {text!r} is not PROMPTSxNxNEW_TOKENS, e.g. 8x4x64") from None
        return cls(prompts, n, new_tokens)

    def __str__(self) -> str:
        return f"{self.prompts} x {self.n} x {self.new_tokens}"


def make_prompts(case: Case, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (case.prompts,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


def timed_rollout(engine, prompts: list[list[int]], case: Case) -> tuple[int, float]:
    params = SamplingParams(temperature=1.0, max_new_tokens=case.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    groups = engine.generate(prompts, case.n, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for g in groups for s in g)
    if tokens != case.prompts * case.n * case.new_tokens:
        raise RuntimeError(f"{type(engine).__name__} returned {tokens} tokens for case {case}")
    return tokens, seconds


def bench_sglang(model_dir: Path, cases, prompts, threads: int, log: Path) -> list[tuple[int, float]]:
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the server's torch threads
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"  # where SGLang pins cores (AMX / arm64 CPUs)
    config = SGLangServerConfig(str(model_dir), device="cpu", dtype="float32", max_total_tokens=65536,
                                startup_timeout_s=600)
    with SGLangServer(config, log) as server:
        engine = SGLangEngine(server.url)
        timed_rollout(engine, prompts[0][:2], Case(2, 2, 4))
        return [timed_rollout(engine, p, c) for c, p in zip(cases, prompts)]


def bench_local(model_dir: Path, cases, prompts, threads: int) -> list[tuple[int, float]]:
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.rollout.local_engine import LocalEngine, hf_eos_token_ids

    torch.set_num_threads(threads)
    parallel = ParallelConfig(device="cpu")
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    runtime = init_runtime(parallel, environ=env)
    try:
        ckpt = HFCheckpoint(model_dir)
        spec = model_spec_from_hf(ckpt.config)
        model = build_model(spec, parallel, pre_process=True, post_process=True)
        load_hf_weights(model, ckpt.get, spec, parallel)
        engine = LocalEngine(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                             eos_token_ids=hf_eos_token_ids(ckpt.config), device=runtime.device)
        timed_rollout(engine, prompts[0][:2], Case(2, 2, 4))
        return [timed_rollout(engine, p, c) for c, p in zip(cases, prompts)]
    finally:
        shutdown_runtime()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="8x4x64,32x8x64", help="PROMPTSxNxNEW_TOKENS, comma separated")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU threads for each engine (the server's bound cores, the local engine's torch threads)")
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: the tests' tiny Qwen2)")
    args = parser.parse_args()
    cases = [Case.parse(c) for c in args.cases.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            sys.path.insert(0, str(TESTS))
            from tiny_models import save_with_tokenizer

            model_dir = Path(tmp) / "model"
            save_with_tokenizer(model_dir)
        from megatron_dapo.policy.hf_config import model_spec_from_hf

        spec = model_spec_from_hf(model_dir)
        for c in cases:
            if 24 + c.new_tokens > spec.max_position_embeddings:
                raise SystemExit(f"--cases: {c} needs up to {24 + c.new_tokens} positions, the model has "
                                 f"{spec.max_position_embeddings}")
        prompts = [make_prompts(c, spec.vocab_size, seed=i) for i, c in enumerate(cases)]
        sglang = bench_sglang(model_dir, cases, prompts, args.threads, Path(tmp) / "server.log")
        local = bench_local(model_dir, cases, prompts, args.threads)

    print(f"== rollout tokens/s, {spec.num_layers} layers x hidden {spec.hidden_size}, vocab {spec.vocab_size}, "
          f"fp32, {args.threads} CPU thread(s), prompts of 8-24 tokens, fixed-length responses ==")
    print(f"{'prompts x n x new tokens':>26} | {'tokens':>7} | {'SGLang s':>9} | {'SGLang tok/s':>12} | "
          f"{'local s':>8} | {'local tok/s':>11} | {'local / SGLang':>14}")
    for case, (tokens, s_sec), (_, l_sec) in zip(cases, sglang, local):
        print(f"{str(case):>26} | {tokens:>7} | {s_sec:>9.2f} | {tokens / s_sec:>12.0f} | {l_sec:>8.2f} | "
              f"{tokens / l_sec:>11.0f} | {s_sec / l_sec:>13.2f}x")


if __name__ == "__main__":
    main()
