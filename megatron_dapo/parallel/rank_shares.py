"""How the kept batch is dealt out to data-parallel ranks, and the packed form a rank's share travels in.

The batch (responses in draw order) is cut into the step's updates as contiguous runs, the same runs whatever
the data-parallel size (so each update's groups, and its loss normaliser, are too); each run is split over the
ranks into parts of about equal tokens (Karmarkar-Karp's largest differencing method), so that ranks finish an
update's forward and backward together however long the responses are. Every rank gets at least one response per
update. Even in tokens, not in FLOPs (attention's grow with the square of a sequence's length, by a factor of the
model's): tokens set how many micro-batches of the token budget a rank runs; bench/bench_balance.py measures the
FLOPs this leaves uneven. A rank's share travels as a few flat host tensors (PackedShare), not as Python lists: at
the paper's scale a batch holds ~40M tokens.
"""

from __future__ import annotations

import array
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from megatron_dapo.samples import TrainItem


def balanced_parts(weights: list[int], parts: int) -> list[list[int]]:
    """The indices of `weights` split into `parts` lists of about equal sums, the heaviest first, by the largest
    differencing method (Karmarkar-Karp, multiway): of the partial partitions (one per weight at the start), the
    two whose heaviest and lightest subsets differ most are merged, the heaviest subset of one with the lightest
    of the other, until one is left. With at least `parts` weights, no list is empty."""
    # A partial partition: its non-empty subsets as (sum, count, indices), heaviest first; its other subsets, up
    # to `parts`, are empty and lighter than any non-empty one (even one of sum 0), so a merge pairs one's empty
    # subsets with the other's non-empty ones first, and a partition of m weights has min(m, parts) non-empty
    # subsets. Leaving the empty ones out keeps a merge of small partitions cheap when `parts` is large.
    partitions = [[(w, 1, [i])] for i, w in enumerate(weights)]
    heap = [(_spread(p, parts), i, p) for i, p in enumerate(partitions)]
    heapq.heapify(heap)  # the largest spread first; ties in weight order, so the split is deterministic
    order = len(weights)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        cut = parts - len(b)  # a's subsets from the cut on pair with b's non-empty ones, lightest first
        both = [(x[0] + y[0], x[1] + y[1], _joined(x[2], y[2])) for x, y in zip(a[cut:], reversed(b))]
        merged = sorted(a[:cut] + both + b[:parts - max(len(a), cut)], key=lambda subset: subset[:2], reverse=True)
        heapq.heappush(heap, (_spread(merged, parts), order, merged))
        order += 1
    subsets = [subset[2] for subset in heap[0][2]] if heap else []
    return subsets + [[] for _ in range(parts - len(subsets))]


def _spread(partition: list[tuple], parts: int) -> int:
    """The heap's key: minus the heaviest subset's sum less the lightest's (an empty subset's 0), so that the
    partition that differs most comes first."""
    return (partition[-1][0] if len(partition) == parts else 0) - partition[0][0]


def _joined(a: list[int], b: list[int]) -> list[int]:
    # The shorter into the longer (each list belongs to one subset): O(n log n) over all merges, not O(n^2).
    if len(a) < len(b):
        a, b = b, a
    a.extend(b)
    return a


def deal_by_tokens(items: list[TrainItem], dp_size: int, updates: int,
                   split: Callable[[list[int], int], list[list[int]]] = balanced_parts) -> list[list[list[TrainItem]]]:
    """shares[r][j]: the responses data-parallel rank r trains on in update j (min(updates, len / dp_size)
    updates), each in draw order. `split`: how an update's token counts are split over the ranks
    (bench/bench_balance.py gives it the split before balanced_parts)."""
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} responses do not divide across {dp_size} data-parallel ranks")
    per_rank = len(items) // dp_size
    count = min(updates, per_rank)
    bounds = [dp_size * round(j * per_rank / count) for j in range(count + 1)] if count else [0]
    shares: list[list[list[TrainItem]]] = [[] for _ in range(dp_size)]
    for a, b in zip(bounds, bounds[1:]):
        for r, part in enumerate(split([_tokens(it) for it in items[a:b]], dp_size)):
            shares[r].append([items[a + i] for i in sorted(part)])
    return shares


def tokens_max_over_mean(shares: list[list[list[TrainItem]]]) -> float:
    """The metric balance/tokens_max_over_mean of a deal (deal_by_tokens' shares): the tokens of each update's
    most loaded rank, summed over the step's updates, over the same sum of each update's mean over the ranks.
    Each update waits for its slowest rank (its gradients are reduced over the ranks), so this is about how much
    longer the step's updates take than a perfectly even deal's would, where time follows tokens; 1.0 is even.
    NaN for a step with nothing to train on."""
    loads = [[sum(map(_tokens, update)) for update in updates] for updates in shares]  # [rank][update]
    mean = sum(map(sum, loads)) / len(loads)
    return sum(map(max, zip(*loads))) / mean if mean else math.nan


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
