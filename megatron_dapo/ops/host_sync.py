"""Regions that must not read device memory on the host: a device-to-host read (`.item()`, `.tolist()`, `bool()`,
`float()`, `int()`) waits for the GPU's queue to drain, so the fused loss, which a step calls once per micro-batch,
marks its own. On a GPU nothing is checked here (`torch.cuda.set_sync_debug_mode("error")` does it, in the GPU
tests); the device-faithful CPU mode (parallel/device_faithful.py) refuses such reads inside a region."""

from __future__ import annotations

import threading

_regions = threading.local()  # the name of the innermost region of this thread, or none


class no_host_sync:  # noqa: N801 - used as a context manager, like torch.no_grad
    """`with no_host_sync("dapo_loss"): ...`: the code inside reads no device tensor on the host."""

    __slots__ = ("where", "outer")

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        self.outer = getattr(_regions, "where", None)
        _regions.where = self.where

    def __exit__(self, *exc) -> None:
        _regions.where = self.outer


def current_region() -> str | None:
    """The region this thread is in, or None."""
    return getattr(_regions, "where", None)
