"""The rollout service in a process of its own, beside the trainer's driver: the SGLang engine (and the servers
it starts), the tokenizer, the reward pool and dynamic sampling live there, so that none of their host work
(HTTP, JSON, detokenising, reward dispatch) competes with the training rank for its interpreter.

`RolloutServiceProcess` is what the driver holds: the service's interface (rollout_service.py), each call a
message over a pipe. The process queues the jobs it is sent and answers the other commands while they run; it
forwards a restarted server's need for the weights (RESYNC), and each job's result as it is done, in the order
queued. Batches travel packed (ReadyBatch.state_dict). Its log is `<train.output_dir>/rollout.log`. If the
process dies, the driver's next call raises, naming it; if the driver dies, the process stops its servers and
exits. Nothing waits forever: the process beats over the pipe, and a driver that hears nothing from it for
parallel.heartbeat_timeout_s fails, naming it as stuck; a job that runs past rollout.job_timeout_s fails the
run, naming the job.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import threading
import time
import traceback
import weakref
from pathlib import Path

from megatron_dapo.errors import DapoError
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.service.rollout_service import READY, RESYNC, ReadyBatch

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0  # for the process to stop its servers and exit once asked
BEAT = "beat"
STARTUP_SILENCE_S = 120.0  # the most the process may take to start beating


class RolloutServiceError(DapoError, RuntimeError):
    """The rollout service failed, or its process is gone; the message carries its error."""


class RolloutServiceProcess:
    def __init__(self, cfg: DapoConfig, dp_size: int):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.log_path = Path(cfg.train.output_dir) / "rollout.log"
        self.silence_s = cfg.parallel.heartbeat_timeout_s
        self._proc = ctx.Process(target=_serve, args=(cfg, dp_size, child), name="rollout-service")
        self._proc.start()
        child.close()
        # A driver that exits without close() (an error while it sets up) hangs up: the service then stops its
        # servers and exits, before multiprocessing's exit handler waits for it.
        weakref.finalize(self, self._conn.close)
        self._jobs: collections.deque[str] = collections.deque()  # queued, results not taken; oldest first
        self._results: collections.deque[tuple] = collections.deque()  # of the oldest jobs, received
        self.restarted: str | None = None
        self.server_urls: list[str] = []  # once up

    def wait_up(self) -> None:
        """Until the service is up, its servers healthy (the caller sets up meanwhile); raises its start-up
        error."""
        kind, value = self._recv(max(self.silence_s, STARTUP_SILENCE_S))  # its first beat comes after its imports
        if kind != "up":
            self._proc.join(STOP_TIMEOUT_S)
            raise RolloutServiceError(f"the rollout service did not start: {value}")
        self.server_urls = value

    def _recv(self, silence_s: float | None = None) -> tuple:
        """The service's next message, its beats skipped."""
        silence_s = silence_s or self.silence_s
        while True:
            if not self._conn.poll(silence_s):
                raise RolloutServiceError(
                    f"the rollout service process (pid {self._proc.pid}) has sent nothing, not even its heartbeat, "
                    f"for {silence_s:g} s (parallel.heartbeat_timeout_s): it is stuck; its log: {self.log_path}")
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(5)
                raise RolloutServiceError(f"the rollout service process exited (code {self._proc.exitcode}); its "
                                          f"log: {self.log_path}") from None
            if message[0] != BEAT:
                return message

    def _call(self, *message) -> None:
        try:
            self._conn.send(message)
        except OSError:
            self._recv()  # raises, naming the process's end

    def start_batch(self, step: int) -> None:
        self._start("batch", step)

    def start_eval(self) -> None:
        self._start("eval")

    def _start(self, job: str, *args) -> None:
        self._jobs.append(job)
        self._call(job, *args)

    @property
    def pending(self) -> list[str]:
        return list(self._jobs)

    def wait(self) -> str:
        if self._results or not self._jobs:  # the oldest is done, or there is none
            return READY
        message = self._recv()
        if message[0] == RESYNC:
            self.restarted = message[1]
            return RESYNC
        self._results.append(message)
        return READY

    def resynced(self) -> None:
        self.restarted = None
        self._call("resynced")

    def take(self):
        if not self._results:
            raise RuntimeError("no finished job to take: start one and wait() for READY first")
        (_, value, error), job = self._results.popleft(), self._jobs.popleft()
        if error is not None:
            raise RolloutServiceError(f"the rollout service's {job} job failed (its log: {self.log_path}):\n{error}")
        return ReadyBatch.from_state_dict(value) if job == "batch" else value

    def state_dict(self) -> dict:
        self._call("state")
        _, value, error = self._recv()
        if error is not None:
            raise RolloutServiceError(f"the rollout service could not give its state: {error}")
        return value

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state", state)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            log.warning("the rollout service did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.join()
        self._conn.close()


class _Link:
    """The service's end of the pipe, shared by its main thread and its heartbeat thread."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def poll(self, timeout: float | None) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> tuple:
        return self.conn.recv()


def _beat(link: _Link, interval_s: float) -> None:
    """The service's heartbeat thread: a beat every `interval_s` until the driver is gone."""
    while True:
        time.sleep(interval_s)
        try:
            link.send((BEAT,))
        except OSError:
            return


def _serve(cfg: DapoConfig, dp_size: int, conn) -> None:
    """The service process: build the service, then answer the driver's commands until told to close (or
    until the driver is gone)."""
    from megatron_dapo.observability.run_logging import setup_run_logging
    from megatron_dapo.rollout.from_config import server_urls, sglang_engine
    from megatron_dapo.service.rollout_service import RolloutService

    setup_run_logging(cfg.train.output_dir, "rollout")
    conn = _Link(conn)
    threading.Thread(target=_beat, args=(conn, min(cfg.parallel.heartbeat_timeout_s / 5, 10.0)), name="heartbeat",
                     daemon=True).start()
    engine = service = None
    try:
        # The servers start (minutes on GPUs) while the service loads its tokenizer, data and reward workers.
        engine = sglang_engine(cfg, Path(cfg.train.output_dir) / "sglang",
                               on_server_restart=lambda url: service.jobs.server_restarted(url), wait=False)
        service = RolloutService(cfg, engine, dp_size)
        engine.wait_launched()
    except BaseException as e:  # noqa: BLE001 -- reported to the driver, which raises it
        log.exception("the rollout service did not start")
        if service is not None:
            service.close()  # its reward workers, and the engine
        elif engine is not None:
            engine.close()
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        except OSError:  # the driver is gone too
            pass
        return
    try:
        conn.send(("up", server_urls(engine)))
        _answer(service, conn, cfg.rollout.job_timeout_s)
    except (EOFError, OSError):
        log.warning("the driver is gone: stopping the rollout service")
    finally:
        service.close()
        # Its servers are stopped. A job thread still blocked (past its deadline, or on a server that will not
        # come back) must not hold the exit, as the interpreter's exit would wait for the engine's threads.
        logging.shutdown()
        os._exit(0)


def _answer(service, conn: _Link, job_timeout_s: float) -> None:
    """Run the driver's commands, the jobs queued on the service's thread, until told to close; send each
    job's result as it is done, and a restarted server's need for the weights as it arises. A job that runs
    past `job_timeout_s` is sent as failed, and the service stops (its thread cannot be stopped)."""
    while True:
        if conn.poll(0.05 if service.pending else None):
            command, *args = conn.recv()
            if command == "close":
                return
            if command == "batch":
                service.start_batch(*args)
            elif command == "eval":
                service.start_eval()
            elif command == "resynced":
                service.resynced()
            elif command == "state":
                try:
                    conn.send(("state", service.state_dict(), None))
                except RuntimeError as e:
                    conn.send(("state", None, str(e)))
            elif command == "load_state":
                service.load_state_dict(*args)
            else:
                raise RuntimeError(f"the rollout service got an unknown command {command!r}")
        running_s = service.jobs.running_s
        if running_s is not None and running_s > job_timeout_s:
            job = service.pending[0]
            log.error("the %s job has run for %.0f s, past rollout.job_timeout_s; stopping the service", job, running_s)
            conn.send(("done", None, f"the {job} job did not finish within rollout.job_timeout_s = {job_timeout_s:g} "
                                     "s (see the service's log for what it was waiting on); raise it if a step's "
                                     "sampling really takes that long"))
            return
        if service.pending and service.restarted is None:
            status = service.wait(timeout=0)
            if status == RESYNC:
                conn.send((RESYNC, service.restarted))
            elif status == READY:
                _send_result(service, conn)


def _send_result(service, conn) -> None:
    job = service.pending[0]
    try:
        result = service.take()
    except Exception:  # noqa: BLE001 -- the driver raises it
        log.exception("the rollout service's %s job failed", job)
        conn.send(("done", None, traceback.format_exc()))
        return
    conn.send(("done", result.state_dict() if job == "batch" else result, None))
