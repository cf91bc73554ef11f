"""What the fused DAPO loss's autograd supports, held against the plain reference, and what it refuses by name:
first-order, reverse-mode gradients in logp (the upstream gradient multiplied in fp32 and rounded once to logp's
dtype, the graph freed or retained, batched upstream gradients, compiled autograd); not second-order gradients,
forward-mode AD, or gradients of old_logp, advantages or the mask."""

import subprocess
import sys

import pytest
import torch
from dapo_loss_cases import (KW, LOSS_SCALES, assert_within_twice_the_reference, away_from_clip_edges, make_batch,
                             rel_err, upstream_grad)

from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference


def loss_of(fn, batch, x=None, **kw):
    logp, old_logp, adv, mask = batch
    return fn(logp if x is None else x, old_logp, adv, mask, **{**KW, "normalizer": 37, **kw})[0]


@pytest.mark.parametrize("retain_graph", [False, True])
@pytest.mark.parametrize("dtype,normalizer,upstream", LOSS_SCALES)
def test_a_scaled_upstream_gradient_is_within_twice_the_references_rounding(dtype, normalizer, upstream, retain_graph):
    logp, old_logp, adv, mask = make_batch(4_000, 1, dtype=dtype)
    kw = dict(normalizer=normalizer, dual_clip_c=3.0, retain_graph=retain_graph)
    grad = upstream_grad(dapo_loss, logp, old_logp, adv, mask, upstream, **kw)
    grad_ref = upstream_grad(dapo_loss_reference, logp, old_logp, adv, mask, upstream, **kw)
    grad_64 = upstream_grad(dapo_loss_reference, logp.double(), old_logp.double(), adv, mask, upstream, **kw)
    assert grad.dtype == grad_ref.dtype == dtype
    assert_within_twice_the_reference(grad, grad_ref, grad_64, away_from_clip_edges(logp, old_logp, 3.0, margin=1e-3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_retained_graph_gives_the_same_gradient_as_a_freed_one(dtype):
    batch = make_batch(3_000, 2, dtype=dtype)
    kept, freed = (upstream_grad(dapo_loss, *batch, 1 / 3, normalizer=100, retain_graph=r) for r in (True, False))
    assert torch.equal(kept, freed)


def test_a_nan_advantage_gives_a_nan_gradient_like_the_reference():
    logp, old_logp, adv, mask = make_batch(200, 3)
    token = mask.nonzero()[0, 0]
    adv[token] = float("nan")
    grads = {}
    for fn in (dapo_loss, dapo_loss_reference):
        x = logp.clone().requires_grad_()
        loss = loss_of(fn, (logp, old_logp, adv, mask), x)
        loss.backward()
        assert loss.isnan()
        grads[fn] = x.grad
    fused, ref = grads[dapo_loss], grads[dapo_loss_reference]
    assert fused[token].isnan() and ref[token].isnan()
    others = torch.arange(200) != token
    assert rel_err(fused[others], ref[others]) < 1e-6


def test_a_second_order_gradient_is_refused():
    batch = make_batch(64, 4, dtype=torch.float64)
    v = torch.randn(64, dtype=torch.float64)
    x, first = {}, {}
    for fn in (dapo_loss, dapo_loss_reference):
        x[fn] = batch[0].clone().requires_grad_()
        (first[fn],) = torch.autograd.grad(loss_of(fn, batch, x[fn]) ** 2, x[fn], create_graph=True)
    torch.testing.assert_close(first[dapo_loss], first[dapo_loss_reference])  # the first order is still right
    with pytest.raises(NotImplementedError, match="dapo_loss: second-order gradients .* are not supported"):
        torch.autograd.grad(first[dapo_loss] @ v, x[dapo_loss])


def test_a_hessian_is_refused():
    batch = make_batch(16, 5, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="dapo_loss: second-order gradients .* dapo_loss_reference"):
        torch.autograd.functional.hessian(lambda x: loss_of(dapo_loss, batch, x), batch[0])


@pytest.mark.parametrize("tangent_on", ["logp", "old_logp"])
@pytest.mark.parametrize("api", ["torch.func.jvp", "forward_ad"])
def test_forward_mode_ad_is_refused(api, tangent_on):
    batch = list(make_batch(32, 6))
    i = ["logp", "old_logp"].index(tangent_on)
    tangent = torch.randn(32)

    def loss_with(primal):
        batch[i] = primal
        return loss_of(dapo_loss, batch)

    with pytest.raises(NotImplementedError, match=f"dapo_loss: forward-mode AD .* {tangent_on} carries a tangent"):
        if api == "torch.func.jvp":
            torch.func.jvp(loss_with, (batch[i],), (tangent,))
        else:
            with torch.autograd.forward_ad.dual_level():
                loss_with(torch.autograd.forward_ad.make_dual(batch[i], tangent))


@pytest.mark.parametrize("transform", [torch.func.grad, torch.func.jacrev])
def test_torch_funcs_gradient_transforms_are_refused_by_name(transform):
    batch = make_batch(32, 11)
    with pytest.raises(NotImplementedError, match="dapo_loss: gradients inside torch.func's transforms .* with torch"):
        transform(lambda x: loss_of(dapo_loss, batch, x))(batch[0])


def test_vmap_of_the_forward_matches_the_reference():
    batch = make_batch(64, 12)
    logps = torch.stack([batch[0], batch[0] + 0.1])
    losses = [torch.func.vmap(lambda x: loss_of(fn, batch, x))(logps) for fn in (dapo_loss, dapo_loss_reference)]
    torch.testing.assert_close(*losses)


@pytest.mark.parametrize("name", ["old_logp", "advantages", "mask"])
def test_another_input_that_requires_grad_is_refused(name):
    logp, old_logp, adv, mask = make_batch(32, 7, mask_dtype=torch.float32)
    args = dict(logp=logp.requires_grad_(), old_logp=old_logp, advantages=adv, mask=mask)
    args[name] = args[name].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=f"dapo_loss: {name} requires grad, .* logp alone"):
        dapo_loss(**args, normalizer=10, **KW)
    with torch.no_grad():  # no gradient asked for: nothing to refuse
        dapo_loss(**args, normalizer=10, **KW)


@pytest.mark.parametrize("retain_graph", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_upstream_gradients_match_the_reference(dtype, retain_graph):
    batch = make_batch(500, 8, dtype=dtype)
    upstream = torch.tensor([1.0, -2.5, 1 / 3])
    grads = {}
    for fn in (dapo_loss, dapo_loss_reference):
        x = batch[0].clone().requires_grad_()
        (grads[fn],) = torch.autograd.grad(loss_of(fn, batch, x), x, upstream, is_grads_batched=True,
                                           retain_graph=retain_graph)
    assert grads[dapo_loss].shape == (3, 500)
    keep = away_from_clip_edges(batch[0], batch[1], margin=1e-3)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert rel_err(grads[dapo_loss][:, keep], grads[dapo_loss_reference][:, keep]) < tol


def test_a_vectorized_jacobian_matches_the_reference():
    batch = make_batch(300, 9, dtype=torch.float64)
    jac = {fn: torch.autograd.functional.jacobian(lambda x: loss_of(fn, batch, x), batch[0], vectorize=True)
           for fn in (dapo_loss, dapo_loss_reference)}
    torch.testing.assert_close(jac[dapo_loss], jac[dapo_loss_reference])


def test_compiled_autograd_matches_eager():
    batch = make_batch(1_000, 10)
    grads = {}
    for compiled in (False, True):
        x = batch[0].clone().requires_grad_()

        def step(x):
            (2.0 * loss_of(dapo_loss, batch, x)).backward()

        with torch._dynamo.config.patch(compiled_autograd=compiled):
            (torch.compile(step, backend="eager") if compiled else step)(x)
        grads[compiled] = x.grad
    torch.testing.assert_close(grads[True], grads[False])


def test_the_package_attribute_is_the_function_once_its_module_is_imported():
    import megatron_dapo.ops as ops
    from megatron_dapo.ops import dapo_loss as imported

    assert imported is ops.dapo_loss is sys.modules["megatron_dapo.ops.dapo_loss"].dapo_loss is dapo_loss


def test_the_package_imports_without_torch_and_then_gives_the_function():
    code = ("import sys, types; import megatron_dapo.ops as ops; assert 'torch' not in sys.modules; "
            "from megatron_dapo.ops import dapo_loss; assert isinstance(dapo_loss, types.FunctionType), dapo_loss; "
            "assert ops.dapo_loss is dapo_loss is sys.modules['megatron_dapo.ops.dapo_loss'].dapo_loss")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
