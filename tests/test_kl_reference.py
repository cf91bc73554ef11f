"""The KL term's reference: refreshed to the policy every loss.kl_ref_refresh_steps steps, and restored on a resume
(the checkpoints fall on refresh steps; a resume between two refreshes says what it does)."""

import logging
from types import SimpleNamespace

import torch

from megatron_dapo.checkpoint.policy_from_hf import Policy


def policy(refresh_steps):
    torch.manual_seed(0)
    live, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    return Policy(SimpleNamespace(module=live), reference, spec=None, hf_config={},
                  reference_refresh_steps=refresh_steps)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_reference_becomes_the_policy_at_every_nth_step_only():
    p = policy(2)
    p.reference_after(1)
    assert not same(p.reference, p.module)
    p.reference_after(2)
    assert same(p.reference, p.module)
    with torch.no_grad():
        p.module.weight.add_(1.0)  # the policy trains on
    p.reference_after(3)
    assert not same(p.reference, p.module)


def test_a_frozen_reference_never_follows():
    p = policy(0)
    for step in (1, 2, 4):
        p.reference_after(step)
        p.resumed_at(step)
    assert not same(p.reference, p.module)


def test_a_resume_restores_the_reference_of_its_refresh_step_and_says_so_between_two(caplog):
    p = policy(2)
    p.resumed_at(4)
    assert same(p.reference, p.module) and not caplog.records
    p = policy(2)
    with caplog.at_level(logging.WARNING):
        p.resumed_at(5)
    assert same(p.reference, p.module)
    assert "resumed at step 5, between the KL reference's refreshes" in caplog.text
