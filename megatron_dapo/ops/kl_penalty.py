"""Optional KL penalty against a frozen reference policy (off by default: DAPO drops it).

It is plain PyTorch, added to the fused loss by autograd: it is a second, optional term and not on
DAPO's default path, so it is not fused.
"""

import torch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, *, kl_type: str, normalizer: float):
    """Token-level sum of the KL(current || reference) estimate over masked tokens, divided by normalizer.

    k1 = logp - ref_logp; k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (non-negative, lower variance).
    """
    compute = torch.float64 if logp.dtype == torch.float64 else torch.float32
    log_ratio = ref_logp.to(compute) - logp.to(compute)
    if kl_type == "k1":
        per_token = -log_ratio
    elif kl_type == "k3":
        per_token = torch.exp(log_ratio) - log_ratio - 1.0
    else:
        raise ValueError(f"kl_penalty: kl_type must be 'k1' or 'k3', got {kl_type!r}")
    weight = mask.to(compute)
    return torch.where(mask != 0, per_token * weight, 0.0).sum() / normalizer
