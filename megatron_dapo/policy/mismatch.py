"""How far the inference engine's probabilities are from the trainer's, and the truncated-IS weights.

Per loss token, log_ratio = log pi_old - log pi_rollout (the trainer's recomputation against the
engine's log-prob of the sampled token). The weight min(exp(log_ratio), cap) corrects the loss for
that mismatch (truncated importance sampling, loss.tis_cap), or, with loss.tis_mode "mask", exp(log_ratio)
up to the cap and 0 past it (the token left out). The metrics are sums over a rank's loss
tokens, kept on the rank's device and summed over the world once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MISMATCH_KEYS = ("tokens", "entropy_sum", "mismatch_k3_sum", "mismatch_abs_sum", "tis_weight_sum", "tis_capped",
                 "reference_k3_sum")


def tis_weights(log_ratio: torch.Tensor, cap: float, mode: str = "truncate") -> torch.Tensor:
    ratio = torch.exp(log_ratio)
    if mode == "mask":
        return torch.where(ratio > cap, torch.zeros_like(ratio), ratio)
    return ratio.clamp(max=cap)


def mismatch_sums(log_ratio: torch.Tensor, entropy: torch.Tensor | None, in_loss: torch.Tensor,
                  tis_cap: float | None, tis_mode: str = "truncate",
                  reference_log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sums (MISMATCH_KEYS, float64 [7]) and largest |log_ratio| ([1]) over the tokens where
    `in_loss`; every input is one entry per token, on the same device, and so are the results.
    `reference_log_ratio`: log pi_ref - log pi_old where the loss has a KL term (its k3 estimate of
    KL(old || reference) is summed; 0 without one). `entropy` None: nothing was recomputed (its sum is 0)."""
    r = log_ratio[in_loss].double()
    zero = r.new_zeros(())
    k3 = _k3(-r)  # KL(rollout || old), estimated on the rollout's samples
    ratio = torch.exp(r)
    sums = torch.stack([
        in_loss.sum().double(), entropy[in_loss].double().sum() if entropy is not None else zero, k3.sum(),
        r.abs().sum(),
        tis_weights(r, tis_cap, tis_mode).sum() if tis_cap is not None else zero,
        (ratio > tis_cap).sum().double() if tis_cap is not None else zero,
        _k3(reference_log_ratio[in_loss].double()).sum() if reference_log_ratio is not None else zero])
    abs_max = r.abs().max().reshape(1) if r.numel() else r.new_zeros(1)
    return sums, abs_max


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(p || q) per token sampled from p, given log q - log p: >= 0, unbiased."""
    return torch.exp(log_ratio) - log_ratio - 1


def reduce_mismatch(sums: torch.Tensor, abs_max: torch.Tensor) -> dict[str, float]:
    """Collective over all ranks: the world's sums by name (MISMATCH_KEYS), and "abs_max". Each data-parallel
    replica must contribute once: the other ranks pass zeros."""
    dist.all_reduce(sums)
    dist.all_reduce(abs_max, op=dist.ReduceOp.MAX)
    return {**dict(zip(MISMATCH_KEYS, sums.tolist())), "abs_max": abs_max.item()}
