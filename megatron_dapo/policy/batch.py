"""Pack (prompt + response) sequences into micro-batches by a token budget.

A micro-batch is a right-padded [rows, length] block: with a causal mask, padding after a sequence
never reaches its tokens, and rotary positions start at 0 in every row. Sequences are sorted by
length so that rows of similar length share a block and little is padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [prompt + response] token ids
    prompt_len: int

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


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so that each block's rows x max length stays within max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than max_tokens_per_micro_batch "
                             f"{max_tokens}; raise the budget")
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def make_micro_batch(sequences: list[Sequence], index: list[int]) -> MicroBatch:
    rows = [sequences[i] for i in index]
    length = max(s.tokens.numel() for s in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    targets = torch.zeros(len(rows), length, dtype=torch.long)
    positions = []
    for r, s in enumerate(rows):
        n = s.tokens.numel()
        input_ids[r, :n] = s.tokens
        targets[r, : n - 1] = s.tokens[1:]
        # The logits at position p predict token p + 1: response tokens [prompt_len, n) come from [prompt_len - 1, n - 1).
        positions.append(torch.arange(s.prompt_len - 1, n - 1) + r * length)
    return MicroBatch(input_ids, targets.reshape(-1), torch.cat(positions), list(index),
                      [s.response_len for s in rows])


def micro_batches(sequences: list[Sequence], max_tokens: int) -> list[MicroBatch]:
    plan = plan_micro_batches([s.tokens.numel() for s in sequences], max_tokens)
    return [make_micro_batch(sequences, idx) for idx in plan]
