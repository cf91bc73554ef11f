"""Logits only where the loss needs them: the output layer, and after it the log-softmax and entropy, run on the
positions that predict response tokens, not on prompts and padding.

megatron-core's GPTModel applies its output layer to every position ([s, b, h] -> [s, b, V/TP]). A forward pre-hook
on that layer hands it the chosen rows instead, [n, 1, h] in the order given, so the model returns [1, n, V/TP].
With sequence parallelism each tensor-parallel rank holds a slice of the sequence and the layer all-gathers it:
the hook gathers the whole sequence first (its backward keeps this rank's slice of the gradient, which the
gathered copies' gradients already sum), picks the rows, pads them to a multiple of TP and hands the layer this
rank's slice of them (scatter_to_sequence_parallel_region: its backward all-gathers what the layer's
reduce-scatter gives back).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def output_layer_of(model):
    """The GPTModel stage's output layer under any wrappers (DDP, Float16Module); None off the last stage."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None


def rows_computed(n: int, tp: int, sequence_parallel: bool) -> int:
    """How many rows the output layer computes for `n` chosen positions: at least one per rank (no empty
    collective), a multiple of TP with sequence parallelism."""
    multiple = tp if sequence_parallel else 1
    return max(multiple, -(-n // multiple) * multiple)


@contextmanager
def logits_at(model, positions: torch.Tensor):
    """While inside, `model`'s forward returns logits at `positions` only: flat indices into its [rows, length]
    input (row-major), [1, rows_computed(len(positions)), V/TP], the first len(positions) rows those asked for."""
    layer = output_layer_of(model)
    if layer is None:
        yield
        return
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    def pick(module, args, kwargs):
        hidden = args[0]  # [s (/ TP with SP), b, h]
        sp = module.sequence_parallel
        if sp:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=module.tp_group)
        flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        rows = flat.index_select(0, positions)
        pad = rows_computed(len(positions), module.tp_group.size(), sp) - len(positions)
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        rows = rows[:, None]  # [n, 1, h]
        if sp:
            rows = scatter_to_sequence_parallel_region(rows, group=module.tp_group)
        return (rows, *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
