"""The inference-engine interface the trainer samples through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Sample:
    """One sampled response."""

    prompt_index: int
    output_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each output token
    finish_reason: str  # "stop" or "length"
    weight_version: str


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        """n samples for each prompt (token ids), grouped by prompt, in prompt order."""
        ...

    def healthy(self) -> bool:
        ...
