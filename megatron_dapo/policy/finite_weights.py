"""Whether the policy's weights are finite: checked after every optimizer update, and before a checkpoint or an
export is written, so that a run whose weights went NaN or inf stops at the update that did it, naming it, and
leaves no checkpoint or Hugging Face folder of broken weights behind."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.errors import DapoError


class NonFiniteTraining(DapoError, RuntimeError):
    """Training made numbers that are not finite: the run stops, naming the step and what went non-finite."""


def parameter_sums(module: torch.nn.Module) -> torch.Tensor:
    """One fp32 sum per parameter of `module` (this rank's shards), on their device: a NaN or an inf anywhere in a
    parameter makes its sum non-finite, and no tensor of a parameter's size is made."""
    params = [p.detach() for p in module.parameters()]
    if not params:
        return torch.zeros(0)
    return torch.stack([p.sum(dtype=torch.float32) for p in params])


def nonfinite_parameters(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s parameters holding a NaN or an inf (this rank's shards)."""
    finite = torch.isfinite(parameter_sums(module))
    if bool(finite.all()):  # one host read in the usual case
        return []
    return [name for (name, _), ok in zip(module.named_parameters(), finite.tolist()) if not ok]


def nonfinite_on_any_rank(module: torch.nn.Module, device: torch.device) -> str | None:
    """Collective: None when every rank's weights are finite, else where they are not, as this rank sees it (its
    parameters' names, or "another rank"). One fp32 sum per parameter and one all-reduce of a flag."""
    bad = (~torch.isfinite(parameter_sums(module).to(device))).any().to(torch.float32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return None
    names = nonfinite_parameters(module)
    if not names:
        return "another rank"
    return f"rank {dist.get_rank()}: " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                                                  else "")
