"""How evenly a mixture of experts' routers spread a training step's tokens: per MoE layer, the busiest expert's
tokens over the mean expert's (1 is perfectly even; E is every token on one expert). An expert-parallel rank waits
for its busiest expert, so this, not the load-balancing loss, is what costs time; and it is measured whatever
model.moe_aux_loss_coef is. With routing replay it is the load of the rollout's routes, which the trainer replays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.policy.routing_replay import moe_layer_index, routers_of


class ExpertLoad:
    """Counts the tokens each router sends to each expert while a training pass runs (a context manager over the
    model stage's routers). Only forwards that build a graph count: with activation recompute the first forward
    runs without one and its recompute in the backward with one, so each token counts once either way."""

    def __init__(self, model):
        config = model.config
        self.routers = routers_of(model)
        self.layers = [moe_layer_index(r) for r in self.routers]
        self.moe_layers = sum(config.moe_layer_freq) if config.num_moe_experts else 0
        self.counts = None if not self.moe_layers else \
            torch.zeros(self.moe_layers, config.num_moe_experts, dtype=torch.float64,
                        device=next(model.parameters()).device)
        self._hooks = []

    def __enter__(self) -> ExpertLoad:
        for layer, router in zip(self.layers, self.routers):
            self._hooks.append(router.register_forward_hook(self._counter(layer)))
        return self

    def _counter(self, layer: int):
        def count(_router, _args, output):
            if torch.is_grad_enabled():
                self.counts[layer] += output[1].detach().sum(0)  # routing_map [tokens, experts]
        return count

    def __exit__(self, *_) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def max_over_mean(self) -> list[float] | None:
        """Per MoE layer, the busiest expert's tokens over the mean's, summed over every rank's tokens (each stage
        counts its layers; sequence, context and data parallelism split the tokens). Collective over all trainer
        ranks; None for a dense model."""
        if self.counts is None:
            return None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.counts)
        mean = self.counts.mean(dim=1).clamp_min(1e-12)
        return (self.counts.max(dim=1).values / mean).tolist()
