"""A pool of judging processes with a hard wall-clock limit per sample.

Workers run math-verify without its own timeouts; the pool enforces the limit from outside, which also bounds
native code that never checks for signals. A sample that runs past timeout_s (e.g. sympy evaluating
9^(9^(9^9)), which computes a 370-million-digit integer first) has its worker killed and replaced and is scored
wrong with reason "timeout"; a worker that dies (a crash, the OOM killer) is replaced and its sample scored wrong
with reason "worker_crashed". Workers are spawned, not forked, so they inherit no threads or CUDA state from the
trainer.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import deque
from multiprocessing.connection import wait

from megatron_dapo.reward.config import RewardConfig
from megatron_dapo.reward.verdict import Verdict
from megatron_dapo.reward.worker import READY, serve

logger = logging.getLogger(__name__)


class _Worker:
    def __init__(self, context):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=serve, args=(child_conn,), name="reward-worker", daemon=True)
        self.process.start()
        child_conn.close()  # so that the worker's death shows as end-of-file here
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None  # index of the sample being judged
        self.text = ""  # what it is judging, for the log
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """score(responses, ground_truths) -> one Verdict per response, in order, judged in parallel.

    Use as a context manager, or call close(): it stops every worker process.
    """

    def __init__(self, config: RewardConfig):
        self.config = config
        self._context = multiprocessing.get_context("spawn")
        self._workers = [_Worker(self._context) for _ in range(config.num_workers)]
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def wait_until_ready(self) -> None:
        """Block until every worker has started (score() does not need this; it surfaces startup errors early)."""
        with self._lock:
            while not all(worker.ready for worker in self._workers):
                self._wait_and_collect([])

    def score(self, responses: list[str], ground_truths: list[str]) -> list[Verdict]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"RewardPool.score: {len(responses)} responses but {len(ground_truths)} ground truths; "
                             "pass one ground truth per response")
        for name, values in (("responses", responses), ("ground_truths", ground_truths)):
            bad = next((i for i, value in enumerate(values) if not isinstance(value, str)), None)
            if bad is not None:
                raise TypeError(f"RewardPool.score: {name}[{bad}] is {type(values[bad]).__name__}, not str")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool.score: the pool is closed")
            tail = self.config.tail_chars
            todo = deque((i, response[-tail:], truth)
                         for i, (response, truth) in enumerate(zip(responses, ground_truths)))
            verdicts: list[Verdict | None] = [None] * len(responses)
            try:
                while todo or any(worker.task is not None for worker in self._workers):
                    self._dispatch(todo)
                    self._wait_and_collect(verdicts)
            finally:
                # Interrupted mid-batch: a worker still judging would answer a stale sample later.
                for i, worker in enumerate(self._workers):
                    if worker.task is not None:
                        self._replace(i)
            return verdicts

    def close(self) -> None:
        """Stop every worker. They hold nothing worth a graceful exit, so they are killed and reaped at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.kill()

    def _dispatch(self, todo: deque) -> None:
        for worker in self._workers:
            if not todo:
                return
            # A dead worker is skipped here and replaced when its end-of-file is collected.
            if worker.ready and worker.task is None and worker.process.is_alive():
                index, text, truth = todo[0]
                try:
                    worker.conn.send((index, text, truth))
                except OSError:
                    continue
                todo.popleft()
                worker.task, worker.text = index, text
                worker.deadline = time.monotonic() + self.config.timeout_s

    def _wait_and_collect(self, verdicts: list) -> None:
        deadlines = [w.deadline if w.ready else w.started_at + self.config.startup_timeout_s for w in self._workers]
        first = min(deadlines)
        timeout = None if first == float("inf") else max(0.0, first - time.monotonic())
        readable = set(wait([w.conn for w in self._workers] + [w.process.sentinel for w in self._workers], timeout))
        for i, worker in enumerate(self._workers):
            if worker.conn in readable or worker.process.sentinel in readable:
                self._receive(i, verdicts)
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            if worker.task is not None and now >= worker.deadline:
                logger.warning("reward: sample %d ran past reward.timeout_s = %s s; killed worker pid %d, scored it "
                               "wrong (timeout). The end of its text: %r", worker.task, self.config.timeout_s,
                               worker.process.pid, worker.text[-200:])
                verdicts[worker.task] = Verdict(False, "timeout")
                self._replace(i)
            elif not worker.ready and now >= worker.started_at + self.config.startup_timeout_s:
                raise RuntimeError(f"reward worker pid {worker.process.pid} did not start within "
                                   f"reward.startup_timeout_s = {self.config.startup_timeout_s} s (importing sympy "
                                   "and math-verify); the machine may be overloaded, raise the limit")

    def _receive(self, i: int, verdicts: list) -> None:
        worker = self._workers[i]
        ended = False
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message == READY:
                    worker.ready = True
                else:
                    index, verdict = message
                    verdicts[index] = verdict
                    worker.task, worker.deadline = None, float("inf")
        except (EOFError, OSError):
            ended = True
        if not ended and worker.process.is_alive():
            return
        worker.process.join(timeout=1.0)  # it closed its end, so it is exiting
        code = worker.process.exitcode
        if worker.task is not None:
            logger.warning("reward: worker pid %d died (exit code %s) while judging sample %d; replaced it, scored "
                           "the sample wrong (worker_crashed)", worker.process.pid, code, worker.task)
            verdicts[worker.task] = Verdict(False, "worker_crashed")
        elif not worker.ready and code is not None and code > 0:
            raise RuntimeError(f"reward worker pid {worker.process.pid} failed to start (exit code {code}; its "
                               "traceback is above): check that math-verify imports, and that the main script "
                               "starts the pool under `if __name__ == '__main__':` (workers are spawned)")
        else:
            logger.warning("reward: worker pid %d died (exit code %s) while not judging; replaced it",
                           worker.process.pid, code)
        self._replace(i)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._context)
