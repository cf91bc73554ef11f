"""A pool of judging processes with a hard wall-clock limit per answer.

The pool's process finds each response's final answer (reward/final_answer.py, a regular expression over the
tail) and sends each distinct (answer, ground truth) once: the G responses of a group often agree, and judging
(sympy) is most of the cost. Answers go to workers in batches, one message each way per batch; a worker writes
which answer it is on into shared memory, so the limit is still per answer.

Workers run math-verify without its own timeouts; the pool enforces the limit from outside, which also bounds
native code that never checks for signals. An answer that runs past timeout_s (e.g. sympy evaluating
9^(9^(9^9)), which computes a 370-million-digit integer first) has its worker killed and replaced and is scored
wrong with reason "timeout"; a worker that dies (a crash, the OOM killer) is replaced and the answer it was on is
scored wrong with reason "worker_crashed". The rest of a lost batch is sent again. Workers are spawned, not
forked, so they inherit no threads or CUDA state from the trainer.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import threading
import time
from collections import deque
from multiprocessing.connection import wait

from megatron_dapo.reward.config import RewardConfig
from megatron_dapo.reward.final_answer import final_answer
from megatron_dapo.reward.verdict import Verdict
from megatron_dapo.reward.worker import POSITION, READY, STARTED, serve

logger = logging.getLogger(__name__)


class _Worker:
    def __init__(self, context):
        self.conn, child_conn = context.Pipe()
        self.progress = context.RawArray("d", 2)  # see worker.STARTED / POSITION
        self.process = context.Process(target=serve, args=(child_conn, self.progress), name="reward-worker",
                                       daemon=True)
        self.process.start()
        child_conn.close()  # so that the worker's death shows as end-of-file here
        self.started_at = time.monotonic()
        self.ready = False
        self.batch: list[tuple[int, str, str]] = []  # (task, answer, ground truth) being judged

    def send(self, batch: list[tuple[int, str, str]]) -> None:
        self.progress[STARTED], self.progress[POSITION] = time.monotonic(), 0
        self.conn.send(batch)
        self.batch = batch

    def current(self) -> tuple[int, str, str]:
        """The answer it is judging (the first of its batch if it has not begun)."""
        return self.batch[min(int(self.progress[POSITION]), len(self.batch) - 1)]

    def deadline(self, timeout_s: float) -> float:
        return self.progress[STARTED] + timeout_s if self.batch else math.inf

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
                self._wait_and_collect(deque(), {})

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
            verdicts: list[Verdict | None] = [None] * len(responses)
            tasks: dict[tuple[str, str], list[int]] = {}  # (answer, ground truth) -> the responses that give it
            for i, (response, truth) in enumerate(zip(responses, ground_truths)):
                answer = final_answer(response[-self.config.tail_chars:])
                if answer is None:
                    verdicts[i] = Verdict(False, "no_answer")
                else:
                    tasks.setdefault((answer, truth), []).append(i)
            keys = list(tasks)
            todo = deque((task, answer, truth) for task, (answer, truth) in enumerate(keys))
            judged: dict[int, Verdict] = {}
            try:
                while todo or any(worker.batch for worker in self._workers):
                    self._dispatch(todo)
                    self._wait_and_collect(todo, judged)
            finally:
                # Interrupted mid-batch: a worker still judging would answer a stale batch later.
                for i, worker in enumerate(self._workers):
                    if worker.batch:
                        self._replace(i)
            for task, key in enumerate(keys):
                for i in tasks[key]:
                    verdicts[i] = judged[task]
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
        idle = [w for w in self._workers if w.ready and not w.batch and w.process.is_alive()]
        # Even shares for the idle workers, no larger than reward.max_answers_per_message (load balance).
        size = min(self.config.max_answers_per_message, math.ceil(len(todo) / max(len(idle), 1)))
        for worker in idle:  # a dead worker is skipped here and replaced when its end-of-file is collected
            if not todo:
                return
            batch = [todo.popleft() for _ in range(min(size, len(todo)))]
            try:
                worker.send(batch)
            except OSError:
                todo.extendleft(reversed(batch))
                worker.batch = []

    def _wait_and_collect(self, todo: deque, judged: dict[int, Verdict]) -> None:
        timeout_s = self.config.timeout_s
        deadlines = [w.deadline(timeout_s) if w.ready else w.started_at + self.config.startup_timeout_s
                     for w in self._workers]
        first = min(deadlines)
        timeout = None if first == math.inf else max(0.0, first - time.monotonic())
        readable = set(wait([w.conn for w in self._workers] + [w.process.sentinel for w in self._workers], timeout))
        for i, worker in enumerate(self._workers):
            if worker.conn in readable or worker.process.sentinel in readable:
                self._receive(i, todo, judged)
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            if worker.batch and now >= worker.deadline(timeout_s):
                task, answer, _ = worker.current()
                logger.warning("reward: an answer ran past reward.timeout_s = %s s; killed worker pid %d, scored it "
                               "wrong (timeout). The end of the answer: %r", timeout_s, worker.process.pid,
                               answer[-200:])
                self._lose_batch(i, todo, judged, Verdict(False, "timeout"))
            elif not worker.ready and now >= worker.started_at + self.config.startup_timeout_s:
                raise RuntimeError(f"reward worker pid {worker.process.pid} did not start within "
                                   f"reward.startup_timeout_s = {self.config.startup_timeout_s} s (importing sympy "
                                   "and math-verify); the machine may be overloaded, raise the limit")

    def _receive(self, i: int, todo: deque, judged: dict[int, Verdict]) -> None:
        worker = self._workers[i]
        ended = False
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message == READY:
                    worker.ready = True
                else:
                    judged.update((task, Verdict(correct, reason)) for task, correct, reason in message)
                    worker.batch = []
        except (EOFError, OSError):
            ended = True
        if not ended and worker.process.is_alive():
            return
        worker.process.join(timeout=1.0)  # it closed its end, so it is exiting
        code = worker.process.exitcode
        if worker.batch:
            task, answer, _ = worker.current()
            logger.warning("reward: worker pid %d died (exit code %s) while judging the answer %r; replaced it, "
                           "scored the answer wrong (worker_crashed)", worker.process.pid, code, answer[-200:])
            self._lose_batch(i, todo, judged, Verdict(False, "worker_crashed"))
            return
        if not worker.ready and code is not None and code > 0:
            raise RuntimeError(f"reward worker pid {worker.process.pid} failed to start (exit code {code}; its "
                               "traceback is above): check that math-verify imports, and that the main script "
                               "starts the pool under `if __name__ == '__main__':` (workers are spawned)")
        logger.warning("reward: worker pid %d died (exit code %s) while not judging; replaced it",
                       worker.process.pid, code)
        self._replace(i)

    def _lose_batch(self, i: int, todo: deque, judged: dict[int, Verdict], verdict: Verdict) -> None:
        """The worker's current answer gets verdict; the rest of its batch is sent again; the worker is replaced."""
        worker = self._workers[i]
        current = worker.current()
        judged[current[0]] = verdict
        todo.extendleft(reversed([t for t in worker.batch if t is not current]))
        self._replace(i)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._context)
