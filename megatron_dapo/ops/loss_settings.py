"""The rules for the loss's settings, in one place and without torch: the fused op checks its arguments against
them on every call, and the run's config checks loss.* up front (also in processes that never run the op, such as
the reward's judging processes, which must not pay for loading torch)."""

from __future__ import annotations

import math

MAX_LOG_RATIO_CLAMP = 80.0  # exp(80) still fits in float32
KL_TYPES = ("k1", "k3")
AGGREGATIONS = ("token", "sample")  # loss.aggregation; ops/loss_aggregation.py says what each means


class DapoLossParamError(ValueError):
    """A loss setting the op refuses; `param` names it (the config reports it as loss.<param>)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"dapo_loss: {param} {message}")
        self.param, self.message = param, message


def check_dapo_loss_params(*, eps_low, eps_high, dual_clip_c, log_ratio_clamp, kl_coef, kl_type) -> None:
    """The op's rules for its settings, in one place: the kernels' checks and the run's config both use them.
    Messages are formatted only for a setting that fails: the op checks its settings on every call."""
    rules = [
        ("eps_low", 0.0 < eps_low < 1.0, "must be in (0, 1), got {eps_low}"),
        ("eps_high", eps_high > 0.0, "must be > 0, got {eps_high}"),
        ("dual_clip_c", dual_clip_c is None or dual_clip_c > 1.0,
         "must be > 1 (or None to turn dual clip off), got {dual_clip_c}"),
        ("log_ratio_clamp", 0.0 < log_ratio_clamp <= MAX_LOG_RATIO_CLAMP,
         "must be in (0, {limit}] (exp of it must fit in float32), got {log_ratio_clamp}"),
        ("kl_type", kl_type in KL_TYPES, "must be one of {kl_types}, got {kl_type!r}"),
        ("kl_coef", kl_coef >= 0.0, "must be >= 0, got {kl_coef}"),
    ]
    for param, ok, message in rules:
        if not ok:
            raise DapoLossParamError(param, message.format(
                eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c, log_ratio_clamp=log_ratio_clamp,
                kl_type=kl_type, kl_coef=kl_coef, limit=MAX_LOG_RATIO_CLAMP, kl_types=KL_TYPES))


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"must be one of {', '.join(map(repr, AGGREGATIONS))}, got {aggregation!r}")


# The rollout correction (ops/rollout_correction.py says what each level and action computes).
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_ACTIONS = ("truncate", "mask", "reject")
# The recipes of other stacks, by name: (level, action, lower, upper). A bound of None is no bound.
CORRECTION_PRESETS: dict[str, tuple[str, str, float | None, float]] = {
    "tis": ("token", "truncate", None, 2.0),  # truncated IS, per token (verl's decoupled_token_is, Miles' TIS)
    "icepop": ("token", "mask", 0.5, 5.0),  # IcePop (Ring-1T; slime): a two-sided token mask, kept tokens weighted
    "seq_mask": ("sequence", "mask", None, 3.0),  # TRL's default: the sequence's IS weight, 0 past the cap
    "geo_rs": ("geometric", "reject", 0.99, 1.01),  # SkyRL's first choice: rejection on the geometric mean
    "seq_mis": ("sequence", "mask", None, 2.0),  # masked IS (verl's Seq-MIS): sequences over the cap rejected
}


def check_correction_params(*, level, action, lower, upper) -> None:
    """The rollout correction's rules, in one place (the config's loss.correction.* and the op's arguments).
    `param` of the error: the key under loss.correction."""
    def fail(param, message):
        raise DapoLossParamError(param, message)

    def finite(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if level not in CORRECTION_LEVELS:
        fail("level", f"must be one of {', '.join(map(repr, CORRECTION_LEVELS))}, got {level!r}")
    if action not in CORRECTION_ACTIONS:
        fail("action", f"must be one of {', '.join(map(repr, CORRECTION_ACTIONS))}, got {action!r}")
    if not finite(upper):
        fail("upper", f"must be a finite number, got {upper!r}")
    if action == "truncate":
        if lower is not None:
            fail("lower", f"is for 'mask' and 'reject' (a band the ratio must fall in); 'truncate' only caps the "
                          f"weight at upper: remove lower ({lower}), or set action to 'mask'")
        if upper < 1:
            fail("upper", f"caps the weight, and must be >= 1 (a cap below 1 shrinks every matched token), got {upper}")
        return
    if lower is not None and not (finite(lower) and lower >= 0):
        fail("lower", f"must be a finite number >= 0 or null (no lower bound), got {lower!r}")
    if lower is not None and lower >= upper:
        fail("lower", f"must be below upper: [{lower}, {upper}] is out of order")
    if not ((lower is None or lower < 1) and upper > 1):
        fail("upper" if upper <= 1 else "lower",
             f"the band [{lower if lower is not None else 0}, {upper}] must hold 1 inside it (lower < 1 < upper): a "
             "token whose engine and trainer agree exactly has ratio 1 and would leave the loss")
