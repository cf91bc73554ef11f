"""Does the engine return the log-probs the trainer computes? A check at start for servers given by URL.

The trainer's old log-probs, PPO ratio, truncated-IS weights and mismatch metrics are those of
softmax(logits / rollout.temperature), the distribution the engine samples from, and they are compared
with the engine's own log-prob of each sampled token. SGLang servers return exactly that by default; a
server started elsewhere with SGLANG_RETURN_ORIGINAL_LOGPROB=1 returns log_softmax(logits) (temperature
1) instead, and one that serves other weights returns neither. Servers the trainer starts itself get
the right environment (rollout/sglang_server.py); servers given by rollout.server_urls are checked here.

`check_engine_logprobs` samples a few short responses at the run's temperature and compares the
engine's log-probs with the policy recomputing them at that temperature and at temperature 1. It is
collective: every trainer rank calls it (the recomputation runs the TP x PP model), the driver (global
rank 0) with the engine, the others with None. Every rank gets the same answer, or the same ConfigError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron_dapo.config import ConfigError
from megatron_dapo.parallel.runtime import driver_value
from megatron_dapo.rollout.engine import SamplingParams

log = logging.getLogger(__name__)

# (prompt_ids, output_ids, routes or None) triples, temperature -> each response's token log-probs, on global rank
# 0 (collective); routes: the engine's [positions, MoE layers, top_k], which a policy with routing replay replays.
Recompute = Callable[[list[tuple[list[int], list[int], object]], float], list[list[float]]]

# Mean |engine - recomputation| per token up to which two sets of log-probs count as equal: far above fp32
# noise (1e-6) and above bf16 SGLang-vs-Megatron noise (about 1e-2). Near temperature 1 the tempered and the
# untempered log-probs can differ by less; then the engine's are refused only when clearly closer to the latter.
DEFAULT_ATOL = 0.05


def check_prompts(count: int = 4, length: int = 8) -> list[list[int]]:
    """Short fixed prompts of token ids 3..252: ids every supported tokenizer holds (bytes or byte merges),
    past the special ids a few vocabularies put first. Their content does not matter; their odd mix gives
    responses of high entropy, where temperatures differ most."""
    return [[3 + (37 * i + 11 * j + i * j) % 250 for j in range(length)] for i in range(count)]


@dataclass(frozen=True)
class LogprobAgreement:
    tokens: int
    diff_tempered: float  # mean |engine - policy at the run's temperature| per token
    diff_untempered: float  # mean |engine - policy at temperature 1| per token
    temperature: float


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(abs(x - y) for x, y in pairs) / max(1, len(pairs))


def judge(engine_logp, tempered, untempered, temperature: float, atol: float = DEFAULT_ATOL) -> tuple[
        LogprobAgreement, str | None]:
    """The agreement, and the reason to refuse (None: the engine returns the tempered log-probs)."""
    tokens = sum(len(r) for r in engine_logp)
    a = LogprobAgreement(tokens, _mean_abs(engine_logp, tempered), _mean_abs(engine_logp, untempered), temperature)
    where = (f"over {tokens} sampled tokens, the engine's log-probs differ from the policy's at "
             f"rollout.temperature = {temperature:g} by {a.diff_tempered:.3g} and at temperature 1 by "
             f"{a.diff_untempered:.3g} (mean |difference| per token; up to {atol:g} counts as equal)")
    if tokens == 0:
        return a, "rollout.server_urls: the servers returned no tokens for the log-prob check"
    # Near temperature 1 both can be within atol: the tempered ones win unless the others are clearly closer.
    if a.diff_tempered <= atol and not a.diff_untempered < 0.5 * a.diff_tempered:
        return a, None
    if a.diff_untempered <= atol:
        return a, (f"rollout.server_urls: the servers return temperature-1 log-probs, log_softmax(logits), but the "
                   f"trainer's are those of softmax(logits / rollout.temperature), the distribution sampled from: "
                   f"{where}. A server started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 does this; restart it without "
                   "that variable")
    return a, (f"rollout.server_urls: the servers' log-probs match neither the policy's at rollout.temperature nor "
               f"at temperature 1: {where}. Do they serve model.path's weights (or the resumed checkpoint's), at "
               "the trainer's precision?")


def check_engine_logprobs(engine, recompute: Recompute, *, temperature: float,
                          prompts: list[list[int]] | None = None, n: int = 4, max_new_tokens: int = 16, seed: int = 0,
                          atol: float = DEFAULT_ATOL) -> LogprobAgreement:
    """Sample n responses to each prompt at `temperature` (top_p 1) on the driver's `engine` (None on the other
    ranks), recompute their log-probs at `temperature` and at 1 (`recompute`, collective, valid on global rank 0),
    and refuse with a ConfigError, on every rank, unless the engine's match the tempered ones."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    driver = not distributed or dist.get_rank() == 0
    payload = None
    if driver:
        prompts = prompts or check_prompts()
        try:
            params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
            groups = engine.generate(prompts, n, params)
            payload = ("ok", [(list(prompts[s.prompt_index]), list(s.output_ids), list(s.logprobs), s.routes)
                              for g in groups for s in g])
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait for samples forever
            payload = ("error", f"rollout.server_urls: sampling for the log-prob check failed: {type(e).__name__}: {e}")
    status, body = driver_value(payload) if distributed else payload
    if status == "error":
        raise ConfigError(body)
    responses = [(p, o, routes) for p, o, _, routes in body]
    tempered = recompute(responses, temperature)
    untempered = tempered if temperature == 1.0 else recompute(responses, 1.0)
    verdict = judge([lp for _, _, lp, _ in body], tempered, untempered, temperature, atol) if driver else None
    agreement, reason = driver_value(verdict) if distributed else verdict
    if reason is not None:
        raise ConfigError(reason)
    return agreement


def check_servers(urls: list[str], model, spec, *, temperature: float, max_tokens_per_micro_batch: int,
                  device, packed: bool = False) -> None:
    """Every trainer rank: the servers given by URL (rollout.server_urls) against the policy `model` (its stage on
    this rank); a ConfigError on every rank if they do not return its log-probs at `temperature`. A policy built
    with routing replay recomputes with the routes the servers return for the samples (it routes by nothing else)."""
    from megatron_dapo.policy.forward import logprob_recomputer
    from megatron_dapo.rollout.routes import RouteLayout
    from megatron_dapo.rollout.sglang_engine import SGLangEngine

    recompute = logprob_recomputer(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                                   max_tokens_per_micro_batch=max_tokens_per_micro_batch, device=device,
                                   packed=packed)
    replay = bool(getattr(model.config, "moe_enable_routing_replay", False))
    driver = dist.get_rank() == 0
    engine = SGLangEngine(list(urls), max_server_restarts=0, routes=RouteLayout.of(spec) if replay else None) \
        if driver else None
    try:
        a = check_engine_logprobs(engine, recompute, temperature=temperature)
    finally:
        if engine is not None:
            engine.close()
    if driver:
        log.info("rollout.server_urls: log-probs match the policy's at temperature %g (mean |diff| %.2g over %d "
                 "tokens; %.2g at temperature 1)%s", a.temperature, a.diff_tempered, a.tokens, a.diff_untempered,
                 ", the servers' routes replayed (rollout.routing_replay)" if replay else "")
