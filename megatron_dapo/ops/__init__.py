"""Fused operators, each beside the plain PyTorch reference that defines it: dapo_loss (the kernel's autograd
wrapper), dapo_loss_reference, kl_penalty, loss_aggregation; loss_settings holds the rules for their settings
without torch. The run's config reads loss_settings in processes that never run an op (the reward's judging
processes), so importing this package loads no torch: `megatron_dapo.ops.dapo_loss`, the function, is imported on
first use."""

import sys
import types


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing the module dapo_loss.py sets it as this package's attribute of its name, which would shadow the
        # function (`from megatron_dapo.ops import dapo_loss` gave the module): the attribute stays the function.
        if name == "dapo_loss" and isinstance(value, types.ModuleType):
            value = value.dapo_loss
        super().__setattr__(name, value)


def __getattr__(name):
    if name == "dapo_loss":
        from megatron_dapo.ops.dapo_loss import dapo_loss

        return dapo_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
