"""loss.aggregation: the fused op's weighted token sum gives GRPO's sample-level loss as its definition (float64)
does, and DAPO's token-level one as before; the two differ where responses differ in length."""

import pytest
import torch
from dapo_loss_cases import KW, make_batch, run

from megatron_dapo.config import ConfigError, LossConfig
from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference
from megatron_dapo.ops.dapo_loss_reference import sample_level_loss_reference
from megatron_dapo.ops.loss_aggregation import aggregation_weights

LENS = [3, 40, 1, 17, 9, 2]  # responses of very different lengths: the two rules weigh them differently


def batch():
    logp, old, adv, mask = make_batch(sum(LENS), 3, dtype=torch.float64, adv_dtype=torch.float64)
    mask[3:43] = mask[3:43] | (torch.arange(40) % 3 == 0)  # the long response keeps some loss tokens
    mask[43] = True  # the one-token response is in the loss
    mask[-LENS[-1]:] = False  # the last response has no loss token: it counts in neither normaliser
    # One advantage per response, as the group normalisation gives.
    adv = torch.cat([torch.full((n,), a) for n, a in zip(LENS, [1.0, -0.5, 2.0, -1.5, 0.7, -0.3])]).double()
    return logp, old, adv, mask


def weighted_op_loss(aggregation, logp, old, adv, mask, dual_clip_c=None):
    weights, units = aggregation_weights(mask, LENS, aggregation)
    weighted = mask if weights is None else weights  # float32: the op's weighted-mask dtype
    return run(dapo_loss, logp, old, adv, weighted, normalizer=units, dual_clip_c=dual_clip_c)


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_sample_level_is_the_mean_over_responses_of_their_token_means(dual_clip_c):
    logp, old, adv, mask = batch()
    loss, grad, _ = weighted_op_loss("sample", logp, old, adv, mask, dual_clip_c)
    x = logp.clone().requires_grad_()
    expected = sample_level_loss_reference(x, old, adv, mask, LENS, dual_clip_c=dual_clip_c, **KW)
    expected.backward()
    # The weights 1 / (a response's loss tokens) are float32, the mask's dtype in the op: float32's rounding.
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-9)
    assert int(aggregation_weights(mask, LENS, "sample")[1]) == len(LENS) - 1


def test_token_level_is_the_op_as_before_and_differs_from_sample_level():
    logp, old, adv, mask = batch()
    token_loss, token_grad, _ = weighted_op_loss("token", logp, old, adv, mask)
    ref_loss, ref_grad, _ = run(dapo_loss_reference, logp, old, adv, mask, normalizer=int(mask.sum()))
    assert token_loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    torch.testing.assert_close(token_grad, ref_grad)
    sample_loss, sample_grad, _ = weighted_op_loss("sample", logp, old, adv, mask)
    assert abs(sample_loss.item() - token_loss.item()) > 0.05 * abs(token_loss.item())
    # Sample-level: the one-token response's token weighs as much as the whole 40-token one.
    one = sum(LENS[:2])
    assert sample_grad[one].abs() > 5 * token_grad[one].abs()


def test_an_unknown_aggregation_is_refused_by_the_config_naming_the_key():
    with pytest.raises(ConfigError, match=r"loss.aggregation: must be one of 'token', 'sample', got 'seq'"):
        LossConfig(aggregation="seq")


@pytest.mark.parametrize("aggregation", ["token", "sample"])
def test_a_steps_loss_over_several_updates_is_averaged_as_its_aggregation_says(aggregation):
    """train.updates_per_step > 1: the step's reported loss is each update's loss weighted by what that update
    averaged over (loss tokens, or responses), i.e. the loss of the whole step's batch under the same rule."""
    from megatron_dapo.loop.step_metrics import train_metrics
    from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
    from megatron_dapo.policy.train_step import StepResult

    def update(loss, responses, tokens):
        stats = {**dict.fromkeys(STAT_NAMES, 0.0), "num_tokens": float(tokens)}
        return StepResult(loss, 1.0, 1e-6, stats, units=float(responses if aggregation == "sample" else tokens))

    # One long response with loss 1, then three 2-token responses with loss 0.
    out = train_metrics([update(1.0, 1, 100), update(0.0, 3, 6)], None, None,
                        LossConfig(aggregation=aggregation, old_logprobs="rollout"))
    assert out["loss"] == pytest.approx(1 / 4 if aggregation == "sample" else 100 / 106)


@pytest.mark.parametrize("aggregation", ["token", "sample"])
def test_the_hosts_count_of_loss_units_is_the_loss_functions(aggregation):
    """loss_units (the load-balancing loss's scale, before the step) counts what aggregation_weights adds to the
    normaliser in it."""
    from megatron_dapo.ops.loss_aggregation import loss_units

    masks = [torch.tensor([True, False, True]), torch.zeros(2, dtype=torch.bool), torch.tensor([False, True])]
    _, units = aggregation_weights(torch.cat(masks), [len(m) for m in masks], aggregation)
    assert loss_units(masks, aggregation) == int(units) == {"token": 3, "sample": 2}[aggregation]
