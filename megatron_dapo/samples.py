"""The records every layer passes along, and how a training batch of them is dealt out.

A `PromptItem` is what the rollout samples a group for, a `Sample` one response an engine returned,
a `TrainItem` one response of the kept batch as the trainer needs it: plain Python data, so they
cross process boundaries cheaply and say nothing about devices. Dealing is by response: each
data-parallel rank takes every dp_size-th one, then cuts its share into the step's mini-batches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptItem:
    """One prompt to sample a group for."""

    index: int  # the row's index in the dataset
    token_ids: list[int]  # the chat-templated prompt
    ground_truth: str


@dataclass(frozen=True)
class Sample:
    """One sampled response."""

    prompt_index: int  # position of its prompt in the list given to generate / stream
    output_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each output token
    finish_reason: str  # "stop" or "length"
    weight_version: str


@dataclass(frozen=True)
class TrainItem:
    """One response of the kept batch."""

    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logp: list[float]  # the inference engine's log-prob of each output token
    advantage: float
    in_loss: bool  # False: left out of the loss (overlong filtering)


def data_parallel_share(items: list[TrainItem], dp_rank: int, dp_size: int) -> list[TrainItem]:
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} responses do not divide across {dp_size} data-parallel ranks")
    return items[dp_rank::dp_size]


def split_even(samples: list, count: int) -> list[list]:
    """`samples` cut into min(count, len) contiguous parts whose sizes differ by at most one."""
    count = min(count, len(samples))
    bounds = [round(i * len(samples) / count) for i in range(count + 1)]
    return [samples[bounds[i]:bounds[i + 1]] for i in range(count)]
