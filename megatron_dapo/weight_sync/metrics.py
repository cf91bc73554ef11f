"""What one weight sync cost."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncMetrics:
    bytes: int  # of the model's weights, counted once however many servers received them
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9
