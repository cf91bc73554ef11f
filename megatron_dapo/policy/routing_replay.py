"""Routing replay: the trainer's routers choose the experts the rollout engine chose, token by token.

The engine and the trainer compute a router's top-k with different kernels, so the same token can reach other
experts on the two sides (Megatron-LM's report on Qwen3-30B-A3B: 94% of tokens in at least one layer), and the
trainer's log-probs are then those of another computation than the one sampled. With replay each sequence carries
its routes, `[tokens, MoE layers, top_k]` expert ids (every position the model processes, prompt included), and
every router of the trainer takes them instead of its own top-k, in the old-log-prob recompute and in training. The
router's probabilities are still its own scores at those experts, so its gradient flows (megatron-core's
RouterReplay: `scores.gather(1, routes)`).

Layout: a router sees its micro-batch as `[length, rows]` flattened (sequence-major), and with sequence
parallelism only its tensor-parallel rank's slice of the length. Each stage's routers are its MoE layers in order.
With activation recompute a layer's forward runs again inside the backward, after later micro-batches' forwards
(1F1B): each router then replays from a queue, in the order the forwards ran (megatron-core's REPLAY_BACKWARD).
"""

from __future__ import annotations

import torch

from megatron_dapo.errors import DapoError
from megatron_dapo.policy.batch import MicroBatch


class RoutesMissing(DapoError, ValueError):
    """Routing replay is on and a sequence came without its routes."""


class RoutesInvalid(DapoError, ValueError):
    """A sequence's routes do not fit the model: another shape, an id past its experts, an expert named twice."""


def check_routes(sequences, moe_layers: int, topk: int, experts: int) -> None:
    """Every sequence's routes (those it has) are [tokens, `moe_layers`, `topk`] ids of distinct experts in
    [0, `experts`): refused by sequence otherwise. Replayed as they are, routes of another shape route silently
    wrong (a column too many or too few is read as another layer's or another expert's), and an id out of range
    fails as a bare IndexError, or a device assert on a GPU. Today's engines cannot produce them; a resumed buffer of
    another model, or another engine, can."""
    for i, s in enumerate(sequences):
        routes = s.routes
        if routes is None:
            continue
        if tuple(routes.shape[1:]) != (moe_layers, topk):
            raise RoutesInvalid(f"sequence {i}: routes of {routes.shape[1]} MoE layers x {routes.shape[2]} experts a "
                                f"token, but the model routes {moe_layers} MoE layers x top {topk}: routes of another "
                                "model, or of another engine's layout")
        bad = (routes < 0) | (routes >= experts)
        if bool(bad.any()):
            token, layer, slot = bad.nonzero()[0].tolist()
            raise RoutesInvalid(f"sequence {i}: token {token}, MoE layer {layer}: expert id "
                                f"{int(routes[token, layer, slot])} is not one of the model's {experts} experts "
                                f"(0 to {experts - 1})")
        ordered = routes.sort(dim=-1).values
        twice = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if bool(twice.any()):
            token, layer = twice.nonzero()[0].tolist()
            raise RoutesInvalid(f"sequence {i}: token {token}, MoE layer {layer} names an expert twice "
                                f"({routes[token, layer].tolist()}): a token's top {topk} experts are distinct")


def routers_of(model) -> list:
    """The stage's MoE routers (megatron-core TopKRouter modules), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def moe_layer_index(router) -> int:
    """A router's MoE layer over the whole model (its layer_number counts every decoder layer from 1 over the
    pipeline; the index counts the sparse ones from 0), where routes and per-layer metrics put it."""
    return sum(router.config.moe_layer_freq[: router.layer_number - 1])


def router_order(per_position: torch.Tensor, tp: int) -> torch.Tensor:
    """A micro-batch's `[rows, length, ...]` per-position values in the order a router sees its tokens: `[length x
    rows, ...]` flattened sequence-major, with sequence parallelism (`tp` > 1) only this tensor-parallel rank's slice
    of the length."""
    from megatron.core import parallel_state

    out = per_position.transpose(0, 1)
    if tp > 1:
        part = out.shape[0] // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        out = out[rank * part:(rank + 1) * part]
    return out.reshape(-1, *out.shape[2:])


def sequence_parallel_size(config) -> int:
    """How many slices of the length a router's tokens are (sequence parallelism cuts it over the TP ranks)."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def forget_global_instances() -> None:
    """megatron-core keeps every RouterReplay ever built in a class-global list, for its static API; this code
    addresses each router's own, so the list would only hold models that are gone."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


class RouteReplayer:
    """Forces the routers of one model stage to the micro-batches' routes, pass by pass."""

    def __init__(self, model):
        self.routers = routers_of(model)
        if not self.routers or any(r.router_replay is None for r in self.routers):
            raise ValueError("RouteReplayer: the model has no router built for replay (build it with "
                             "routing_replay=True)")
        config = self.routers[0].config
        self.layers = [moe_layer_index(r) for r in self.routers]
        self.topk = config.moe_router_topk
        self.moe_layers, self.experts = sum(config.moe_layer_freq), config.num_moe_experts
        self.tp = sequence_parallel_size(config)
        self.device = next(model.parameters()).device

    def check(self, sequences) -> None:
        """The pass's sequences' routes fit this model (check_routes)."""
        check_routes(sequences, self.moe_layers, self.topk, self.experts)

    def begin(self) -> None:
        """Before a pass over micro-batches (a recompute, a training step): empty every router's queue."""
        self.end()

    def end(self) -> None:
        """After a pass: the routers hold no routes (a pass's routes would stay until the next one: at the 30B
        config, gigabytes a rank) and route by themselves until the next before_forward."""
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()

    def before_forward(self, mb: MicroBatch, recompute: bool):
        """Set each router to `mb`'s routes; returns what to call on the forward's output (a hook that switches the
        routers to their queues when that micro-batch's backward starts, where its layers are recomputed). The
        routes go to the device once for all the stage's routers (kept small, uint8 or int16, until there), and
        are queued for the backward only where it recomputes the forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not mb.sample_index:  # a filler micro-batch: all padding
            routes = torch.zeros(*mb.input_ids.shape, len(self.layers), self.topk, dtype=torch.uint8)
            fill = torch.ones(mb.input_ids.shape, dtype=torch.bool)
        elif mb.routes is None:
            raise RoutesMissing(
                f"sequence {mb.routes_missing[0]} has no routes, and routing replay is on: the rollout engine must "
                "return the experts it chose for every token (SGLang: --enable-return-routed-experts); replay never "
                "falls back to the trainer's own routing")
        else:
            routes, fill = mb.routes[:, :, self.layers], mb.route_fill  # [rows, length, my layers, k], [rows, length]
        routes, fill = router_order(routes, self.tp), router_order(fill, self.tp)
        if self.device.type == "cuda":
            routes, fill = routes.pin_memory(), fill.pin_memory()
        routes = routes.to(self.device, non_blocking=True).long()  # gather's index type, on the device only
        routes = self._spread(routes, fill.to(self.device, non_blocking=True))
        for i, r in enumerate(self.routers):
            mine = routes[:, i].contiguous()
            if recompute:
                r.router_replay.set_target_indices(mine)  # and queued for the recompute in the backward
            else:
                r.router_replay.target_topk_idx = mine
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        def on_output(output):
            if recompute and output.requires_grad:
                output.register_hook(self._to_queues)
            return output

        return on_output

    def _spread(self, routes: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """`routes` [tokens, layers, k] with the `fill` positions (padding) routed round-robin over the experts, k
        distinct ones each: all on experts 0..k-1, they would all land on one expert-parallel rank."""
        tokens = torch.arange(routes.shape[0], device=routes.device)
        spread = (tokens[:, None] * self.topk + torch.arange(self.topk, device=routes.device)) % self.experts
        return torch.where(fill[:, None, None], spread[:, None, :], routes)

    def _to_queues(self, grad):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad
