"""Fused operators, each beside the plain PyTorch reference that defines it."""

from megatron_dapo.ops.dapo_loss import dapo_loss, extension_error
from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES, DapoLossStats
from megatron_dapo.ops.dapo_loss_reference import dapo_loss_reference
from megatron_dapo.ops.kl_penalty import kl_penalty

__all__ = ["STAT_NAMES", "DapoLossStats", "dapo_loss", "dapo_loss_reference", "extension_error", "kl_penalty"]
