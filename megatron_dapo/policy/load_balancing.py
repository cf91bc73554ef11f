"""A mixture of experts' load-balancing loss in a policy step: its strength, and its value for the metrics.

megatron-core's routers (per-token loss mode) add `coefficient x aux x (tokens the router saw in the micro-batch)`
to the gradient, and the step then divides every gradient by the loss's units: response tokens in the loss, or
responses under loss.aggregation "sample" (policy/train_step.py). Left so, the aux loss's strength follows those
units: 10x under "sample" for responses of 10 tokens, 2x when half the responses are filtered out of the loss, and
more when prompts grow. For the step, the coefficient is scaled by units / routed tokens (both summed over the
micro-batches and the data-parallel ranks), so that the aux gradient is the coefficient times the mean of the
micro-batches' aux gradients weighted by the tokens each routes: whatever the aggregation, the prompts' lengths, the
responses in the loss or the micro-batch split. The tokens routed are all of a micro-batch's: prompts, responses,
and its padding (megatron-core's padding mask is left off: under sequence and context parallelism it weights each
rank's share of the gradient by the valid tokens it holds, which is no longer the aux loss's gradient).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_dapo.policy.batch import MicroBatch


def routed_tokens(config, mbs: list[MicroBatch]) -> int:
    """The tokens this rank's routers see over the step's micro-batches, as megatron-core counts them for the aux
    loss: each micro-batch's ids on this rank (its context-parallel share), split over the tensor-parallel ranks by
    sequence parallelism (which a mixture of experts at TP > 1 has)."""
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return sum(mb.input_ids.numel() for mb in mbs) // split


@contextmanager
def step_coefficient(config, units: int, routed: int, device: torch.device):
    """The step's load-balancing coefficient in `config` (restored after): model.moe_aux_loss_coef x units / routed
    tokens, each summed over the data-parallel ranks. Collective over the data-parallel group when the model has a
    load-balancing loss. A step with no loss unit keeps the coefficient (its gradient is divided by at least 1)."""
    from megatron.core import parallel_state

    coefficient = config.moe_aux_loss_coeff
    if not config.num_moe_experts or not coefficient:
        yield
        return
    counts = torch.tensor([units, routed], dtype=torch.float64, device=device)
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    units, routed = counts.tolist()
    config.moe_aux_loss_coeff = coefficient * units / routed if units > 0 else coefficient
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coefficient


def tracked_loss(config, micro_batches: int, device: torch.device) -> float | None:
    """The step's load-balancing loss from megatron-core's tracker (which its routers fill in training, before the
    coefficient), the mean over the MoE layers and the micro-batches, reduced over the pipeline, tensor and
    data-parallel ranks as megatron-core reduces it; then emptied for the next step. Collective. None without a
    load-balancing loss."""
    if not config.num_moe_experts or not config.moe_aux_loss_coeff:
        return None
    from megatron.core.transformer.moe import moe_utils

    name = "load_balancing_loss"
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    # a stage without MoE layers has no entry, and still takes part in the sum over the pipeline
    entry = tracker.setdefault(name, {"values": torch.zeros(config.num_layers, device=device)})
    entry["values"] /= micro_batches  # each layer's sum over this rank's micro-batches -> their mean
    moe_utils.reduce_aux_losses_tracker_across_ranks([name])
    value = entry["values"].sum() / sum(config.moe_layer_freq)
    moe_utils.clear_aux_losses_tracker()
    return value.item()
