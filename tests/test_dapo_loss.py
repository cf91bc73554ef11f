"""The fused DAPO loss (C++ kernel through torch.library) held against its plain PyTorch reference."""

import math

import pytest
import torch
from dapo_loss_cases import EPS_HIGH, EPS_LOW, KW, away_from_clip_edges, make_batch, rel_err, run

from megatron_dapo.ops.dapo_loss import dapo_loss, extension_error
from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference
from megatron_dapo.ops.kl_penalty import kl_penalty


def test_extension_is_built():
    assert extension_error() is None


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("adv_dtype", [torch.float32, torch.float64])
def test_fp32_matches_reference(seed, dual_clip_c, mask_dtype, adv_dtype):
    n = 50_000 + 37 * seed  # not a multiple of the kernel's block
    batch = make_batch(n, seed, mask_dtype=mask_dtype, adv_dtype=adv_dtype)
    norm = 41_234
    loss_f, grad_f, stats_f = run(dapo_loss, *batch, normalizer=norm, dual_clip_c=dual_clip_c)
    loss_r, grad_r, stats_r = run(dapo_loss_reference, *batch, normalizer=norm, dual_clip_c=dual_clip_c)
    assert loss_f.dtype == loss_r.dtype == torch.float32
    assert rel_err(loss_f, loss_r) < 1e-6
    keep = away_from_clip_edges(batch[0], batch[1], dual_clip_c)
    assert keep.float().mean() > 0.99
    assert rel_err(grad_f[keep], grad_r[keep]) < 1e-6
    assert grad_f.dtype == torch.float32
    for name, a, b in zip(STAT_NAMES, stats_f, stats_r):
        tol = 1e-6 * max(1.0, abs(b.item()))
        if name in ("clipped_low", "clipped_high", "dual_clipped"):
            tol = (~keep).sum().item()  # a token on a clip edge may count on either side
        assert abs(a.item() - b.item()) <= tol, name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_twice_the_reference(seed, dtype):
    logp, old_logp, adv, mask = make_batch(20_000, seed, dtype=dtype)
    kw = dict(normalizer=20_000, dual_clip_c=3.0)
    loss_64, grad_64, _ = run(dapo_loss_reference, logp.double(), old_logp.double(), adv, mask, **kw)
    loss_f, grad_f, _ = run(dapo_loss, logp, old_logp, adv, mask, **kw)
    loss_r, grad_r, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, **kw)
    assert grad_f.dtype == grad_r.dtype == dtype
    keep = away_from_clip_edges(logp, old_logp, 3.0, margin=1e-3)
    # The floor is fp32 round-off: where the reference's own error is below it, "2x" is noise.
    floor = 1e-6
    assert rel_err(loss_f, loss_64) <= 2 * rel_err(loss_r, loss_64) + floor
    assert rel_err(grad_f[keep], grad_64[keep]) <= 2 * rel_err(grad_r[keep], grad_64[keep]) + floor


@pytest.mark.parametrize("dual_clip_c", [None, 2.5])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_gradcheck_float64(dual_clip_c, mask_dtype):
    logp, old_logp, adv, mask = make_batch(64, 7, dtype=torch.float64, mask_dtype=mask_dtype, spread=0.5)
    keep = away_from_clip_edges(logp, old_logp, dual_clip_c, margin=1e-3)
    logp, old_logp, adv, mask = logp[keep], old_logp[keep], adv[keep], mask[keep]
    x = logp.clone().requires_grad_()
    fn = lambda t: dapo_loss(t, old_logp, adv, mask, normalizer=17, dual_clip_c=dual_clip_c, **KW)[0]  # noqa: E731
    assert fn(x).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_masked_tokens_get_zero_gradient_even_with_garbage():
    logp, old_logp, adv, mask = make_batch(5_000, 3)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    idx = (~mask).nonzero().squeeze(1)[: 4 * 100]
    logp[idx] = garbage.repeat(100)[: idx.numel()]
    adv[idx] = garbage.flip(0).repeat(100)[: idx.numel()]
    loss, grad, stats = run(dapo_loss, logp, old_logp, adv, mask, normalizer=1000)
    assert torch.isfinite(loss)
    assert torch.all(grad[~mask] == 0)
    assert all(torch.isfinite(s) for s in stats)
    clean = ~torch.isin(torch.arange(5_000), idx)
    loss_r, _, _ = run(dapo_loss_reference, logp[clean], old_logp[clean], adv[clean], mask[clean], normalizer=1000)
    assert rel_err(loss, loss_r) < 1e-6


@pytest.mark.parametrize("n", [0, 1000])
def test_empty_and_all_masked_give_zero(n):
    logp, old_logp, adv, _ = make_batch(n, 0)
    mask = torch.zeros(n, dtype=torch.bool)
    for fn in (dapo_loss, dapo_loss_reference):
        loss, grad, stats = run(fn, logp, old_logp, adv, mask, normalizer=1)
        assert loss.item() == 0.0
        assert torch.all(grad == 0) and grad.shape == (n,)
        assert all(s.item() == 0.0 for s in stats)


def test_extreme_log_ratios_stay_finite():
    old_logp = torch.full((6,), -10.0)
    logp = old_logp + torch.tensor([50.0, -50.0, 50.0, -50.0, 19.0, -19.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(6, dtype=torch.bool)
    for dual in (None, 3.0):
        loss_f, grad_f, stats_f = run(dapo_loss, logp, old_logp, adv, mask, normalizer=6, dual_clip_c=dual)
        loss_r, grad_r, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, normalizer=6, dual_clip_c=dual)
        assert torch.isfinite(loss_f) and torch.isfinite(grad_f).all()
        assert all(torch.isfinite(s) for s in stats_f)
        assert rel_err(loss_f, loss_r) < 1e-6 and rel_err(grad_f, grad_r) < 1e-6
        # Beyond the clamp the ratio is constant: no gradient; r = exp(20) at most.
        assert torch.all(grad_f[:4] == 0)
        assert stats_f.ratio_max.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_hand_computed_group_of_four():
    # The seed's group: correct, correct, wrong, wrong -> rewards +1, +1, -1, -1. Normalised in the
    # group with the sample std: mean 0, std sqrt(4/3), so A = +-sqrt(3)/2.
    a = math.sqrt(3) / 2
    # Per-token ratios r for the responses' 3 + 2 + 4 + 1 = 10 tokens.
    ratios = [1.0, 1.5, 0.5, 1.1, 0.9, 0.7, 1.0, 1.2, 4.0, 0.9]
    advs = [a, a, a, a, a, -a, -a, -a, -a, -a]
    old_logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -2.5, -0.7, -1.2, -4.0, -2.2], dtype=torch.float64)
    logp = old_logp + torch.log(torch.tensor(ratios, dtype=torch.float64))
    adv = torch.tensor(advs, dtype=torch.float64)
    mask = torch.ones(10, dtype=torch.bool)
    n_tok = 10
    # Token losses -min(r*A, clip(r, 0.8, 1.28)*A); "c" marks a clipped token (zero gradient).
    #   A > 0: r=1.0 -> -a; r=1.5 -> -1.28a (c); r=0.5 -> -0.5a; r=1.1 -> -1.1a; r=0.9 -> -0.9a
    #   A < 0: r=0.7 -> -0.8a... no: -min(-0.7a, -0.8a) = 0.8a (c); r=1.0 -> a; r=1.2 -> 1.2a;
    #          r=4.0 -> 4a, or 3a with dual clip c=3 (c); r=0.9 -> 0.9a
    token_loss = [-a, -1.28 * a, -0.5 * a, -1.1 * a, -0.9 * a, 0.8 * a, a, 1.2 * a, 4.0 * a, 0.9 * a]
    token_grad = [-a * 1.0, 0.0, -a * 0.5, -a * 1.1, -a * 0.9, 0.0, a * 1.0, a * 1.2, a * 4.0, a * 0.9]
    for dual in (None, 3.0):
        expected_loss = list(token_loss)
        expected_grad = list(token_grad)
        if dual:
            expected_loss[8], expected_grad[8] = 3.0 * a, 0.0
        for fn in (dapo_loss, dapo_loss_reference):
            loss, grad, stats = run(fn, logp, old_logp, adv, mask, normalizer=n_tok, dual_clip_c=dual)
            assert loss.item() == pytest.approx(sum(expected_loss) / n_tok, rel=1e-12)
            torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64) / n_tok)
            assert stats.clipped_high.item() == 1 and stats.clipped_low.item() == 1
            assert stats.dual_clipped.item() == (1 if dual else 0)
            assert stats.num_tokens.item() == 10
            assert stats.ratio_max.item() == pytest.approx(4.0)


@pytest.mark.parametrize("fn", [dapo_loss, dapo_loss_reference])
def test_micro_batches_with_global_normalizer_match_whole_batch(fn):
    logp, old_logp, adv, mask = make_batch(30_001, 11)
    norm = int(mask.sum())
    whole_loss, whole_grad, whole_stats = run(fn, logp, old_logp, adv, mask, normalizer=norm, dual_clip_c=3.0)
    x = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    stats_sum = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    for chunk in torch.tensor_split(torch.arange(30_001), [1, 7_000, 7_001, 19_999]):
        loss, stats = fn(x[chunk], old_logp[chunk], adv[chunk], mask[chunk], normalizer=norm, dual_clip_c=3.0, **KW)
        loss.backward()
        total += loss.double()
        stats_sum += torch.stack(stats)
    assert total.item() == pytest.approx(whole_loss.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, whole_grad, rtol=1e-6, atol=1e-12)
    for i, name in enumerate(STAT_NAMES):
        if name != "ratio_max":
            assert stats_sum[i].item() == pytest.approx(whole_stats[i].item(), rel=1e-6), name


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_stats_match_their_definitions(dual_clip_c):
    logp, old_logp, adv, mask = make_batch(20_000, 5, mask_dtype=torch.float32, spread=0.5)
    _, _, stats = run(dapo_loss, logp, old_logp, adv, mask, normalizer=1, dual_clip_c=dual_clip_c)
    x = (logp.double() - old_logp.double()).clamp(-20, 20)
    r = x.exp()
    a = adv.double()
    on = mask != 0
    keep = away_from_clip_edges(logp, old_logp, dual_clip_c)
    edge = (~keep & on).sum().item()
    expected = {
        "clipped_low": ((a < 0) & (r < 1 - EPS_LOW) & on).sum().item(),
        "clipped_high": ((a > 0) & (r > 1 + EPS_HIGH) & on).sum().item(),
        "dual_clipped": ((a < 0) & (r > dual_clip_c) & on).sum().item() if dual_clip_c else 0,
        "ratio_sum": r[on].sum().item(),
        "ratio_max": r[on].max().item(),
        "k3_kl_sum": (r - 1 - x)[on].sum().item(),
        "num_tokens": on.sum().item(),
    }
    assert expected["clipped_low"] > 100 and expected["clipped_high"] > 100
    assert not dual_clip_c or expected["dual_clipped"] > 0
    for name, value in zip(STAT_NAMES, stats):
        assert value.dtype == torch.float64 and value.dim() == 0
        if name.startswith(("clipped", "dual")):
            assert abs(value.item() - expected[name]) <= edge, name
        else:
            assert value.item() == pytest.approx(expected[name], rel=2e-6, abs=1e-3), name


def test_float_mask_weights_tokens():
    logp, old_logp, adv, _ = make_batch(1_000, 2)
    weights = torch.rand(1_000, generator=torch.Generator().manual_seed(1))
    loss_w, grad_w, _ = run(dapo_loss, logp, old_logp, adv, weights, normalizer=10)
    per_token = [run(dapo_loss_reference, logp[i : i + 1], old_logp[i : i + 1], adv[i : i + 1],
                     torch.ones(1, dtype=torch.bool), normalizer=10) for i in range(1_000)]
    expected_loss = sum(w * t[0] for w, t in zip(weights, per_token))
    assert loss_w.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    torch.testing.assert_close(grad_w, weights * torch.cat([t[1] for t in per_token]))


def test_upstream_gradient_scales_also_through_a_retained_graph():
    logp, old_logp, adv, mask = make_batch(3_000, 9)
    _, grad_1, _ = run(dapo_loss, logp, old_logp, adv, mask, normalizer=100)
    x = logp.clone().requires_grad_()
    loss, _ = dapo_loss(x, old_logp, adv, mask, normalizer=100, **KW)
    (g_retained,) = torch.autograd.grad(loss * -2.5, x, retain_graph=True)
    (g_again,) = torch.autograd.grad(loss * 0.5, x, retain_graph=True)
    (g_last,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g_retained, -2.5 * grad_1)
    torch.testing.assert_close(g_again, 0.5 * grad_1)
    torch.testing.assert_close(g_last, grad_1)


def test_forward_only_skips_the_gradient():
    logp, old_logp, adv, mask = make_batch(3_000, 4)
    with torch.no_grad():
        loss_ng, stats_ng = dapo_loss(logp, old_logp, adv, mask, normalizer=100, **KW)
    loss, _, stats = run(dapo_loss, logp, old_logp, adv, mask, normalizer=100)
    assert loss_ng.item() == loss.item() and not loss_ng.requires_grad
    assert all(a.item() == b.item() for a, b in zip(stats_ng, stats))


def test_result_does_not_depend_on_thread_count():
    batch = make_batch(200_000, 6)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(run(dapo_loss, *batch, normalizer=1000, dual_clip_c=3.0))
    finally:
        torch.set_num_threads(threads)
    for loss, grad, stats in results[1:]:
        assert loss.item() == results[0][0].item()
        assert torch.equal(grad, results[0][1])
        assert all(a.item() == b.item() for a, b in zip(stats, results[0][2]))


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_kl_penalty_against_a_reference_policy(kl_type):
    logp, old_logp, adv, mask = make_batch(4_000, 8)
    ref_logp = old_logp + 0.1
    kw = dict(normalizer=500, ref_logp=ref_logp, kl_coef=0.05, kl_type=kl_type)
    loss_f, grad_f, _ = run(dapo_loss, logp, old_logp, adv, mask, **kw)
    loss_r, grad_r, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, **kw)
    loss_0, _, _ = run(dapo_loss_reference, logp, old_logp, adv, mask, normalizer=500)
    d = ref_logp.double() - logp.double()
    per_token = -d if kl_type == "k1" else d.exp() - d - 1
    expected_kl = per_token[mask].sum().item() / 500
    assert (loss_r - loss_0).item() == pytest.approx(0.05 * expected_kl, rel=1e-4)
    assert kl_penalty(logp, ref_logp, mask, kl_type=kl_type, normalizer=500).item() == pytest.approx(
        expected_kl, rel=1e-5)
    assert rel_err(loss_f, loss_r) < 1e-6 and rel_err(grad_f, grad_r) < 1e-6


def test_registered_op_passes_opcheck():
    logp, old_logp, adv, mask = make_batch(257, 1)
    for compute_grad in (True, False):
        x = logp.clone().requires_grad_(compute_grad)
        args = (x, old_logp, adv, mask, EPS_LOW, EPS_HIGH, 100.0, 3.0, 20.0, compute_grad)
        torch.library.opcheck(torch.ops.megatron_dapo.dapo_loss_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_the_differentiable_op_passes_opcheck_its_autograd_included():
    """torch.ops.megatron_dapo.dapo_loss: its autograd registered in C++, its fake for the compiler."""
    logp, old_logp, adv, mask = make_batch(257, 1)
    for requires_grad in (True, False):
        args = (logp.clone().requires_grad_(requires_grad), old_logp, adv, mask, EPS_LOW, EPS_HIGH, 100.0, 3.0, 20.0)
        torch.library.opcheck(torch.ops.megatron_dapo.dapo_loss.default, args)


def test_the_saved_gradient_is_scaled_in_place_unless_the_graph_is_kept():
    """The backward hands out the forward's gradient buffer, scaled where it lies, when nothing reads it again."""
    logp, old_logp, adv, mask = make_batch(1_000, 4)
    grads = {}
    for retain in (False, True):
        saved = []
        x = logp.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss, _ = dapo_loss(x, old_logp, adv, mask, normalizer=500, **KW)
        (3.0 * loss).backward(retain_graph=retain)
        (buffer,) = (t for t in saved if t is not x)  # logp is saved too, for its dtype and its graph edge
        assert torch.equal(buffer, x.grad) is not retain  # scaled in place, or left for the next backward
        grads[retain] = x.grad
    torch.testing.assert_close(grads[False], grads[True])


def test_torch_compile_traces_the_op_without_graph_breaks():
    logp, old_logp, adv, mask = make_batch(10_000, 12)

    def train_step(x, old_logp, adv, mask):
        loss, stats = dapo_loss(x, old_logp, adv, mask, normalizer=5000, dual_clip_c=3.0, **KW)
        return 2.0 * loss, stats.clipped_high + stats.clipped_low

    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    x_c, x_e = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss_c, clipped_c = compiled(x_c, old_logp, adv, mask)
    loss_e, clipped_e = train_step(x_e, old_logp, adv, mask)
    loss_c.backward()
    loss_e.backward()
    assert loss_c.item() == loss_e.item() and clipped_c.item() == clipped_e.item()
    torch.testing.assert_close(x_c.grad, x_e.grad)


BAD_INPUTS = [
    ("mismatched lengths", dict(old_logp=torch.zeros(9)), ValueError, "old_logp has 9 tokens"),
    ("mask length", dict(mask=torch.ones(11, dtype=torch.bool)), ValueError, "mask has 11 tokens"),
    ("logp dtype", dict(logp=torch.zeros(10, dtype=torch.int64), old_logp=torch.zeros(10, dtype=torch.int64)),
     TypeError, "logp must be"),
    ("old_logp dtype", dict(old_logp=torch.zeros(10, dtype=torch.float64)), TypeError, "old_logp must have"),
    ("advantages dtype", dict(advantages=torch.zeros(10, dtype=torch.float16)), TypeError, "advantages must be"),
    ("mask dtype", dict(mask=torch.ones(10, dtype=torch.int32)), TypeError, "mask must be bool or float32"),
    ("2-D logp", dict(logp=torch.zeros(2, 5)), ValueError, "logp must be 1-D"),
    ("2-D advantages", dict(advantages=torch.zeros(10, 1)), ValueError, "advantages must be 1-D"),
    ("eps_low 0", dict(eps_low=0.0), ValueError, "eps_low must be in"),
    ("eps_low 1", dict(eps_low=1.0), ValueError, "eps_low must be in"),
    ("eps_high 0", dict(eps_high=0.0), ValueError, "eps_high must be > 0"),
    ("eps_high negative", dict(eps_high=-0.1), ValueError, "eps_high must be > 0"),
    ("dual_clip_c 1", dict(dual_clip_c=1.0), ValueError, "dual_clip_c must be > 1"),
    ("normalizer 0", dict(normalizer=0), ValueError, "normalizer must be > 0"),
    ("normalizer negative", dict(normalizer=-5.0), ValueError, "normalizer must be > 0"),
    ("normalizer nan", dict(normalizer=float("nan")), ValueError, "normalizer must be > 0"),
    ("log_ratio_clamp", dict(log_ratio_clamp=100.0), ValueError, "log_ratio_clamp must be in"),
    ("kl without ref", dict(kl_coef=0.1), ValueError, "needs ref_logp"),
    ("kl_type", dict(kl_type="k2"), ValueError, "kl_type must be one of"),
]


@pytest.mark.parametrize("fn", [dapo_loss, dapo_loss_reference])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_argument(fn, case):
    _, override, exc, message = case
    args = dict(logp=torch.zeros(10, requires_grad=True), old_logp=torch.zeros(10), advantages=torch.zeros(10),
                mask=torch.ones(10, dtype=torch.bool), normalizer=10, **KW)
    args.update(override)
    with pytest.raises(exc, match=message):
        fn(args.pop("logp"), args.pop("old_logp"), args.pop("advantages"), args.pop("mask"), **args)


@pytest.mark.parametrize("override,message", [
    (dict(old_logp=torch.zeros(9)), "old_logp has 9 tokens"),
    (dict(logp=torch.zeros(2, 5)), "logp must be 1-D"),
    (dict(mask=torch.ones(10, dtype=torch.int32)), "mask must be bool or float32"),
    (dict(eps_low=1.5), "eps_low must be in"),
    (dict(normalizer=0.0), "normalizer must be > 0"),
    (dict(dual_clip_c=0.5), "dual_clip_c must be > 1"),
])
def test_registered_op_checks_its_arguments_too(override, message):
    args = dict(logp=torch.zeros(10), old_logp=torch.zeros(10), advantages=torch.zeros(10),
                mask=torch.ones(10, dtype=torch.bool), eps_low=0.2, eps_high=0.28, normalizer=10.0, dual_clip_c=None,
                log_ratio_clamp=20.0, compute_grad=True)
    args.update(override)
    with pytest.raises((ValueError, TypeError), match=message):
        torch.ops.megatron_dapo.dapo_loss_fwd(*args.values())
