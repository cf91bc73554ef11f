"""Every trainer rank beats; a rank that stops is named, and the job ends.

A rank can stop without dying (SIGSTOP, a hung driver call, a node that stalls): the others then wait in their
next collective until its timeout (parallel.distributed_timeout_minutes, 30 by default), and the error names
nobody. So each rank runs a thread that writes its beat into the job's key-value store (the rendezvous's, over
a connection of its own, each call bounded from outside: the store's own timeout does not bound a read from a
host that stopped) every few seconds: a counter, its node, its pid and what its main
thread is doing. Each rank reads the others' beats; one whose beat has not moved for
parallel.heartbeat_timeout_s is stuck, and the rank that sees it logs it (rank, node, pid, what it was doing)
and exits with STUCK_EXIT_CODE, which makes the launcher (torchrun, srun) stop every other rank; the driver's
rollout service then stops its servers. A store that does not answer for that long is stuck itself (it lives in
rank 0, or in torchrun's agent), and is named the same way. A rank that ends says so, so that the others do not
take it for stuck; a rank that fails (a bad input found while setting up, an error in a step) says why, and each
other rank ends naming it and its error, rather than wait in a collective for a rank that is gone. Not at once: the
failed rank first stops what it started and says its own error, and the launcher (torchrun, srun) stops every rank
when any exits, so an early exit of another rank had the failed one killed before it said it (seen under load).
Each other rank ends two beats after the failed rank said it was ending, or parallel.heartbeat_timeout_s after it
said it failed, if its ending hangs; the launcher usually stops it before either.

A rank blocked in I/O (a checkpoint write on a filesystem that stalls) still beats. So what the main thread
does may carry a deadline of its own (`set_doing(..., within_s=, key=)`), which the rank's heartbeat thread
holds it to, in a job of one rank too: past it, the rank ends the job naming what it was doing and the key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_dapo.parallel.runtime import LaunchEnv

log = logging.getLogger(__name__)

STUCK_EXIT_CODE = 75
PEER_FAILED_EXIT_CODE = 1
PREFIX = "megatron_dapo/heartbeat/"
EXITED = "exited"
FAILED = "failed: "  # then the error: the rank is stopping what it started
FAILED_EXITED = "exited, failed: "  # then the error: it has, and is ending


class StoreStuck(RuntimeError):
    """A call to the job's key-value store failed, or did not return in time."""


class RankHeartbeat:
    """`store_address` None (a job of one rank): no beats, only the main thread's deadlines."""

    @classmethod
    def of_rank(cls, env: LaunchEnv, timeout_s: float) -> RankHeartbeat:
        """This rank's, from its launch (a one-process run has no store to beat into)."""
        return cls(env.rank, env.world_size, env.node, env.master_addr if env.world_size > 1 else None,
                   env.master_port, timeout_s)

    def __init__(self, rank: int, world_size: int, node: str, store_address: str | None, store_port: int,
                 timeout_s: float):
        self.rank, self.world_size, self.node, self.timeout_s = rank, world_size, node, timeout_s
        self.where = f"{store_address}:{store_port}"
        self.interval_s = min(max(timeout_s / 5, 0.2), 10.0)
        self.doing = "starting"  # what the main thread does (set_doing); sent with each beat
        self._deadline: tuple[float, float, str] | None = None  # (monotonic time, seconds, key) of `doing`
        self._store = None if store_address is None else dist.TCPStore(
            store_address, store_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self._stop = threading.Event()
        self._failing = False  # this rank unwinds an error of its own: it no longer ends itself on the others'
        self._beats = 0
        if self._store is not None:
            self._beat()
        self._thread = threading.Thread(target=self._run, name="rank-heartbeat", daemon=True)
        self._thread.start()

    def set_doing(self, what: str, within_s: float | None = None, key: str | None = None) -> None:
        """Main thread: what it does from now on; `within_s`: it must be done within that (the config `key`)."""
        self._deadline = None if within_s is None else (time.monotonic() + within_s, within_s, key)
        self.doing = what

    def _key(self, rank: int) -> str:
        return f"{PREFIX}{rank}"

    def _call(self, fn, *args):
        """A store call, or StoreStuck when it failed or has not returned within the timeout. It runs on a daemon
        thread of its own: one that never returns must not hold up the process's exit."""
        outcome = []

        def call():
            try:
                outcome.append((True, fn(*args)))
            except dist.DistError as e:
                outcome.append((False, e))

        thread = threading.Thread(target=call, name="rank-heartbeat-store", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not outcome:
            raise StoreStuck(f"no answer in {self.timeout_s:g} s")
        ok, value = outcome[0]
        if not ok:
            raise StoreStuck(str(value))
        return value

    def _beat(self, state: str | None = None) -> None:
        self._beats += 1
        self._call(self._store.set, self._key(self.rank),
                   f"{self._beats}|{self.node}|{os.getpid()}|{state or self.doing}")

    def _run(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self._key(r) for r in others]
        last: dict[int, str] = {}
        moved = {r: time.monotonic() for r in others}  # when each beat last changed
        failed: dict[int, float] = {}  # when each rank was first seen failing
        ended: dict[int, float] = {}  # when each failed rank was first seen ending
        try:
            while not self._stop.wait(self.interval_s):
                self._check_deadline()
                if self._store is None:
                    continue
                self._beat()
                if self._failing or not self._call(self._store.check, keys):  # not every rank beats yet (starting)
                    continue
                now = time.monotonic()
                for rank, value in zip(others, self._call(self._store.multi_get, keys)):
                    value = value.decode()
                    _, node, pid, doing = value.split("|", 3)
                    if doing.startswith((FAILED, FAILED_EXITED)):
                        since = failed.setdefault(rank, now)
                        if doing.startswith(FAILED_EXITED):
                            ended.setdefault(rank, now)
                        if now - ended.get(rank, now) >= 2 * self.interval_s or now - since > self.timeout_s:
                            error = doing.removeprefix(FAILED_EXITED).removeprefix(FAILED)
                            self._end(f"rank {rank} (node {node}, pid {pid}) {FAILED}{error}", PEER_FAILED_EXIT_CODE,
                                      "Ending this rank too ({code})")
                        continue
                    if value != last.get(rank):
                        last[rank], moved[rank] = value, now
                    elif doing != EXITED and now - moved[rank] > self.timeout_s:
                        self._end(f"rank {rank} (node {node}, pid {pid}) has not beaten for {now - moved[rank]:.0f} s "
                                  f"(parallel.heartbeat_timeout_s = {self.timeout_s:g}); it is stuck while doing: "
                                  f"{doing}")
        except StoreStuck as e:
            if not self._stop.is_set():
                self._end(f"the job's key-value store at {self.where} (in rank 0, or in torchrun's agent) stopped "
                          f"answering (within parallel.heartbeat_timeout_s = {self.timeout_s:g} s): its host is stuck "
                          f"or gone: {e}")

    def _check_deadline(self) -> None:
        deadline, doing = self._deadline, self.doing
        if deadline is not None and time.monotonic() > deadline[0]:
            self._end(f"its main thread is still {doing} after {deadline[1]:g} s ({deadline[2]})")

    def _end(self, reason: str, code: int = STUCK_EXIT_CODE,
              what_now: str = "Ending the job ({code}); it resumes from its latest checkpoint") -> None:
        """End this rank, and so the job, from the heartbeat thread: the main thread may be blocked in a
        collective with the stuck (or failed) rank, where nothing can reach it."""
        log.error("rank %d: %s. %s", self.rank, reason, what_now.format(code=f"exit code {code}"))
        logging.shutdown()  # flushed: os._exit skips it
        os._exit(code)

    def failing(self, error: BaseException) -> None:
        """Main thread: this rank fails with `error` and now stops what it started. The other ranks are told at its
        next beats (and end, naming it); it no longer ends itself on another rank's failure or silence, nor on a
        deadline, so that it stops its own helpers and says its own error. A signal's SystemExit is not told: the
        launcher stops every rank for those."""
        self._failing, self._deadline = True, None
        if isinstance(error, Exception):
            self.doing = f"{FAILED}{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def close(self, error: BaseException | None = None) -> None:
        """This rank is ending: say so, so that the others do not take it for stuck; with the `error` that ends it,
        which the others then end on, naming it."""
        if error is not None:
            self.failing(error)
        self._stop.set()
        self._thread.join()
        if self._store is None:
            return
        try:
            failing = self.doing.startswith(FAILED)
            self._beat(FAILED_EXITED + self.doing.removeprefix(FAILED) if failing else EXITED)
        except StoreStuck:
            pass  # the store is gone already: the job is ending

    def __enter__(self) -> RankHeartbeat:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)
