"""The rollout correction: a weight per loss token that moves the loss from the engine's samples to pi_old's.

The engine that sampled (pi_rollout: SGLang's kernels, precision and routing, and in one_step_off / async older
weights) is the behaviour policy; pi_old (the trainer's recompute) the proximal one the PPO ratio is taken against
(decoupled PPO). Per loss token t of a response, r_t = log pi_old(t) - log pi_rollout(t), in float64. The level
says what ratio a token is judged by:

    token:      rho_t = exp(r_t)
    sequence:   rho_t = exp(sum_s r_s)          the response's importance weight (unbiased); every token gets it
    geometric:  rho_t = exp(mean_s r_s)         its geometric mean per token (biased, length-free)

over the response's loss tokens s (a response without any: sum 0, rho 1); the exponent is clamped to
+-LOG_WEIGHT_CLAMP first. The action says what weight the token's term in the loss gets:

    truncate:   w_t = min(rho_t, upper)
    mask:       w_t = rho_t  where lower <= rho_t <= upper, else 0
    reject:     w_t = 1      where lower <= rho_t <= upper, else 0

(lower None: no lower bound). The weight multiplies the token's clipped-surrogate term (and its KL term), riding
into the fused op in its mask, so the op's single pass stays single. A weight of 0 leaves the token's term out of
the loss but not out of the normaliser: the token was sampled and belongs to the step (TRL's contract; a step whose
tokens are mostly masked moves the weights less, rather than the same amount on what is left).

exp(sum) or exp(mean): a steady per-token mismatch d makes a response of L tokens weigh exp(L d) at the sequence
level, exp(d) at the geometric one. At d = -0.003 (bf16 kernels) a 1,200-token answer weighs 0.027 against a
100-token one's 0.74: sequence-level weights shrink and reorder long answers' gradients by length, which is what
makes them unbiased and what makes their variance grow with L. Geometric weights do not, and so suit a band that
rejects a response whose tokens are off on average (geo_rs).

A response's ratio needs all its loss tokens: the weights are computed where whole responses are (the recompute
of pi_old, policy/rollout_samples.py), before any split into micro-batches or context-parallel shares, so a split
response gets the weights an unsplit one does. The readable definition: rollout_correction_reference.py.
"""

from __future__ import annotations

import torch

from megatron_dapo.ops.loss_settings import check_correction_params

# The ratio's exponent is clamped to this, so that exp of a sequence's sum stays finite in float32 as well:
# weights lie in [exp(-20), exp(20)], about [2e-9, 5e8], before the action.
LOG_WEIGHT_CLAMP = 20.0


def level_log_ratio(log_ratio: torch.Tensor, lengths: torch.Tensor, in_loss: torch.Tensor, level: str
                    ) -> torch.Tensor:
    """Per token, the exponent of its ratio at `level` (before the clamp), float64. `log_ratio`, `in_loss`: one
    entry per token of the responses laid end to end; `lengths`: each response's tokens, on the same device."""
    r = log_ratio.double()
    if level == "token":
        return r
    sums = torch.segment_reduce(torch.where(in_loss, r, 0.0), "sum", lengths=lengths)
    if level == "geometric":
        sums = sums / torch.segment_reduce(in_loss.double(), "sum", lengths=lengths).clamp(min=1.0)
    return sums.repeat_interleave(lengths, output_size=r.numel())  # output_size: no host read of the lengths


def correction_weights(log_ratio: torch.Tensor, lengths: torch.Tensor, in_loss: torch.Tensor, *, level: str,
                       action: str, lower: float | None, upper: float) -> torch.Tensor:
    """Per token, its weight in the loss (float64; the module's docstring has the equations). Arguments as
    level_log_ratio's; level, action, lower, upper: loss.correction's."""
    check_correction_params(level=level, action=action, lower=lower, upper=upper)
    rho = torch.exp(level_log_ratio(log_ratio, lengths, in_loss, level).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    if action == "truncate":
        return rho.clamp(max=upper)
    inside = rho <= upper if lower is None else (rho >= lower) & (rho <= upper)
    return torch.where(inside, rho if action == "mask" else torch.ones_like(rho), 0.0)
