"""`megatron-dapo preflight`: check that a run's config can work, from the model's config.json alone."""

from megatron_dapo.preflight.checks import Check, Report, preflight
from megatron_dapo.preflight.estimate import Hardware

__all__ = ["Check", "Hardware", "Report", "preflight"]
