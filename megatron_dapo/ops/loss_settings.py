"""The rules for the loss's settings, in one place and without torch: the fused op checks its arguments against
them on every call, and the run's config checks loss.* up front (also in processes that never run the op, such as
the reward's judging processes, which must not pay for loading torch)."""

from __future__ import annotations

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
