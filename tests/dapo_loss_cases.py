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


def upstream_grad(fn, logp, old_logp, advantages, mask, upstream, *, retain_graph=False, **kw):
    """d (upstream * loss) / d logp, the upstream gradient given to torch.autograd.grad, the graph freed or kept."""
    x = logp.detach().clone().requires_grad_()
    loss, _ = fn(x, old_logp, advantages, mask, **{**KW, **kw})
    (grad,) = torch.autograd.grad(loss, x, torch.tensor(upstream, dtype=loss.dtype, device=loss.device),
                                  retain_graph=retain_graph)
    return grad


# (logp dtype, normalizer, upstream gradient): an fp16 loss scale of 2^16; a large normaliser, whose unit gradient
# alone would be subnormal in fp16; a scale that no 16-bit float holds; the plain loss.backward().
LOSS_SCALES = [(torch.float16, 100, 2.0**16), (torch.float16, 1e6, 4096.0), (torch.bfloat16, 100, 1 / 3),
               (torch.bfloat16, 30_000, 1.0)]


def assert_within_twice_the_reference(grad, grad_ref, grad_64, keep):
    """The suite's bar for 16-bit results: the fused op's error against float64 is at most twice the reference's own
    (the reference computed in the same dtype), by the largest error and by the median per-token one, and no token
    is flushed to 0 or overflows where the reference's is not. The floor is fp32 round-off: where the reference's
    own error is below it, "2x" is noise."""
    floor = 1e-6
    g, r, t = grad[keep].double(), grad_ref[keep].double(), grad_64[keep].double()
    assert torch.isfinite(g).all() and torch.isfinite(r).all()
    assert ((g == 0) & (r != 0)).sum().item() == 0
    assert rel_err(g, t) <= 2 * rel_err(r, t) + floor
    nonzero = t != 0

    def median_rel(a):
        return ((a - t).abs()[nonzero] / t.abs()[nonzero]).median().item()

    assert median_rel(g) <= 2 * median_rel(r) + floor
