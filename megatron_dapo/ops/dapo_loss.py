"""Fused DAPO loss: the C++/CUDA kernel (csrc/) as a torch.library op, its autograd in C++ too.

One kernel pass computes the token-level clipped-surrogate loss, its stats and d loss / d logp in the compute
dtype; the backward (csrc/dapo_loss_autograd.cpp) only scales that saved gradient by the upstream gradient and
rounds the product once to logp's dtype: in place for fp32 / fp64 logp unless the graph is retained, and the kernel
skips even that when the upstream gradient is 1 (loss.backward()). Here: the checks, and the shapes the compiler
traces with. The readable definition is dapo_loss_reference.

`megatron_dapo.ops.dapo_loss` is the function below however it is imported (the package keeps it so).
"""

from __future__ import annotations

import torch

from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES, DapoLossStats, check_dapo_loss_args
from megatron_dapo.ops.host_sync import no_host_sync
from megatron_dapo.ops.kl_penalty import kl_penalty

try:
    from megatron_dapo import _C  # noqa: F401  (importing registers torch.ops.megatron_dapo)

    _EXTENSION_ERROR: str | None = None
except ImportError as exc:
    _EXTENSION_ERROR = (
        f"megatron_dapo._C could not be imported ({exc}); build it with `pip install --no-build-isolation -e .` "
        "from the repository root (the README's setup does this)"
    )


def extension_error() -> str | None:
    """Why the compiled extension is unavailable, or None when it loaded."""
    return _EXTENSION_ERROR


if _EXTENSION_ERROR is None:

    @torch.library.register_fake("megatron_dapo::dapo_loss_fwd")
    def _dapo_loss_fwd_fake(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer, dual_clip_c,
                            log_ratio_clamp, compute_grad):
        compute_dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
        loss = logp.new_empty((), dtype=compute_dtype)
        stats = logp.new_empty((len(STAT_NAMES),), dtype=torch.float64)
        grad = logp.new_empty((logp.numel() if compute_grad else 0,), dtype=compute_dtype)
        return loss, stats, grad

    @torch.library.register_fake("megatron_dapo::dapo_loss")
    def _dapo_loss_fake(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer, dual_clip_c,
                        log_ratio_clamp):
        loss, stats, _ = _dapo_loss_fwd_fake(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                             dual_clip_c, log_ratio_clamp, False)
        return loss, stats

    @torch.library.register_fake("megatron_dapo::dapo_loss_scale_grad_")
    def _dapo_loss_scale_grad_fake(grad, grad_output):
        return None


def dapo_loss(
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
    """Token-level DAPO loss of one packed micro-batch, and its stats.

    Per token: r = exp(clamp(logp - old_logp, +-log_ratio_clamp)), loss -min(r*A, clip(r, 1-eps_low,
    1+eps_high)*A), capped at -dual_clip_c*A for A < 0 when dual_clip_c is set. The result is the sum
    over tokens with a non-zero mask (a float mask weights each token) divided by normalizer, the loss-
    token count of the whole step (all micro-batches, all data-parallel ranks), so the gradient does
    not depend on how the step is split. With kl_coef > 0, kl_coef * kl_penalty(logp, ref_logp) is
    added (plain PyTorch, not fused).

    logp (fp32/bf16/fp16/fp64, may require grad), old_logp (same dtype), advantages (fp32/fp64) and mask
    (bool/fp32) are 1-D with one entry per token; computation is fp32 (fp64 for fp64 inputs).

    Autograd: first-order gradients in logp, in reverse mode (backward, torch.autograd.grad), the graph freed or
    retained, a batch of upstream gradients (is_grads_batched, jacobian(vectorize=True)), torch.compile and compiled
    autograd. The upstream gradient (a loss scale, say) multiplies the fp32 gradient and the product is rounded once
    to logp's dtype. Refused with NotImplementedError, rather than silently wrong: second-order gradients (double
    backward, Hessians), forward-mode AD (torch.func.jvp, torch.autograd.forward_ad), old_logp, advantages or a
    float mask that require grad, and gradients inside torch.func's transforms. dapo_loss_reference supports them
    all. A NaN advantage on a masked-in token gives a NaN loss and a NaN gradient for that token, as the reference.
    """
    normalizer = check_dapo_loss_args(
        logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, normalizer=normalizer,
        dual_clip_c=dual_clip_c, log_ratio_clamp=log_ratio_clamp, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_type=kl_type,
    )
    if _EXTENSION_ERROR is not None:
        raise RuntimeError(_EXTENSION_ERROR)
    with no_host_sync("dapo_loss"):
        loss, stats = torch.ops.megatron_dapo.dapo_loss(
            logp, old_logp, advantages, mask, float(eps_low), float(eps_high), normalizer,
            None if dual_clip_c is None else float(dual_clip_c), float(log_ratio_clamp),
        )
        if kl_coef > 0.0:
            loss = loss + kl_coef * kl_penalty(logp, ref_logp, mask, kl_type=kl_type, normalizer=normalizer)
        return loss, DapoLossStats.from_vector(stats)
