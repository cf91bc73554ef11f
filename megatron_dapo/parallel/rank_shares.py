"""How the kept batch is dealt out to data-parallel ranks, and the packed form a rank's share travels in.

The batch (responses in draw order) is cut into the step's updates as contiguous runs, the same runs whatever
the data-parallel size; inside each run, every response goes to the rank with the fewest tokens so far (longest
first), so that ranks finish their forward and backward together however long the responses are. Every rank
gets at least one response per update. A rank's share travels as a few flat host tensors (PackedShare), not as
Python lists: at the paper's scale a batch holds ~40M tokens.
"""

from __future__ import annotations

import array
import heapq
from dataclasses import dataclass, fields

import numpy as np
import torch

from megatron_dapo.samples import TrainItem


def deal_by_tokens(items: list[TrainItem], dp_size: int, updates: int) -> list[list[list[TrainItem]]]:
    """shares[r][j]: the responses data-parallel rank r trains on in update j (min(updates, len / dp_size)
    updates), each in draw order."""
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} responses do not divide across {dp_size} data-parallel ranks")
    per_rank = len(items) // dp_size
    count = min(updates, per_rank)
    bounds = [dp_size * round(j * per_rank / count) for j in range(count + 1)] if count else [0]
    shares: list[list[list[TrainItem]]] = [[] for _ in range(dp_size)]
    for j in range(count):
        run = range(bounds[j], bounds[j + 1])
        loads = [(0, 0, r) for r in range(dp_size)]  # (tokens, responses, rank): the least loaded first
        dealt: list[list[int]] = [[] for _ in range(dp_size)]
        for i in sorted(run, key=lambda i: -_tokens(items[i])):
            tokens, n, r = heapq.heappop(loads)
            dealt[r].append(i)
            heapq.heappush(loads, (tokens + _tokens(items[i]), n + 1, r))
        for r in range(dp_size):
            shares[r].append([items[i] for i in sorted(dealt[r])])
    return shares


def _tokens(item: TrainItem) -> int:
    return len(item.prompt_ids) + len(item.output_ids)


def _packed_routes(routes: list[np.ndarray]) -> dict:
    layouts = {(r.shape[1:], r.dtype) for r in routes}
    if len(layouts) != 1:
        raise ValueError(f"routes: responses of one batch have routes of different layouts {sorted(map(str, layouts))}")
    (layers, topk), dtype = layouts.pop()
    return {"routes": torch.from_numpy(np.concatenate([np.ascontiguousarray(r).reshape(-1).view(np.uint8)
                                                      for r in routes])),
            "route_rows": torch.tensor([len(r) for r in routes], dtype=torch.int64),
            "route_layout": torch.tensor([layers, topk, dtype.itemsize], dtype=torch.int64)}


@dataclass
class PackedShare:
    """One data-parallel rank's responses as flat host tensors."""

    tokens: torch.Tensor  # int32 [sum(prompt_lens + output_lens)]: each response's prompt ids, then its output ids
    prompt_lens: torch.Tensor  # int64 [n]
    output_lens: torch.Tensor  # int64 [n]
    rollout_logp: torch.Tensor  # float64 [sum(output_lens)]: the engine's log-prob of each output token
    advantages: torch.Tensor  # float64 [n]
    in_loss: torch.Tensor  # bool [n]: False for a response left out of the loss (overlong filtering)
    update_sizes: torch.Tensor  # int64 [updates]: responses per update, in order
    # A mixture of experts' routes (routing replay), else all three empty: each response's TrainItem.routes
    # flattened as bytes (route_dtype's ids, viewed), how many route rows each response has, and (MoE layers,
    # top_k, bytes per id)
    routes: torch.Tensor = None
    route_rows: torch.Tensor = None
    route_layout: torch.Tensor = None

    def __post_init__(self):
        if self.routes is None:  # no routes (and the prefetched batches of checkpoints from before them)
            self.routes, self.route_rows = torch.empty(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64)
            self.route_layout = torch.zeros(0, dtype=torch.int64)

    @classmethod
    def pack(cls, updates: list[list[TrainItem]]) -> PackedShare:
        items = [it for update in updates for it in update]
        routed = [it.routes is not None for it in items]
        if any(routed) and not all(routed):
            raise ValueError(f"routes: {routed.count(False)} of {len(items)} responses came without routes; "
                             "an engine returns them for every response or for none")

        def flat(rows, code: str, dtype: torch.dtype) -> torch.Tensor:
            # Through array.array: about 3x faster than torch.tensor(list) at ~40M tokens.
            out = array.array(code)
            for row in rows:
                out.extend(row)
            return torch.frombuffer(out, dtype=dtype).clone() if out else torch.empty(0, dtype=dtype)

        return cls(
            tokens=flat((ids for it in items for ids in (it.prompt_ids, it.output_ids)), "i", torch.int32),
            prompt_lens=torch.tensor([len(it.prompt_ids) for it in items], dtype=torch.int64),
            output_lens=torch.tensor([len(it.output_ids) for it in items], dtype=torch.int64),
            rollout_logp=flat((it.rollout_logp for it in items), "d", torch.float64),
            advantages=torch.tensor([it.advantage for it in items], dtype=torch.float64),
            in_loss=torch.tensor([it.in_loss for it in items], dtype=torch.bool),
            update_sizes=torch.tensor([len(u) for u in updates], dtype=torch.int64),
            **(_packed_routes([it.routes for it in items]) if items and all(routed) else {}))

    def __len__(self) -> int:
        return self.prompt_lens.numel()

    def train_items(self) -> list[TrainItem]:
        """The responses as TrainItems again, in order (what `pack` was given, flattened)."""
        prompt_lens, output_lens = self.prompt_lens.tolist(), self.output_lens.tolist()
        logps = self.rollout_logp.split(output_lens)
        routes = self.response_routes()
        return [TrainItem(seq[:p].tolist(), seq[p:].tolist(), lp.tolist(), adv, keep, r)
                for seq, p, lp, adv, keep, r in zip(self.sequences(), prompt_lens, logps, self.advantages.tolist(),
                                                    self.in_loss.tolist(), routes)]

    def response_routes(self) -> list[np.ndarray | None]:
        """Each response's routes, [rows, MoE layers, top_k] (views of `routes`); Nones without routes."""
        if not self.route_layout.numel():
            return [None] * len(self)
        layers, topk, itemsize = self.route_layout.tolist()
        ids = self.routes.numpy().view(np.dtype(f"<u{itemsize}" if itemsize == 1 else f"<i{itemsize}"))
        return np.split(ids.reshape(-1, layers, topk), np.cumsum(self.route_rows.numpy())[:-1])

    def sequences(self) -> list[torch.Tensor]:
        """Each response's prompt + output ids (views into `tokens`)."""
        return list(self.tokens.split((self.prompt_lens + self.output_lens).tolist()))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
