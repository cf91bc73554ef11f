"""Argument checks and the stats record shared by the fused DAPO loss and its reference."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_dapo.ops.loss_settings import check_dapo_loss_params

# Slot order of the stats vector written by the kernels (csrc/dapo_loss_math.h, enum Stat).
STAT_NAMES = (
    "clipped_low",
    "clipped_high",
    "dual_clipped",
    "ratio_sum",
    "ratio_max",
    "k3_kl_sum",
    "num_tokens",
)

LOGP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class DapoLossStats(NamedTuple):
    """Per-call statistics over the tokens whose mask is non-zero, as float64 0-d tensors (no host sync).

    Counts and sums add across micro-batches and ranks; ratio_max takes the max.
    """

    clipped_low: torch.Tensor  # tokens with A < 0 and r < 1 - eps_low (no gradient)
    clipped_high: torch.Tensor  # tokens with A > 0 and r > 1 + eps_high (no gradient)
    dual_clipped: torch.Tensor  # tokens with A < 0 whose loss was capped at -dual_clip_c * A
    ratio_sum: torch.Tensor  # sum of r = exp(clamp(logp - old_logp))
    ratio_max: torch.Tensor  # max of r (0 when no token is masked in)
    k3_kl_sum: torch.Tensor  # sum of r - 1 - log r, the k3 estimate of KL(old || current)
    num_tokens: torch.Tensor  # tokens with a non-zero mask

    @classmethod
    def from_vector(cls, stats: torch.Tensor) -> DapoLossStats:
        return cls(*stats.unbind(0))


def _as_normalizer(normalizer) -> float:
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"dapo_loss: normalizer must be a number or a one-element tensor, got {tuple(normalizer.shape)}")
        if normalizer.device.type != "cpu":
            raise ValueError("dapo_loss: normalizer is a tensor on the device, which the op would have to read on the "
                             "host (a sync that stalls the GPU's queue): pass a Python number or a host tensor")
        normalizer = normalizer.item()
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise TypeError(f"dapo_loss: normalizer must be a number (the step's loss-token count), got {type(normalizer).__name__}")
    if not math.isfinite(normalizer) or normalizer <= 0:
        raise ValueError(f"dapo_loss: normalizer must be > 0 (the loss-token count of the whole step), got {normalizer}")
    return float(normalizer)


def _check_tensor(t, name: str, logp: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"dapo_loss: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"dapo_loss: {name} must be 1-D (one entry per token), got shape {tuple(t.shape)}")
    if t.numel() != logp.numel():
        raise ValueError(f"dapo_loss: {name} has {t.numel()} tokens but logp has {logp.numel()}")
    if t.device != logp.device:
        raise ValueError(f"dapo_loss: {name} is on {t.device} but logp is on {logp.device}")


def check_dapo_loss_args(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low,
    eps_high,
    normalizer,
    dual_clip_c,
    log_ratio_clamp,
    ref_logp,
    kl_coef,
    kl_type,
) -> float:
    """Raises TypeError / ValueError naming the bad argument; returns the normalizer as a float."""
    if not isinstance(logp, torch.Tensor):
        raise TypeError(f"dapo_loss: logp must be a torch.Tensor, got {type(logp).__name__}")
    if logp.dim() != 1:
        raise ValueError(f"dapo_loss: logp must be 1-D (one entry per token), got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        _check_tensor(t, name, logp)
    if logp.dtype not in LOGP_DTYPES:
        raise TypeError(f"dapo_loss: logp must be float32, bfloat16, float16 or float64, got {logp.dtype}")
    if old_logp.dtype != logp.dtype:
        raise TypeError(f"dapo_loss: old_logp must have logp's dtype {logp.dtype}, got {old_logp.dtype}")
    if advantages.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dapo_loss: advantages must be float32 or float64, got {advantages.dtype}")
    if mask.dtype not in (torch.bool, torch.float32):
        raise TypeError(f"dapo_loss: mask must be bool or float32, got {mask.dtype}")
    check_dapo_loss_params(eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c,
                           log_ratio_clamp=log_ratio_clamp, kl_coef=kl_coef, kl_type=kl_type)
    if kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("dapo_loss: kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
        _check_tensor(ref_logp, "ref_logp", logp)
    return _as_normalizer(normalizer)
