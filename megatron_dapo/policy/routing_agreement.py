"""Routing agreement under routing replay (the R3 diagnostic): per MoE layer, the share of response tokens whose
trainer's own top-k, from its own scores, is the set of experts the rollout engine chose and the trainer replays.

Replay makes the trainer compute what was sampled; this says how far its own routing has drifted from it, which
is what replay hides: 1 where the engine and the trainer agree, lower where their kernels (or an older policy's
weights, in one_step_off and async) route the same token elsewhere. Measured in the pass over the old policy's
weights: the old-log-prob recompute, or the step's first update where nothing is recomputed (loss.old_logprobs
"rollout"). Counted at the positions whose logits give a response token's log-prob, each counted once even where
activation recompute runs its forward again (then in the backward, after later micro-batches' forwards under a
pipeline schedule: only the first, graph-less forward counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.policy.batch import MicroBatch
from megatron_dapo.policy.routing_replay import moe_layer_index, router_order, routers_of, sequence_parallel_size


class RoutingAgreement:
    """A context manager over one model stage's routers (built for replay) that counts, micro-batch by micro-batch
    (`micro_batch` before each forward), the response positions whose own top-k equals the replayed routes."""

    def __init__(self, model, recompute: bool = False):
        """`recompute`: the pass runs under activation recompute (model.activation_recompute full): each layer's
        forward then runs without a graph first and again in its backward, after later micro-batches' forwards
        under a pipeline schedule; only the first counts."""
        config = model.config
        self.recompute = recompute
        self.routers = routers_of(model)
        self.layers = {id(r): moe_layer_index(r) for r in self.routers}
        self.tp = sequence_parallel_size(config)
        device = next(model.parameters()).device
        # [agreeing, counted] per MoE layer of the whole model (this stage fills its own)
        self.counts = torch.zeros(2, sum(config.moe_layer_freq), dtype=torch.float64, device=device)
        self._positions: torch.Tensor | None = None
        self._hooks = []

    def micro_batch(self, mb: MicroBatch) -> None:
        """The next forward is `mb`'s: count at its response positions."""
        counted = torch.zeros(mb.input_ids.numel(), dtype=torch.bool)
        counted[mb.response_positions] = True
        self._positions = router_order(counted.view(mb.input_ids.shape), self.tp).to(self.counts.device)

    def __enter__(self) -> RoutingAgreement:
        self._hooks = [r.register_forward_hook(self._count) for r in self.routers]
        return self

    def __exit__(self, *_) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._positions = None

    def _count(self, router, args, output) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        if self._positions is None or self.recompute and torch.is_grad_enabled():
            return  # a forward not announced, or a recompute (its first forward, without a graph, counted)
        config = router.config
        with torch.no_grad():
            logits = router.gating(args[0]).view(-1, config.num_moe_experts)
            _, own = topk_routing_with_score_function(
                logits, router.topk, use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor, score_function=router.score_function,
                expert_bias=router.expert_bias, fused=config.moe_router_fusion)
            agree = (own == output[1]).all(dim=-1)  # output[1]: the routing map it took (replayed)
            layer = self.layers[id(router)]  # sums, not a masked select: nothing read back to the host
            self.counts[0, layer] += (agree & self._positions).sum()
            self.counts[1, layer] += self._positions.sum()

    def shares(self) -> list[float]:
        """Per MoE layer, agreeing / counted positions over every rank's tokens (each stage counts its layers;
        sequence, context and data parallelism split the tokens; tensor parallelism without SP counts them on each
        rank alike). Collective over all trainer ranks."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.counts)
        return (self.counts[0] / self.counts[1].clamp_min(1)).tolist()
