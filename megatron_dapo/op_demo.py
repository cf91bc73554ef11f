"""A short, self-contained demo of the fused DAPO loss (until the trainer lands, the README's main job).

A toy policy (one table of logits per position) "answers" one prompt four times, as in the seed's
example: two answers are judged correct (+1) and two wrong (-1). Rewards are normalised inside the
group into advantages, and a few optimizer steps on that fixed rollout with the fused token-level
loss make the correct answers likelier and the wrong ones rarer, while the asymmetric clip bounds
how far each step may push a token's probability ratio.
"""

from __future__ import annotations

import torch

from megatron_dapo.ops import dapo_loss, dapo_loss_reference

VOCAB = 16
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _sequence_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[: tokens.numel()], dim=-1).gather(1, tokens[:, None]).squeeze(1)


def run_demo(steps: int = 8, seed: int = 0) -> int:
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(12, VOCAB, requires_grad=True)
    # The old policy sampled four responses of different lengths.
    responses = [torch.randint(VOCAB, (n,), generator=g) for n in (12, 7, 9, 5)]
    rewards = torch.tensor([1.0, 1.0, -1.0, -1.0])  # correct, correct, wrong, wrong
    adv_per_response = (rewards - rewards.mean()) / rewards.std()
    advantages = torch.cat([a.expand(r.numel()) for a, r in zip(adv_per_response, responses)])
    mask = torch.ones(advantages.numel(), dtype=torch.bool)
    normalizer = int(mask.sum())  # token-level: every token of the batch weighs the same
    with torch.no_grad():
        old_logp = torch.cat([_sequence_logp(logits, r) for r in responses])

    print("DAPO op demo: one prompt, a group of 4 responses (rewards +1 +1 -1 -1), "
          f"{normalizer} tokens, eps_low={EPS_LOW}, eps_high={EPS_HIGH}")
    print("advantages per response: " + " ".join(f"{a:+.3f}" for a in adv_per_response.tolist()))
    optimizer = torch.optim.SGD([logits], lr=3.0)
    print(f"{'step':>4} {'loss':>9} {'clip low':>8} {'clip high':>9} {'ratio mean':>10} {'ratio max':>9} "
          f"{'p(correct)':>10} {'p(wrong)':>9}")
    for step in range(steps + 1):
        logp = torch.cat([_sequence_logp(logits, r) for r in responses])
        loss, stats = dapo_loss(logp, old_logp, advantages, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                normalizer=normalizer)
        ref_loss, _ = dapo_loss_reference(logp.detach(), old_logp, advantages, mask, eps_low=EPS_LOW,
                                          eps_high=EPS_HIGH, normalizer=normalizer)
        if not torch.allclose(loss.detach(), ref_loss, rtol=1e-6, atol=1e-7):
            print(f"fused loss {loss.item()} disagrees with the reference {ref_loss.item()}")
            return 1
        with torch.no_grad():
            seq_p = [_sequence_logp(logits, r).sum().exp().item() for r in responses]
        n = stats.num_tokens.item()
        print(f"{step:>4} {loss.item():>9.5f} {stats.clipped_low.item() / n:>8.2%} {stats.clipped_high.item() / n:>9.2%} "
              f"{stats.ratio_sum.item() / n:>10.4f} {stats.ratio_max.item():>9.4f} "
              f"{seq_p[0] + seq_p[1]:>10.3e} {seq_p[2] + seq_p[3]:>9.3e}")
        if step < steps:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print("Correct answers became likelier and wrong ones rarer. Once every token's ratio reached its clip bound\n"
          "the gradient vanished: the trust region ends learning from this rollout until the next one is sampled.")
    return 0
