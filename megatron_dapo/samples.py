"""The records every layer passes along.

A `PromptItem` is what the rollout samples a group for, a `Sample` one response an engine returned,
a `TrainItem` one response of the kept batch as the trainer needs it: plain Python data that says
nothing about devices. How the batch is dealt to data-parallel ranks: parallel/rank_shares.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    weight_version: str  # of the weights that sampled its first token (the oldest, when they changed meanwhile)
    # (version, first token, end) of each run of output tokens sampled by one version of the weights, when
    # the engine reports them: weights pushed into a running server (partial rollouts) start a new run.
    version_spans: tuple[tuple[str, int, int], ...] = ()
    # A mixture of experts' routes when the engine returns them (rollout.routing_replay): [positions, MoE layers,
    # top_k] expert ids of every position the engine ran through the model, prompt then output (the last output
    # token is never run: len(prompt) + len(output) - 1 rows), as route_dtype(num_experts) makes them.
    routes: np.ndarray | None = None
    # The sum over its output tokens of the entropy (nats) of the distribution each was sampled from (at the
    # sampling temperature, before top_p), when the engine reports it (the in-process engine; SGLang does not).
    entropy_sum: float | None = None


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type for expert ids: uint8 up to 256 experts (Qwen3-MoE's 128), int16 beyond. At the
    paper's scale (512 x 16 responses of 20k tokens, 48 layers, top 8) a batch's routes are 63 GB in uint8."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


def version_number(version: str) -> int:
    """A weight version as the number of rollout steps the weights had trained (the run tags each push with
    it). Servers name the weights they start with in their own way: those are the run's initial weights, 0."""
    return int(version) if version.isdigit() else 0


@dataclass(frozen=True)
class TrainItem:
    """One response of the kept batch."""

    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logp: list[float]  # the inference engine's log-prob of each output token
    advantage: float
    in_loss: bool  # False: left out of the loss (overlong filtering)
    routes: np.ndarray | None = None  # Sample.routes
