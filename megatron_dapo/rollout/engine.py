"""The inference-engine interface the trainer samples through.

An engine samples groups: n responses for each prompt. `stream` hands groups back as they complete
(in any order), which dynamic sampling consumes; `GroupStream.abort(indices)` cancels some groups (those
dynamic sampling knows it will not need) and `abort()` all that are still outstanding. `generate` is the
blocking form, in prompt order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from megatron_dapo.samples import Sample


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    stop_token_ids: list[int] = field(default_factory=list)
    # Text that ends a response (a tool call's closing tag): the response ends with the token that completes the
    # first one to appear in its decoded text, that token included (as SGLang returns it). Not counted as EOS:
    # ignore_eos leaves it on.
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Reproducible sampling: sample j of the i-th prompt of a call draws with sample_seed(seed, i, j), so
    # a retried or resumed request gets the same response. None: unseeded.
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not all(isinstance(text, str) and text for text in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")


def sample_seed(seed: int, *path: int) -> int:
    """A 64-bit seed (SGLang's signed range) derived from a base seed and a path such as (prompt, sample)."""
    digest = hashlib.blake2b("/".join(map(str, (seed, *path))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class GroupStream(Protocol):
    """Groups (the n samples of one prompt, all with the same prompt_index) as they complete."""

    def __iter__(self) -> Iterator[list[Sample]]:
        ...

    def abort(self, indices: Iterable[int] | None = None) -> None:
        """Cancel the groups of these prompt indices (positions in the list given to `stream`), or with no
        argument every group; a cancelled group is never handed out (nor sent again after a failure), even
        if it had completed already. Iteration ends once every group is handed out or cancelled. Safe to
        call more than once, and for groups already handed out (then a no-op for them)."""
        ...


class Engine(Protocol):
    def stream(self, prompts: list[list[int]], n: int, params: SamplingParams) -> GroupStream:
        """Start sampling n responses for each prompt (token ids); groups come back as they complete."""
        ...

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        """n samples for each prompt, grouped by prompt, in prompt order (blocking)."""
        ...

    def healthy(self) -> bool:
        ...
