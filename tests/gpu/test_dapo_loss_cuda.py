"""The CUDA kernels of the fused DAPO loss, against the CPU reference. Skipped where no GPU is present."""

import pytest
import torch
from dapo_loss_cases import (KW, LOSS_SCALES, assert_within_twice_the_reference, away_from_clip_edges, make_batch,
                             rel_err, run, upstream_grad)

from megatron_dapo import _C
from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def to_cuda(batch):
    return tuple(t.cuda() for t in batch)


def test_extension_was_built_with_cuda():
    assert _C.with_cuda, "a GPU is present but megatron_dapo._C has no CUDA kernels: rebuild with nvcc on PATH"


@pytest.mark.parametrize("n", [1, 7, 4096, 1_000_003])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("adv_dtype", [torch.float32, torch.float64])
def test_fp32_matches_reference(n, dual_clip_c, mask_dtype, adv_dtype):
    batch = make_batch(n, n, mask_dtype=mask_dtype, adv_dtype=adv_dtype)
    kw = dict(normalizer=max(1, n // 2), dual_clip_c=dual_clip_c)
    loss_g, grad_g, stats_g = run(dapo_loss, *to_cuda(batch), **kw)
    loss_r, grad_r, stats_r = run(dapo_loss_reference, *batch, **kw)
    keep = away_from_clip_edges(batch[0], batch[1], dual_clip_c)
    assert rel_err(loss_g.cpu(), loss_r) < 1e-6
    assert rel_err(grad_g.cpu()[keep], grad_r[keep]) < 1e-6
    for name, a, b in zip(STAT_NAMES, stats_g, stats_r):
        tol = (~keep).sum().item() if name.startswith(("clipped", "dual")) else 1e-6 * max(1.0, abs(b.item()))
        assert abs(a.item() - b.item()) <= tol, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_twice_the_reference(dtype):
    logp, old_logp, adv, mask = make_batch(200_000, 3, dtype=dtype)
    kw = dict(normalizer=200_000, dual_clip_c=3.0)
    loss_64, grad_64, _ = run(dapo_loss_reference, logp.double(), old_logp.double(), adv, mask, **kw)
    loss_g, grad_g, _ = run(dapo_loss, *to_cuda((logp, old_logp, adv, mask)), **kw)
    loss_r, grad_r, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, **kw)
    keep = away_from_clip_edges(logp, old_logp, 3.0, margin=1e-3)
    assert rel_err(loss_g.cpu(), loss_64) <= 2 * rel_err(loss_r, loss_64) + 1e-6
    assert rel_err(grad_g.cpu()[keep], grad_64[keep]) <= 2 * rel_err(grad_r[keep], grad_64[keep]) + 1e-6


def test_forward_and_backward_never_wait_for_the_gpu():
    """No device-to-host read inside dapo_loss, its C++ backward included: CUDA's sync debug mode raises on one."""
    logp, old_logp, adv, mask = to_cuda(make_batch(100_000, 9))
    x = logp.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = dapo_loss(x, old_logp, adv, mask, normalizer=50_000, dual_clip_c=3.0, **KW)
        (2.0 * loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and stats.num_tokens.item() > 0


def test_gradcheck_float64():
    logp, old_logp, adv, mask = make_batch(256, 7, dtype=torch.float64, spread=0.5)
    keep = away_from_clip_edges(logp, old_logp, 2.5, margin=1e-3)
    logp, old_logp, adv, mask = to_cuda((logp[keep], old_logp[keep], adv[keep], mask[keep]))
    x = logp.clone().requires_grad_()
    fn = lambda t: dapo_loss(t, old_logp, adv, mask, normalizer=17, dual_clip_c=2.5, **KW)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_unaligned_slices_take_the_scalar_path():
    batch = to_cuda(make_batch(10_001, 5))
    sliced = tuple(t[1:] for t in batch)  # 4-byte offset: no 16-byte loads
    loss_s, grad_s, _ = run(dapo_loss, *sliced, normalizer=5000)
    loss_c, grad_c, _ = run(dapo_loss, *(t.contiguous().clone() for t in sliced), normalizer=5000)
    assert loss_s.item() == loss_c.item()
    torch.testing.assert_close(grad_s, grad_c, rtol=0, atol=0)


def test_deterministic_and_scaled_backward():
    batch = to_cuda(make_batch(2_000_000, 9))
    first = run(dapo_loss, *batch, normalizer=10_000, dual_clip_c=3.0)
    second = run(dapo_loss, *batch, normalizer=10_000, dual_clip_c=3.0)
    assert first[0].item() == second[0].item() and torch.equal(first[1], second[1])
    assert all(a.item() == b.item() for a, b in zip(first[2], second[2]))
    x = batch[0].clone().requires_grad_()
    loss, _ = dapo_loss(x, *batch[1:], normalizer=10_000, dual_clip_c=3.0, **KW)
    (loss * -1.5).backward()
    torch.testing.assert_close(x.grad, -1.5 * first[1])


def test_torch_compile_inductor_on_cuda():
    batch = to_cuda(make_batch(100_000, 4))

    def step(x, old_logp, adv, mask):
        loss, stats = dapo_loss(x, old_logp, adv, mask, normalizer=50_000, **KW)
        return loss * 3.0, stats.clipped_high

    compiled = torch.compile(step, fullgraph=True)
    x_c, x_e = batch[0].clone().requires_grad_(), batch[0].clone().requires_grad_()
    loss_c, _ = compiled(x_c, *batch[1:])
    loss_e, _ = step(x_e, *batch[1:])
    loss_c.backward()
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(x_c.grad, x_e.grad)


@pytest.mark.parametrize("retain_graph", [False, True])
@pytest.mark.parametrize("dtype,normalizer,upstream", LOSS_SCALES)
def test_a_scaled_upstream_gradient_is_within_twice_the_references_rounding(dtype, normalizer, upstream, retain_graph):
    """The CUDA backward multiplies in fp32 and rounds once to logp's dtype, the graph freed or retained."""
    batch = make_batch(200_000, 5, dtype=dtype)
    logp, old_logp, adv, mask = batch
    kw = dict(normalizer=normalizer, dual_clip_c=3.0, retain_graph=retain_graph)
    grad = upstream_grad(dapo_loss, *to_cuda(batch), upstream, **kw)
    grad_ref = upstream_grad(dapo_loss_reference, *batch, upstream, **kw)
    grad_64 = upstream_grad(dapo_loss_reference, logp.double(), old_logp.double(), adv, mask, upstream, **kw)
    assert grad.dtype == dtype and grad.is_cuda
    keep = away_from_clip_edges(logp, old_logp, 3.0, margin=1e-3)
    assert_within_twice_the_reference(grad.cpu(), grad_ref, grad_64, keep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_retained_graph_gives_the_same_gradient_as_a_freed_one(dtype):
    batch = to_cuda(make_batch(100_000, 6, dtype=dtype))
    kept, freed = (upstream_grad(dapo_loss, *batch, 1 / 3, normalizer=1000, retain_graph=r) for r in (True, False))
    assert torch.equal(kept, freed)


def test_a_nan_advantage_gives_a_nan_gradient_like_the_reference():
    logp, old_logp, adv, mask = make_batch(10_000, 7)
    token = mask.nonzero()[0, 0]
    adv[token] = float("nan")
    loss_g, grad_g, _ = run(dapo_loss, *to_cuda((logp, old_logp, adv, mask)), normalizer=5000)
    loss_r, grad_r, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, normalizer=5000)
    assert loss_g.isnan() and loss_r.isnan()
    assert grad_g[token].isnan() and grad_r[token].isnan()
    others = torch.arange(10_000) != token
    assert rel_err(grad_g.cpu()[others], grad_r[others]) < 1e-6


@pytest.mark.parametrize("retain_graph", [False, True])
def test_batched_upstream_gradients_match_the_reference(retain_graph):
    batch = make_batch(10_000, 8)
    upstream = torch.tensor([1.0, -2.5, 1 / 3])
    grads = []
    for fn, inputs in ((dapo_loss, to_cuda(batch)), (dapo_loss_reference, batch)):
        x = inputs[0].clone().requires_grad_()
        loss, _ = fn(x, *inputs[1:], normalizer=5000, **KW)
        (grad,) = torch.autograd.grad(loss, x, upstream.to(x.device), is_grads_batched=True, retain_graph=retain_graph)
        grads.append(grad.cpu())
    keep = away_from_clip_edges(batch[0], batch[1])
    assert rel_err(grads[0][:, keep], grads[1][:, keep]) < 1e-6


def test_compiled_autograd_matches_eager():
    batch = to_cuda(make_batch(100_000, 10, dtype=torch.bfloat16))
    grads = {}
    for compiled in (False, True):
        x = batch[0].clone().requires_grad_()

        def step(x):
            loss, _ = dapo_loss(x, *batch[1:], normalizer=50_000, **KW)
            (loss / 3).backward()

        with torch._dynamo.config.patch(compiled_autograd=compiled):
            (torch.compile(step, backend="eager") if compiled else step)(x)
        grads[compiled] = x.grad
    assert torch.equal(grads[True], grads[False])
