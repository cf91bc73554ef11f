"""A mixture of experts' load-balancing loss in a policy step: the switch loss over each micro-batch's real tokens,
at a strength that follows nothing but its coefficient.

megatron-core's own aux loss is left off (its coefficient 0 in the model's config). Its per-token mode counted
padding and filler rows as routed tokens, added `aux x tokens` with each sequence- or context-parallel rank's own
count (so with a padding mask each rank's share of the gradient got another weight), and the step's division by
the loss's units (response tokens, or responses under loss.aggregation "sample") made its strength follow those
units. Here a hook on each router computes megatron-core's switch loss (its own functions) over the micro-batch's
real tokens only: the tokens each expert got and the routers' scores, summed over the sequence- and
context-parallel ranks that split the micro-batch; it is attached to the router's output with the weight

    coefficient x (its micro-batch's real tokens) x units / (the step's real tokens, over every micro-batch and DP rank)

the same on every rank of a micro-batch, so that after the step divides by its units the aux gradient is the
coefficient times the mean of the micro-batches' aux gradients weighted by their real tokens: whatever the
aggregation, the prompts' lengths, the responses in the loss, the padding or the micro-batch split. A filler
micro-batch (all padding) adds nothing. As in megatron-core, the loss routes by each router's own top k (with
routing replay too) and its gradient reaches the router through its scores.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from megatron_dapo.policy.batch import MicroBatch
from megatron_dapo.policy.routing_replay import moe_layer_index, router_order, routers_of, sequence_parallel_size


def aux_coefficient(spec, configured: float | None) -> float:
    """The load-balancing loss's coefficient: model.moe_aux_loss_coef, else config.json's router_aux_loss_coef."""
    return spec.router_aux_loss_coef if configured is None else configured


class LoadBalancing:
    """The switch loss of one policy step over a model stage's routers (a context manager around the step's
    forwards and backwards; `micro_batch` before each forward). `coefficient`: model.moe_aux_loss_coef (0: off, and
    nothing is computed). `units`: the step's loss units on this rank; `mbs`: its micro-batches. Collective over the
    data-parallel group (with context parallelism) when on."""

    def __init__(self, model, coefficient: float, units: float, mbs: list[MicroBatch], recompute: bool):
        from megatron.core import parallel_state

        config = model.config
        self.on = bool(config.num_moe_experts) and coefficient > 0
        self.routers = routers_of(model) if self.on else []
        self.layers = {id(r): moe_layer_index(r) for r in self.routers}
        self.tp, self.recompute = sequence_parallel_size(config), recompute
        device = next(model.parameters()).device
        self.values = torch.zeros(sum(config.moe_layer_freq) if self.on else 0, dtype=torch.float64, device=device)
        self._mask: torch.Tensor | None = None
        self._queues = {id(r): deque() for r in self.routers}
        self._hooks = []
        if not self.on:
            return
        # over the data-parallel ranks: the loss's units, the micro-batches that hold samples; and the real tokens,
        # which the context-parallel ranks split
        counts = torch.tensor([units, sum(1 for mb in mbs if mb.sample_index)], dtype=torch.float64, device=device)
        real = torch.tensor([sum(int(mb.real.sum()) for mb in mbs)], dtype=torch.float64, device=device)
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        dist.all_reduce(real, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        (units, self.micro_batches), real = counts.tolist(), real.item()
        self.scale = coefficient * (units / real if units > 0 and real > 0 else 1.0)

    def micro_batch(self, mb: MicroBatch) -> None:
        """The next forward is `mb`'s."""
        if self.on:
            self._mask = router_order(mb.real, self.tp).to(self.values.device)

    def __enter__(self) -> LoadBalancing:
        self._hooks = [r.register_forward_hook(self._attach) for r in self.routers]
        return self

    def __exit__(self, *_) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _attach(self, router, args, output):
        from megatron.core.transformer.moe.moe_utils import (
            MoEAuxLossAutoScaler,
            compute_routing_scores_for_aux_loss,
            get_tokens_per_expert_and_token_count,
            switch_load_balancing_loss_func,
        )

        queue = self._queues[id(router)]
        if not torch.is_grad_enabled():  # a recompute's first forward: its backward recomputes it, after others'
            if self.recompute and router.training:
                queue.append(self._mask)
            return None
        if not router.training:
            return None
        real = queue.popleft() if self.recompute else self._mask
        config = router.config
        logits = router.gating(args[0]).view(-1, config.num_moe_experts)
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, router.topk, router.score_function,
                                                                  padding_mask=~real)
        per_expert, _, total = get_tokens_per_expert_and_token_count(routing_map, router.tp_cp_group, router.topk,
                                                                     with_padding_mask=True)
        total = total.clamp(min=1)  # a filler: no token, no loss (0 / 0 otherwise)
        mine = switch_load_balancing_loss_func(scores, per_expert, total, router.topk, config.num_moe_experts, 1.0)
        self.values[self.layers[id(router)]] += mine.detach().double()
        probs, chosen = output
        return MoEAuxLossAutoScaler.apply(probs, mine * (self.scale * total)), chosen

    def value(self) -> float | None:
        """The step's switch loss (before its coefficient): the mean over the MoE layers and the micro-batches that
        hold samples. Collective over all ranks; None when off."""
        if not self.on:
            return None
        if dist.is_initialized() and dist.get_world_size() > 1:
            # the sequence- and context-parallel ranks' shares add up to a micro-batch's loss, the pipeline stages
            # hold their layers, the data-parallel ranks their micro-batches; tensor parallelism without SP counts
            # each micro-batch on every TP rank alike (a mixture of experts at TP > 1 has SP)
            dist.all_reduce(self.values)
        return self.values.sum().item() / max(self.micro_batches, 1) / len(self.values)
