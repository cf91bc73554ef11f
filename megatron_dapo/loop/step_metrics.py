"""A step's time split and the metrics of its updates."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

from megatron_dapo.config import LossConfig
from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
from megatron_dapo.policy.mismatch import mismatch_metrics, reduce_mismatch


class StepTimer:
    def __init__(self, on_enter=lambda name: None):
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter  # told each section's name as it starts

    @contextmanager
    def __call__(self, name: str):
        self.on_enter(name)
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def train_metrics(results, sums, maxima, loss: LossConfig, agreement: list[float] | None = None
                  ) -> dict[str, float]:
    """The step's updates (`results`: policy.train_step.StepResult) and, unless loss.old_logprobs is "rollout",
    the old policy's pass (`sums`, `maxima`: policy.mismatch; `agreement`: its routing agreement per MoE layer,
    else the first update's) in the metrics' terms."""
    stats = {k: sum(r.stats[k] for r in results) for k in STAT_NAMES if k != "ratio_max"}
    loss_tokens = max(stats["num_tokens"], 1.0)
    out = {
        # Each update's loss weighted by what it averaged over: the whole batch's loss under loss.aggregation.
        "loss": sum(r.loss * r.units for r in results) / max(sum(r.units for r in results), 1.0),
        "grad_norm": max((r.grad_norm for r in results if r.applied), default=math.nan),
        "lr": results[-1].lr,
        "clip_frac/low": stats["clipped_low"] / loss_tokens,
        "clip_frac/high": stats["clipped_high"] / loss_tokens,
        "clip_frac/dual": stats["dual_clipped"] / loss_tokens,
        "ratio_mean": stats["ratio_sum"] / loss_tokens,
        "ratio_max": max(r.stats["ratio_max"] for r in results),
        "approx_kl": stats["k3_kl_sum"] / loss_tokens,
        "loss_tokens": stats["num_tokens"],
        "updates": len(results),
        "updates_skipped": sum(not r.applied for r in results),
    }
    balance = [r.load_balancing_loss for r in results if r.load_balancing_loss is not None]
    if balance:  # a mixture of experts' load-balancing loss (model.moe_aux_loss_coef > 0), before its coefficient
        out["moe/load_balancing_loss"] = sum(balance) / len(balance)
    loads = [r.expert_load for r in results if r.expert_load is not None]
    if loads:  # a mixture of experts: per MoE layer, the busiest expert over the mean one, averaged over the updates
        per_layer = [sum(layer) / len(loads) for layer in zip(*loads)]
        out["moe/expert_load/max"] = max(per_layer)
        out["moe/expert_load/mean"] = sum(per_layer) / len(per_layer)
        out.update({f"moe/expert_load_by_layer/{i:02d}": v for i, v in enumerate(per_layer)})
    agreement = agreement if agreement is not None else results[0].routing_agreement
    if agreement is not None:  # routing replay: the share of response tokens whose own top-k is the rollout's
        out["moe/routing_agreement"] = sum(agreement) / len(agreement)
        out.update({f"moe/routing_agreement_by_layer/{i:02d}": v for i, v in enumerate(agreement)})
    recomputed = loss.old_logprobs != "rollout"
    if not recomputed:  # no old policy's pass: the entropy of the updates' forwards, and no mismatch
        out["entropy"] = sum(r.entropy_mean * r.stats["num_tokens"] for r in results) / loss_tokens
        if loss.kl_coef == 0:
            return out
    m = reduce_mismatch(sums, maxima)
    tokens = max(m["tokens"], 1.0)
    if recomputed:
        out.update({"entropy": m["entropy_sum"] / tokens, **mismatch_metrics(m, loss.correction.enabled)})
    if loss.kl_coef > 0:  # how far the sampling policy is from the KL term's reference
        out["kl_reference"] = m["reference_k3_sum"] / tokens
    return out
