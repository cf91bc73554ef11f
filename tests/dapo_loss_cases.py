"""Inputs and comparisons shared by the CPU and GPU tests of the fused DAPO loss."""

import torch

EPS_LOW, EPS_HIGH = 0.2, 0.28
KW = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)


def make_batch(n, seed, *, dtype=torch.float32, mask_dtype=torch.bool, adv_dtype=torch.float32, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(n, generator=g, dtype=torch.float64)
    old_logp = logp + spread * torch.randn(n, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    keep = torch.rand(n, generator=g) > 0.2
    mask = keep if mask_dtype == torch.bool else keep.to(mask_dtype) * torch.rand(n, generator=g)
    return logp.to(dtype), old_logp.to(dtype), advantages.to(adv_dtype), mask


def run(fn, logp, old_logp, advantages, mask, **kw):
    x = logp.detach().clone().requires_grad_()
    loss, stats = fn(x, old_logp, advantages, mask, **{**KW, **kw})
    loss.backward()
    return loss.detach(), x.grad, stats


def away_from_clip_edges(logp, old_logp, dual_clip_c=None, margin=1e-5):
    """Tokens whose ratio is not within rounding of a clip boundary, where fp32 may take either branch."""
    r = torch.exp((logp.double() - old_logp.double()).clamp(-20, 20))
    edges = [1 - EPS_LOW, 1 + EPS_HIGH] + ([dual_clip_c] if dual_clip_c else [])
    return torch.stack([(r - e).abs() > margin * e for e in edges]).all(0)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
