"""How a step's per-token loss terms are averaged: the one rule both the trainer and the config use.

"token" (DAPO, the default): every loss token of the step weighs the same, so a long response moves the update
in proportion to its length. "sample" (GRPO): each response's terms are averaged over its own loss tokens first,
then the responses are averaged, so every response weighs the same whatever its length. Both are the fused op's
one weighted token sum: "sample" weights each token by 1 / (its response's loss tokens) and divides by the number
of responses with a loss token instead of the number of loss tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.ops.loss_settings import check_aggregation


def aggregation_weights(mask: torch.Tensor, lengths: Sequence[int],
                        aggregation: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """For a packed loss mask (bool, the responses' tokens back to back, `lengths` long): the per-token weights to
    multiply into the loss (float32; None: all 1) and what this part of the step adds to the normaliser (loss
    tokens, or responses with at least one loss token), a 0-d int tensor on the mask's device. Nothing is read on
    the host: on a GPU this runs once per micro-batch."""
    check_aggregation(aggregation)
    if aggregation == "token":
        return None, mask.sum().to(torch.int)
    lens = torch.tensor(list(lengths)).to(mask.device, non_blocking=True)  # from the host: no wait on the device
    response = torch.repeat_interleave(torch.arange(len(lens), device=mask.device), lens, output_size=mask.numel())
    counts = torch.zeros(len(lens), device=mask.device).index_add_(0, response, mask.float())
    return mask.float() / counts.clamp_min(1.0)[response], (counts > 0).sum().to(torch.int)


def loss_units(masks: Sequence[torch.Tensor], aggregation: str) -> int:
    """On the host, before a step: what `masks` (each response's loss mask) add to the normaliser, counted as
    aggregation_weights counts it: loss tokens, or responses with at least one loss token ("sample")."""
    check_aggregation(aggregation)
    if aggregation == "sample":
        return sum(int(bool(m.any())) for m in masks)
    return sum(int(m.sum()) for m in masks)
