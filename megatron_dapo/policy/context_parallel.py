"""Context parallelism's layout: each sequence of a micro-batch cut over the ranks of a context-parallel group.

A sequence (a padded block's row, or a sequence of a pack) is cut into 2 x CP chunks of equal length, and CP rank r
keeps chunks r and 2CP-1-r, in that order: megatron-core's load-balanced layout (`get_batch_on_this_cp_rank`), so
each rank gets as much causal attention work as the others, and the one its rotary embedding (sbhd: it slices the
positions itself; thd: from the pack's global cu_seqlens) and Transformer Engine's attention expect. The token ids,
targets and routes are cut the same way; the response positions become this rank's share of them, and
`response_order` says which of the micro-batch's response tokens each one is, so that per-token inputs (advantages,
old log-probs, masks) are picked with it and the log-probs gathered back in order.

Attention then needs every earlier token of the sequence: `AttentionPlan` says where in the gathered keys and values
(the CP ranks' local ones end to end) each global position is, and which keys each of this rank's query chunks
attends (causally, its own chunk being the last of them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_dapo.policy.batch import MicroBatch


def kept_positions(segments: list[tuple[int, int]], cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions CP rank `cp_rank` keeps of sequences [start, end) laid end to end, in its local order:
    of each, chunks cp_rank and 2 cp_size - 1 - cp_rank of 2 cp_size."""
    parts = []
    for a, b in segments:
        c = (b - a) // (2 * cp_size)
        if c * 2 * cp_size != b - a:
            raise ValueError(f"context parallelism: a sequence of {b - a} tokens does not cut into 2 x "
                             f"{cp_size} chunks; pad it to a multiple of {2 * cp_size}")
        parts += [torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c),
                  torch.arange(b - (cp_rank + 1) * c, b - cp_rank * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _segments(mb: MicroBatch) -> list[tuple[int, int]]:
    """The sequences of `mb` as [start, end) in its flat [rows x length] positions."""
    if mb.cu_seqlens is not None:
        return list(zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]))
    rows, length = mb.input_ids.shape
    return [(r * length, (r + 1) * length) for r in range(rows)]


def split_micro_batch(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's share of `mb` (each of its sequences a multiple of 2 x cp_size long). A packed micro-batch
    keeps its global cu_seqlens: megatron-core's rotary embedding and the attention derive the local ones."""
    if cp_size == 1:
        return mb
    segments = _segments(mb)
    keep = kept_positions(segments, cp_size, cp_rank)
    rows = mb.input_ids.shape[0]
    local = torch.full((mb.input_ids.numel(),), -1, dtype=torch.long)
    local[keep] = torch.arange(keep.numel())
    at = local[mb.response_positions]
    mine = at >= 0
    routes = fill = None
    if mb.routes is not None:
        routes = mb.routes.reshape(-1, *mb.routes.shape[2:])[keep].reshape(rows, -1, *mb.routes.shape[2:])
        fill = mb.route_fill.reshape(-1)[keep].reshape(rows, -1)
    # each kept position less its sequence's start; a sequence keeps 1 / cp_size of its tokens
    starts = torch.tensor([a for a, _ in segments])
    position_ids = keep - starts.repeat_interleave(torch.tensor([b - a for a, b in segments]) // cp_size)
    return replace(mb, input_ids=mb.input_ids.reshape(-1)[keep].reshape(rows, -1), targets=mb.targets[keep],
                   response_positions=at[mine], response_order=torch.arange(at.numel())[mine], routes=routes,
                   route_fill=fill, position_ids=position_ids.reshape(rows, -1),
                   real=mb.real.reshape(-1)[keep].reshape(rows, -1))


@dataclass(frozen=True)
class AttentionPlan:
    """For a CP rank's local queries: `global_rows`, for each global position (the sequences end to end, or one
    row's), its row in the CP ranks' local keys gathered end to end; `chunks`, per local query chunk (query start,
    length, first key's global position, number of keys), causal with its queries aligned to its last keys."""

    global_rows: torch.Tensor
    chunks: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def of(cls, segments: list[tuple[int, int]], cp_size: int, cp_rank: int, device) -> AttentionPlan:
        gathered = torch.cat([kept_positions(segments, cp_size, r) for r in range(cp_size)])
        chunks, q = [], 0
        for a, b in segments:
            c = (b - a) // (2 * cp_size)
            for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
                chunks.append((q, c, a, (index + 1) * c))
                q += c
        return cls(gathered.argsort().to(device), tuple(chunks))


def gather_responses(mbs: list[MicroBatch], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per micro-batch, [..., its response tokens] in order from each CP rank's [..., its share] (`response_order`):
    every CP rank gets all of them. Collective over the context-parallel group when there is one; exact (each value
    is summed with zeros)."""
    if all(mb.response_order is None for mb in mbs):
        return values
    import torch.distributed as dist
    from megatron.core import parallel_state

    full = []
    for mb, v in zip(mbs, values):
        out = v.new_zeros(*v.shape[:-1], sum(mb.response_lens))
        out[..., mb.response_order.to(v.device)] = v
        full.append(out)
    flat = torch.cat([f.reshape(-1) for f in full])
    dist.all_reduce(flat, group=parallel_state.get_context_parallel_group())
    return [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in full]), full)]
