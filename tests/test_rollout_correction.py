"""The rollout correction (ops/rollout_correction.py) against its float64 reference, each level x action, and
through the fused op's path: the weights ride in the loss mask, and the loss and its gradient are the reference's
clipped surrogate with the reference's weights."""

import math

import pytest
import torch

from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.loss_settings import CORRECTION_ACTIONS, CORRECTION_LEVELS, CORRECTION_PRESETS
from megatron_dapo.ops.rollout_correction import correction_weights
from megatron_dapo.ops.rollout_correction_reference import correction_weights_reference

BANDS = {"truncate": (None, 1.3), "mask": (0.6, 1.5), "reject": (0.9, 1.1)}
EPS_LOW, EPS_HIGH = 0.2, 0.28


def responses(seed: int):
    """Responses of 1 token, of a few and of thousands; one left out of the loss whole (overlong filtering), one
    with a few tokens out; log-ratios small, but in two responses a few far out (past the exponent's clamp)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 1, 7, 3000, 40, 12, 2500, 5]
    log_ratios, in_loss = [], []
    for i, n in enumerate(lengths):
        r = 0.08 * torch.randn(n, generator=g, dtype=torch.float64)
        if i in (2, 6):
            far = torch.rand(n, generator=g) < 0.3
            r[far] = 30.0 * torch.randn(int(far.sum()), generator=g, dtype=torch.float64)
        keep = torch.ones(n, dtype=torch.bool)
        if i == 4:
            keep[:] = False
        if i == 5:
            keep[::3] = False
        log_ratios.append(r)
        in_loss.append(keep)
    return lengths, log_ratios, in_loss


def reference_loss(logp, old, adv, weights):
    """The clipped surrogate's token sum, each token's term weighted, in Python floats."""
    total = 0.0
    for lp, o, a, w in zip(logp, old, adv, weights):
        ratio = math.exp(lp - o)
        total += w * -min(ratio * a, min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
    return total


@pytest.mark.parametrize("action", CORRECTION_ACTIONS)
@pytest.mark.parametrize("level", CORRECTION_LEVELS)
def test_each_level_and_action_is_its_reference_and_so_is_the_loss_it_weights(level, action):
    lengths, log_ratios, in_loss = responses(seed=CORRECTION_LEVELS.index(level))
    lower, upper = BANDS[action]
    rule = dict(level=level, action=action, lower=lower, upper=upper)
    flat_r, flat_in = torch.cat(log_ratios), torch.cat(in_loss)
    got = correction_weights(flat_r, torch.tensor(lengths), flat_in, **rule)
    want = correction_weights_reference([r.tolist() for r in log_ratios], [k.tolist() for k in in_loss], **rule)
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(sum(want, []), dtype=torch.float64), rtol=1e-12, atol=0)
    if action != "truncate":  # the bands leave some out, and keep some
        assert 0 < (got[flat_in] == 0).sum() < flat_in.sum()

    # The fused op's path: fp32 log-probs, the weights (as the trainer hands them, fp32) in the mask.
    g = torch.Generator().manual_seed(7)
    n = flat_r.numel()
    old = (-3.0 * torch.rand(n, generator=g)).float()
    logp = (old + 0.1 * torch.randn(n, generator=g)).requires_grad_()
    adv = torch.randn(n, generator=g).float()
    weight = got.float()
    loss, _ = dapo_loss(logp, old, adv, torch.where(flat_in, weight, 0.0), eps_low=EPS_LOW, eps_high=EPS_HIGH,
                        normalizer=1.0)
    loss.backward()
    w64 = [w if keep else 0.0 for w, keep in zip(weight.double().tolist(), flat_in.tolist())]
    want_loss = reference_loss(logp.double().tolist(), old.double().tolist(), adv.double().tolist(), w64)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    # The gradient, by float64 autograd over the same terms.
    lp64 = logp.detach().double().requires_grad_()
    ratio = torch.exp(lp64 - old.double())
    a64 = adv.double()
    terms = -torch.minimum(ratio * a64, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a64)
    (terms * torch.tensor(w64, dtype=torch.float64)).sum().backward()
    assert torch.allclose(logp.grad.double(), lp64.grad, rtol=1e-6, atol=1e-9)


def test_a_sequences_weight_is_the_same_whatever_its_neighbours_and_the_length_contract():
    """A response's weight depends on its own tokens only; exp(sum) shrinks a long response with a steady
    per-token mismatch by exp(L d), exp(mean) does not: the contract the README states."""
    d = -0.003
    lengths = [100, 1200]
    r = torch.full((sum(lengths),), d, dtype=torch.float64)
    keep = torch.ones_like(r, dtype=torch.bool)
    seq = correction_weights(r, torch.tensor(lengths), keep, level="sequence", action="truncate", lower=None,
                             upper=10.0)
    geo = correction_weights(r, torch.tensor(lengths), keep, level="geometric", action="truncate", lower=None,
                             upper=10.0)
    assert seq[0].item() == pytest.approx(math.exp(100 * d)) and seq[-1].item() == pytest.approx(math.exp(1200 * d))
    assert seq[-1].item() == pytest.approx(0.0273, abs=1e-4)
    assert torch.allclose(geo, torch.full_like(geo, math.exp(d)))
    alone = correction_weights(r[100:], torch.tensor([1200]), keep[100:], level="sequence", action="truncate",
                               lower=None, upper=10.0)
    assert torch.equal(alone, seq[100:])


@pytest.mark.parametrize("preset", CORRECTION_PRESETS)
def test_where_engine_and_trainer_agree_every_preset_weighs_exactly_1(preset):
    level, action, lower, upper = CORRECTION_PRESETS[preset]
    w = correction_weights(torch.zeros(7, dtype=torch.float64), torch.tensor([3, 4]), torch.ones(7, dtype=torch.bool),
                           level=level, action=action, lower=lower, upper=upper)
    assert w.tolist() == [1.0] * 7


def test_the_op_refuses_what_the_config_refuses():
    with pytest.raises(ValueError, match="lower must be below upper"):
        correction_weights(torch.zeros(2, dtype=torch.float64), torch.tensor([2]), torch.ones(2, dtype=torch.bool),
                           level="token", action="mask", lower=2.0, upper=1.5)


def test_the_mismatch_kl_is_an_unbiased_estimate_of_kl_engine_to_trainer():
    """Tokens sampled from the engine's distribution p: mismatch/kl estimates KL(p || q) of the trainer's q (k3 of
    log q - log p, whose mean under p is the KL). k3 of the opposite sign has mean chi2(p || q) - KL: 0.355 here."""
    from megatron_dapo.policy.mismatch import mismatch_sums

    p, q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    r = q.log()[tokens] - p.log()[tokens]  # log pi_old - log pi_rollout
    sums, _ = mismatch_sums(r, torch.tensor([r.numel()]), None, torch.ones_like(r, dtype=torch.bool))
    kl = (p * (p / q).log()).sum().item()  # 0.275
    assert sums[2].item() / r.numel() == pytest.approx(kl, rel=0.02)
