"""The DAPO clipped surrogate in plain PyTorch: the readable definition the fused op is held to."""

from __future__ import annotations

import torch

from megatron_dapo.ops.dapo_loss_checks import DapoLossStats, check_dapo_loss_args
from megatron_dapo.ops.kl_penalty import kl_penalty


def dapo_loss_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    normalizer,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float = 20.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
) -> tuple[torch.Tensor, DapoLossStats]:
    """See megatron_dapo.ops.dapo_loss; same arguments, same results, computed op by op."""
    normalizer = check_dapo_loss_args(
        logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, normalizer=normalizer,
        dual_clip_c=dual_clip_c, log_ratio_clamp=log_ratio_clamp, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_type=kl_type,
    )
    compute = torch.float64 if logp.dtype == torch.float64 else torch.float32
    adv = advantages.to(compute)
    active = mask != 0
    weight = mask.to(compute)

    log_ratio = torch.clamp(logp.to(compute) - old_logp.to(compute), -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    token_loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    dual = torch.zeros_like(active)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv
        dual = (adv < 0) & (token_loss > cap)
        token_loss = torch.where(dual, cap, token_loss)
    # Token-level: every token of the step weighs the same, whatever its sequence's length.
    loss = torch.where(active, token_loss * weight, 0.0).sum() / normalizer
    if kl_coef > 0.0:
        loss = loss + kl_coef * kl_penalty(logp, ref_logp, mask, kl_type=kl_type, normalizer=normalizer)

    with torch.no_grad():
        r = ratio.detach()
        f64 = torch.float64
        stats = DapoLossStats(
            clipped_low=((adv < 0) & (r < 1.0 - eps_low) & active).sum().to(f64),
            clipped_high=((adv > 0) & (r > 1.0 + eps_high) & active).sum().to(f64),
            dual_clipped=(dual & active).sum().to(f64),
            ratio_sum=torch.where(active, r, 0.0).sum().to(f64),
            ratio_max=torch.where(active, r, 0.0).max().to(f64) if r.numel() else r.new_zeros((), dtype=f64),
            k3_kl_sum=torch.where(active, r - 1.0 - log_ratio.detach(), 0.0).sum().to(f64),
            num_tokens=active.sum().to(f64),
        )
    return loss, stats


def sample_level_loss_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    response_lens: list[int],
    **kwargs,
) -> torch.Tensor:
    """GRPO's sample-level loss (loss.aggregation "sample") by its definition: each response's clipped terms
    averaged over its own loss tokens, then those means averaged over the responses that have any; `kwargs` are
    dapo_loss_reference's clipping settings. The tokens are packed response after response, `response_lens`
    long."""
    if sum(response_lens) != logp.numel():
        raise ValueError(f"sample_level_loss_reference: response_lens sum to {sum(response_lens)}, "
                         f"for {logp.numel()} tokens")
    means = []
    for lp, old, adv, m in zip(*(t.split(response_lens) for t in (logp, old_logp, advantages, mask))):
        if m.any():
            means.append(dapo_loss_reference(lp, old, adv, m, normalizer=float(m.sum()), **kwargs)[0])
    return torch.stack(means).mean() if means else logp.sum() * 0.0
