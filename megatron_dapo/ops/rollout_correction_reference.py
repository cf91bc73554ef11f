"""The rollout correction one response and one token at a time, in Python floats (float64): the readable
definition ops/rollout_correction.py is held to."""

from __future__ import annotations

import math

LOG_WEIGHT_CLAMP = 20.0  # as ops/rollout_correction.py's, written out: the reference shares no code with it


def correction_weights_reference(log_ratios: list[list[float]], in_loss: list[list[bool]], *, level: str,
                                 action: str, lower: float | None, upper: float) -> list[list[float]]:
    """Per response (a list of its tokens' log pi_old - log pi_rollout, and which tokens are in the loss), its
    tokens' weights."""
    out = []
    for r, keep in zip(log_ratios, in_loss):
        loss_r = [x for x, k in zip(r, keep) if k]
        if level == "token":
            exponents = list(r)
        elif level == "sequence":
            exponents = [math.fsum(loss_r)] * len(r)
        else:  # geometric
            exponents = [math.fsum(loss_r) / len(loss_r) if loss_r else 0.0] * len(r)
        weights = []
        for e in exponents:
            rho = math.exp(min(max(e, -LOG_WEIGHT_CLAMP), LOG_WEIGHT_CLAMP))
            if action == "truncate":
                weights.append(min(rho, upper))
                continue
            inside = rho <= upper and (lower is None or rho >= lower)
            weights.append((rho if action == "mask" else 1.0) if inside else 0.0)
        out.append(weights)
    return out
