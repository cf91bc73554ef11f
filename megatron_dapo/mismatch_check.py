"""`megatron-dapo mismatch CONFIG`: how far the run's servers are from its trainer, before a run is spent on them.

It samples a few groups of the run's own prompts (data.train_path, encoded as the run encodes them) from the
servers of rollout.server_urls at the run's temperature, recomputes their log-probs with the policy at the
trainer's layout and precision (model.path's weights; under torchrun for TP / PP > 1, the run's ranks) as the old
log-prob pass does, the servers' routes replayed with rollout.routing_replay, and prints the mismatch by response
position: mean and largest |log pi_trainer - log pi_engine|, the k3 estimate of KL(engine || trainer), and the share
of tokens IcePop's band would mask. It exits 1 when the mean |log-ratio| over all tokens is past the threshold
(servers serving other weights, another temperature or a broken kernel), 0 otherwise. What the start-up check of a
run does (rollout/logprob_check.py) as a tool, with a table and a threshold of the user's.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.config import ConfigError
from megatron_dapo.ops.loss_settings import CORRECTION_PRESETS
from megatron_dapo.rollout.logprob_check import DEFAULT_ATOL
from megatron_dapo.run_config import DapoConfig

# Response positions, the buckets' lower ends: mismatch grows along a response where kernels' errors accumulate.
BUCKETS = (0, 16, 64, 256, 1024, 4096)
ICEPOP_LOWER, ICEPOP_UPPER = CORRECTION_PRESETS["icepop"][2:]


@dataclass(frozen=True)
class MismatchRow:
    positions: str  # "0-15", ..., "4096+", or "all"
    tokens: int
    abs_mean: float  # mean |log pi_trainer - log pi_engine|
    abs_max: float
    k3: float  # mean k3 estimate of KL(engine || trainer), on the engine's samples
    icepop_masked: float  # share of tokens whose ratio is outside IcePop's band


def mismatch_table(engine_logp: list[list[float]], trainer_logp: list[list[float]]) -> list[MismatchRow]:
    """Per response-position bucket with tokens, then over all tokens; each argument one list per response."""
    by_bucket: dict[int, list[float]] = {b: [] for b in BUCKETS}
    for engine, trainer in zip(engine_logp, trainer_logp):
        for pos, (e, t) in enumerate(zip(engine, trainer)):
            by_bucket[max(b for b in BUCKETS if b <= pos)].append(t - e)
    rows = []
    for i, b in enumerate(BUCKETS):
        if by_bucket[b]:
            label = f"{b}-{BUCKETS[i + 1] - 1}" if i + 1 < len(BUCKETS) else f"{b}+"
            rows.append(_row(label, by_bucket[b]))
    rows.append(_row("all", [r for b in BUCKETS for r in by_bucket[b]]))
    return rows


def _row(label: str, r: list[float]) -> MismatchRow:
    n = max(len(r), 1)
    outside = sum(not ICEPOP_LOWER <= math.exp(min(x, 50.0)) <= ICEPOP_UPPER for x in r)
    return MismatchRow(label, len(r), sum(abs(x) for x in r) / n, max((abs(x) for x in r), default=0.0),
                       sum(math.exp(x) - x - 1 for x in r) / n, outside / n)


def format_table(rows: list[MismatchRow]) -> str:
    lines = [f"| positions | tokens | mean abs log-ratio | max abs log-ratio | k3 KL | IcePop [{ICEPOP_LOWER:g}, "
             f"{ICEPOP_UPPER:g}] masks |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.positions} | {r.tokens} | {r.abs_mean:.3g} | {r.abs_max:.3g} | {r.k3:.3g} | "
              f"{100 * r.icepop_masked:.2f}% |" for r in rows]
    return "\n".join(lines)


def _check_config(cfg: DapoConfig) -> None:
    if cfg.rollout.engine != "sglang" or not cfg.rollout.server_urls:
        raise ConfigError("rollout.server_urls: the mismatch check samples from running servers; give their URLs "
                          "(rollout.engine 'sglang'), e.g. rollout.server_urls=[http://host:30000]")


def _prompts(cfg: DapoConfig, count: int) -> list[list[int]]:
    """The first `count` prompts of data.train_path that fit data.max_prompt_len, encoded as the run encodes them."""
    from transformers import AutoTokenizer

    from megatron_dapo.data.prompt_file import load_prompt_rows
    from megatron_dapo.data.prompt_source import PromptSource

    rows, _ = load_prompt_rows(cfg.data.train_path)
    source = PromptSource(rows, None, AutoTokenizer.from_pretrained(cfg.model.path),
                          max_prompt_len=cfg.data.max_prompt_len, chat_template=cfg.data.chat_template,
                          name=cfg.data.train_path)
    # the run's own encoding and length rule; only as many rows encoded as it takes
    prompts = list(itertools.islice((ids for ids in map(source.encode, rows) if ids is not None), count))
    if not prompts:
        raise ConfigError(f"data.max_prompt_len: no prompt of {cfg.data.train_path} fits its "
                          f"{cfg.data.max_prompt_len} tokens; raise it")
    return prompts


def run_mismatch_check(cfg: DapoConfig, *, prompts: int = 8, samples: int = 4, max_new_tokens: int = 256,
                       threshold: float = DEFAULT_ATOL, seed: int = 0) -> tuple[list[MismatchRow], bool]:
    """Every rank of the trainer's layout (collective; init_runtime is done here): the table, and whether the mean
    |log-ratio| over all tokens is within `threshold`. Sampling at the run's temperature and top_p, `samples`
    responses to each of `prompts` prompts, each of up to `max_new_tokens` (and algorithm.max_response_len)."""
    from megatron.core import parallel_state

    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.policy_from_hf import open_hf_checkpoint
    from megatron_dapo.parallel.runtime import builds_for_gpu, driver_call, init_runtime, shutdown_runtime
    from megatron_dapo.policy.forward import logprob_recomputer
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.routes import RouteLayout
    from megatron_dapo.rollout.server_check import check_servers_answer
    from megatron_dapo.rollout.sglang_engine import SGLangEngine

    _check_config(cfg)
    runtime = init_runtime(cfg.parallel)
    try:
        # seconds, before the policy's minutes of building
        driver_call(lambda: check_servers_answer(cfg.rollout.server_urls, cfg.rollout.server_health_timeout_s))
        hf, spec = open_hf_checkpoint(cfg.model)
        replay = cfg.rollout.routing_replay
        model = build_model(spec, cfg.parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(), routing_replay=replay,
                            params_dtype=getattr(torch, cfg.model.training_dtype(builds_for_gpu(cfg.parallel))))
        load_hf_weights(model, hf.get, spec, cfg.parallel)
        recompute = logprob_recomputer(model.eval(), vocab_size=spec.vocab_size,
                                       max_positions=spec.max_position_embeddings,
                                       max_tokens_per_micro_batch=cfg.model.max_tokens_per_micro_batch,
                                       device=runtime.device, packed=cfg.model.packing)

        def sample():
            params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=seed,
                                    max_new_tokens=min(max_new_tokens, cfg.algorithm.max_response_len))
            batch = _prompts(cfg, prompts)
            engine = SGLangEngine(list(cfg.rollout.server_urls), max_server_restarts=0,
                                  request_timeout_s=cfg.rollout.request_timeout_s,
                                  routes=RouteLayout.of(spec) if replay else None)
            try:
                return [(batch[s.prompt_index], list(s.output_ids), list(s.logprobs), s.routes)
                        for g in engine.generate(batch, samples, params) for s in g]
            finally:
                engine.close()

        body = driver_call(sample)
        trainer = recompute([(p, o, routes) for p, o, _, routes in body], cfg.rollout.temperature)
        rows = mismatch_table([lp for _, _, lp, _ in body], trainer)
        return rows, rows[-1].abs_mean <= threshold
    finally:
        shutdown_runtime()


def write_json(path, rows: list[MismatchRow], threshold: float, ok: bool) -> None:
    with open(path, "w") as f:
        json.dump({"threshold": threshold, "ok": ok, "rows": [r.__dict__ for r in rows]}, f, indent=1)
