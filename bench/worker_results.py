"""The result of a bench's worker processes, or a clear failure within a second of one dying."""

from __future__ import annotations

import queue
import time


def result_of(procs, results, what: str, timeout_s: float = 3600.0):
    """What the workers `procs` put in the queue `results`, once every one has exited cleanly. A worker that
    dies (its traceback is printed above) stops the others and fails the bench within a second, naming it."""
    deadline = time.monotonic() + timeout_s
    out = None
    while out is None or any(p.is_alive() for p in procs):
        if out is None:
            try:
                out = results.get(timeout=0.5)
            except queue.Empty:
                pass
        else:
            for p in procs:
                p.join(timeout=0.5)
        dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            rank, code = dead[0] if dead else (None, None)
            raise RuntimeError(f"{what}: " + (f"worker {rank} exited with {code} (its traceback is above)" if dead
                                              else f"no result after {timeout_s:.0f} s"))
    return out
