"""A mixture of experts' routes as an engine returns them, in the trainer's layout (routing replay).

SGLang (`--enable-return-routed-experts`, a request's `return_routed_experts`) returns, per response, the logical
expert ids its routers chose for every position it ran, prompt then output but the last output token:
`meta_info["routed_experts"]`, base64 of int32 `[positions, num_hidden_layers, top_k]`, a row for every decoder
layer, dense ones included. The trainer replays the MoE layers' rows (policy/routing_replay.py), kept in the
smallest id type (samples.route_dtype).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from megatron_dapo.samples import route_dtype


class RoutesError(RuntimeError):
    """An engine's routes are missing or do not fit the model."""


@dataclass(frozen=True)
class RouteLayout:
    num_layers: int
    moe_layers: tuple[bool, ...]  # which decoder layers have experts (ModelSpec.moe_layers)
    topk: int
    num_experts: int

    @classmethod
    def of(cls, spec) -> RouteLayout:
        """For a policy.hf_config.ModelSpec of a mixture of experts."""
        return cls(spec.num_layers, tuple(spec.moe_layers), spec.moe_topk, spec.num_experts)

    def from_sglang(self, meta_info: dict, positions: int, where: str) -> np.ndarray:
        """[positions, MoE layers, top_k] from a response's meta_info; `positions` = prompt + output - 1."""
        encoded = meta_info.get("routed_experts")
        if encoded is None:
            raise RoutesError(f"{where}: the server returned no routes, and rollout.routing_replay is on: start it with "
                              "--enable-return-routed-experts (servers the run starts get it)")
        ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        per_position = self.num_layers * self.topk
        if ids.size != positions * per_position:
            raise RoutesError(f"{where}: {ids.size} routed expert ids, expected {positions} positions x "
                              f"{self.num_layers} layers x top {self.topk} = {positions * per_position}")
        routes = ids.reshape(positions, self.num_layers, self.topk)[:, list(self.moe_layers)]
        if routes.size and not 0 <= routes.min() <= routes.max() < self.num_experts:
            raise RoutesError(f"{where}: expert ids {routes.min()}..{routes.max()} outside the model's "
                              f"{self.num_experts} experts")
        return routes.astype(route_dtype(self.num_experts))
