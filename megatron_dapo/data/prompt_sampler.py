"""The order prompts are drawn in: deterministic, reshuffled every epoch, resumable exactly, split across DP ranks.

Epoch e is a permutation of the rows drawn from (seed, e) alone, so the order never depends on how
many prompts were asked for at a time, and the state to resume is two integers (epoch, position).
With dp_size > 1 each rank walks its own share of every epoch's permutation: rank r takes every
dp_size-th entry starting at r, all shares cut to the same length (floor(num_rows / dp_size)), so
the shares are disjoint and the ranks finish each epoch together. The up to dp_size - 1 rows left
over differ from epoch to epoch. The trainer that draws whole prompt batches on one process (and asks
for more during dynamic sampling) uses dp_size=1: then one share is the whole permutation.
"""

from __future__ import annotations

import numpy as np

from megatron_dapo.data.prompt_file import DataError


def _whole(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"PromptSampler {name}: must be a whole number >= {minimum}, got {value!r}")
    return int(value)


class PromptSampler:
    def __init__(self, num_rows: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.num_rows = _whole(num_rows, "num_rows", 1)
        self.seed = _whole(seed, "seed", 0)
        self.dp_size = _whole(dp_size, "dp_size", 1)
        self.dp_rank = _whole(dp_rank, "dp_rank", 0)
        if self.dp_rank >= self.dp_size:
            raise DataError(f"PromptSampler dp_rank: must be < dp_size = {self.dp_size}, got {self.dp_rank}")
        if self.num_rows < self.dp_size:
            raise DataError(f"PromptSampler: {self.num_rows} rows cannot be shared by {self.dp_size} data-parallel "
                            "ranks; use more prompts or fewer ranks")
        self.share_len = self.num_rows // self.dp_size
        self.epoch = 0
        self.position = 0  # entries of this epoch's share already drawn
        self._share_epoch, self._share = -1, np.empty(0, dtype=np.int64)

    def _epoch_share(self) -> np.ndarray:
        if self._share_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
            self._share = order[self.dp_rank::self.dp_size][:self.share_len]
            self._share_epoch = self.epoch
        return self._share

    def next_indices(self, k: int) -> list[int]:
        """The next k row indices of this rank's order, continuing into the next epoch when one ends."""
        k = _whole(k, "k", 0)
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.share_len - self.position)
            out.extend(self._epoch_share()[self.position:self.position + take].tolist())
            self.position += take
            if self.position == self.share_len:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    @property
    def consumed(self) -> int:
        """Row indices drawn so far on this rank."""
        return self.epoch * self.share_len + self.position

    def state_dict(self) -> dict:
        return {"num_rows": self.num_rows, "seed": self.seed, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved sampler stopped; the data, seed and DP layout must be the same."""
        for key in ("num_rows", "seed", "dp_rank", "dp_size"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"PromptSampler state: saved with {key}={state.get(key)!r} but this sampler has "
                                f"{key}={getattr(self, key)!r}; resume with the same prompt file, seed and "
                                "data-parallel layout")
        epoch, position = _whole(state.get("epoch"), "epoch", 0), _whole(state.get("position"), "position", 0)
        if position >= self.share_len:
            raise DataError(f"PromptSampler state: position {position} is past the epoch's {self.share_len} rows")
        self.epoch, self.position = epoch, position
