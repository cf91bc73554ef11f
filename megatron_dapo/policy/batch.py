"""Put (prompt + response) sequences into micro-batches by a token budget, packed or padded.

Packed (model.packing): a micro-batch is one row, the sequences end to end with no padding between them, and
`cu_seqlens` marks where each starts (megatron-core's `thd` format): attention is causal within each sequence
only, rotary positions restart at 0 for each, and the budget counts real tokens. Sequences go to micro-batches
first-fit by decreasing length.

Padded: a micro-batch is a right-padded [rows, length] block: with a causal mask, padding after a sequence never
reaches its tokens, and rotary positions start at 0 in every row. Sequences are sorted by length so that rows of
similar length share a block; the budget counts rows x length.

With sequence parallelism a micro-batch's length is padded up to a multiple of the tensor-parallel size, which
splits it (packed: one tail of padding, a sequence of its own). With context parallelism every sequence is cut over
the CP ranks (policy/context_parallel.py): a padded block's length, and each sequence of a pack, is padded to a
multiple of 2 x CP (the padding after a sequence is part of it: no response position, reached by no earlier token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [prompt + response] token ids
    prompt_len: int
    # A mixture of experts' routes from the rollout (routing replay): [tokens, MoE layers, top_k] expert ids, the
    # experts each position went to (policy/routing_replay.py); the last token's row may be left out (an engine
    # never runs it; what its position computes reaches no loss)
    routes: torch.Tensor | None = None

    @property
    def response_len(self) -> int:
        return self.tokens.numel() - self.prompt_len


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [rows, length], right-padded with 0
    targets: torch.Tensor  # [rows * length]: the next token at each position (0 where none)
    response_positions: torch.Tensor  # flat positions in [rows * length] whose logits predict response tokens
    sample_index: list[int]  # which input sequence each row is
    response_lens: list[int]
    # [rows, length, MoE layers, top_k] when every row has routes; else None, and the sequences without them are
    # named here (route_fill: below)
    routes: torch.Tensor | None = None
    routes_missing: list[int] | None = None
    # Packed (one row): the offsets where each sequence starts and the row's end, [sequences + 1] (a padding tail,
    # if any, counts as a sequence); None for a padded block
    cu_seqlens: list[int] | None = None
    # A context-parallel rank's share (policy/context_parallel.py): which of the micro-batch's response tokens each
    # of response_positions is, and each position's place in its sequence; None: all of them in order, and
    # positions counted from each row's or sequence's start.
    response_order: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    # With routes: [rows, length] True where no sequence's routes are (padding, a sequence's last token), which the
    # replayer spreads over the experts
    route_fill: torch.Tensor | None = None
    # [rows, length] True where a sequence's token is (False: padding, a filler), what the load-balancing loss counts
    real: torch.Tensor | None = None

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_positions.numel())


def check_sequences(sequences: list[Sequence], max_positions: int) -> None:
    for i, s in enumerate(sequences):
        if s.tokens.dim() != 1 or s.tokens.dtype != torch.long:
            raise ValueError(f"sequence {i}: tokens must be a 1-D int64 tensor, got {s.tokens.dtype} {tuple(s.tokens.shape)}")
        if not 1 <= s.prompt_len < s.tokens.numel():
            raise ValueError(f"sequence {i}: prompt_len {s.prompt_len} must be in [1, {s.tokens.numel()}) "
                             "(at least one prompt and one response token)")
        if s.tokens.numel() > max_positions:
            raise ValueError(f"sequence {i}: {s.tokens.numel()} tokens exceed the model's max_position_embeddings "
                             f"{max_positions}; truncate the response (rollout max_new_tokens) or the prompt")
        n = s.tokens.numel()
        if s.routes is not None and (s.routes.dim() != 3 or s.routes.shape[0] not in (n - 1, n)
                                     or s.routes.is_floating_point()):
            raise ValueError(f"sequence {i}: routes must be integer expert ids [tokens = {n} (or {n - 1}: the last "
                             f"token's, which no position needs, left out), MoE layers, top_k], got {s.routes.dtype} "
                             f"{tuple(s.routes.shape)}")


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def plan_micro_batches(lengths: list[int], max_tokens: int, length_multiple: int = 1,
                       count: int | None = None, packed: bool = False, sequence_multiple: int = 1) -> list[list[int]]:
    """Group sequence indices so that each micro-batch's tokens (packed: the sum of the lengths, each padded to
    `sequence_multiple`; padded: rows x max length), padded to `length_multiple`, stay within max_tokens. With
    `count`, at least that many (see at_least)."""
    if packed:
        lengths = [padded_length(n, sequence_multiple) for n in lengths]
    groups = (_plan_packed if packed else _plan)(lengths, max_tokens, length_multiple)
    return groups if count is None else at_least(groups, count)


def at_least(groups: list[list[int]], count: int) -> list[list[int]]:
    """`count` blocks or more: the blocks of most rows halved while any has two rows, then empty blocks (filler
    micro-batches: a padding row that carries no sample). Expert parallelism needs it: each micro-batch's forward
    and backward exchange tokens between the ranks of an expert-parallel group (all-to-all), so every data-parallel
    rank must run as many micro-batches as the others."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        widest = max(range(len(groups)), key=lambda i: len(groups[i]), default=None)
        if widest is None or len(groups[widest]) < 2:
            groups += [[] for _ in range(count - len(groups))]
            break
        g = groups[widest]
        groups[widest:widest + 1] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def _plan(lengths: list[int], max_tokens: int, length_multiple: int) -> list[list[int]]:
    lengths = [padded_length(n, length_multiple) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise _too_long(i, lengths[i], max_tokens)
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _too_long(i: int, length: int, max_tokens: int) -> ValueError:
    return ValueError(f"sequence {i} has {length} tokens, more than max_tokens_per_micro_batch {max_tokens}; raise "
                      "the budget")


def _plan_packed(lengths: list[int], max_tokens: int, length_multiple: int) -> list[list[int]]:
    """First fit by decreasing length; each pack's indices in increasing order."""
    packs: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if padded_length(lengths[i], length_multiple) > max_tokens:
            raise _too_long(i, lengths[i], max_tokens)
        fit = next((p for p, u in enumerate(used) if padded_length(u + lengths[i], length_multiple) <= max_tokens),
                   None)
        if fit is None:
            packs.append([i])
            used.append(lengths[i])
        else:
            packs[fit].append(i)
            used[fit] += lengths[i]
    return [sorted(p) for p in packs]


def make_packed_micro_batch(sequences: list[Sequence], index: list[int], length_multiple: int = 1,
                            sequence_multiple: int = 1) -> MicroBatch:
    """Sequences `index` end to end in one row, each padded to `sequence_multiple` (a padding tail up to
    `length_multiple`, itself a multiple of `sequence_multiple`); for no sequences, a filler: one sequence of
    padding, no response position."""
    rows = [sequences[i] for i in index]
    starts = [0]
    for s in rows:
        starts.append(starts[-1] + padded_length(s.tokens.numel(), sequence_multiple))
    total = padded_length(max(starts[-1], 1), length_multiple)
    cu = starts + [total] if total > starts[-1] else starts
    input_ids = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    real = torch.zeros(total, dtype=torch.bool)
    positions = []
    for s, a in zip(rows, starts):
        n = s.tokens.numel()
        input_ids[a:a + n] = s.tokens
        real[a:a + n] = True
        targets[a:a + n - 1] = s.tokens[1:]  # each sequence's last position predicts nothing of it
        positions.append(torch.arange(a + s.prompt_len - 1, a + n - 1))
    missing = [i for i, s in zip(index, rows) if s.routes is None]
    # One row of routes: the positions a sequence's routes leave out (its last token's, its padding) are filled
    # (what those positions compute reaches no loss, and no later sequence: attention stays within each)
    routes = fill = None
    if rows and not missing:
        routes, fill = _routes([s.routes for s in rows], total, starts)
    return MicroBatch(input_ids.unsqueeze(0), targets,
                      torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long), list(index),
                      [s.response_len for s in rows], routes, missing, cu, route_fill=fill, real=real.unsqueeze(0))


def make_micro_batch(sequences: list[Sequence], index: list[int], length_multiple: int = 1) -> MicroBatch:
    """The block of sequences `index`; for no sequences, a filler: one row of padding, no response position."""
    if not index:
        return MicroBatch(torch.zeros(1, length_multiple, dtype=torch.long),
                          torch.zeros(length_multiple, dtype=torch.long), torch.zeros(0, dtype=torch.long), [], [],
                          real=torch.zeros(1, length_multiple, dtype=torch.bool))
    rows = [sequences[i] for i in index]
    length = padded_length(max(s.tokens.numel() for s in rows), length_multiple)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    targets = torch.zeros(len(rows), length, dtype=torch.long)
    real = torch.zeros(len(rows), length, dtype=torch.bool)
    positions = []
    for r, s in enumerate(rows):
        n = s.tokens.numel()
        input_ids[r, :n] = s.tokens
        real[r, :n] = True
        targets[r, : n - 1] = s.tokens[1:]
        # The logits at position p predict token p + 1: response tokens [prompt_len, n) come from [prompt_len - 1, n - 1).
        positions.append(torch.arange(s.prompt_len - 1, n - 1) + r * length)
    missing = [i for i, s in zip(index, rows) if s.routes is None]
    routes = fill = None
    if not missing:
        routes, fill = (t.reshape(len(rows), length, *t.shape[2:]) for t in
                        _routes([s.routes for s in rows], len(rows) * length, [r * length for r in range(len(rows))]))
    return MicroBatch(input_ids, targets.reshape(-1), torch.cat(positions), list(index),
                      [s.response_len for s in rows], routes, missing, route_fill=fill, real=real)


def _routes(per_sequence: list[torch.Tensor], total: int, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's routes [1, total, MoE layers, k] from each sequence's [tokens, MoE layers, k] placed at its start,
    in their dtype (uint8 or int16), and [1, total] True where no sequence's routes are (padding: what it computes
    reaches no loss, and no other position: causal attention)."""
    first = per_sequence[0]
    out = torch.zeros(total, *first.shape[1:], dtype=first.dtype)
    fill = torch.ones(total, dtype=torch.bool)
    for r, a in zip(per_sequence, starts):
        out[a:a + r.shape[0]] = r
        fill[a:a + r.shape[0]] = False
    return out.unsqueeze(0), fill.unsqueeze(0)


def micro_batches(sequences: list[Sequence], max_tokens: int, length_multiple: int = 1,
                  count: int | None = None, packed: bool = False, sequence_multiple: int = 1) -> list[MicroBatch]:
    """`length_multiple`, `sequence_multiple`: what each micro-batch's length and each packed sequence's must divide
    by (layout_multiples of the model); `count`: the fewest micro-batches (at_least); `packed`: one row each
    (make_packed_micro_batch), else padded blocks."""
    plan = plan_micro_batches([s.tokens.numel() for s in sequences], max_tokens, length_multiple, count, packed,
                              sequence_multiple)
    if packed:
        return [make_packed_micro_batch(sequences, idx, length_multiple, sequence_multiple) for idx in plan]
    return [make_micro_batch(sequences, idx, length_multiple) for idx in plan]


def layout_multiples(config) -> tuple[int, int]:
    """(what a micro-batch's length, what each sequence of a pack must divide by) for a model of megatron-core
    TransformerConfig `config`: context parallelism cuts each sequence into 2 x CP chunks, and sequence parallelism
    splits each CP rank's share over the tensor-parallel ranks."""
    cp = config.context_parallel_size
    per_sequence = 2 * cp if cp > 1 else 1
    return per_sequence * (config.tensor_model_parallel_size if config.sequence_parallel else 1), per_sequence
