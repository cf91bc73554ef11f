"""The loop of one judging process: receive a batch of (task, final answer, ground truth), send back
[(task, correct, reason), ...]. Before each judgement it writes (start time, position in the batch) into
shared memory, so that the pool can tell which answer ran past its time without a message per answer."""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection

READY = "ready"
# The progress array's slots: time.monotonic() (system-wide on Linux) when the current answer started, its
# position in the batch. Each is one aligned 8-byte write, so the pool never reads half of one.
STARTED, POSITION = 0, 1


def serve(conn: Connection, progress) -> None:
    # Ctrl-C reaches the whole process group; the pool decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns that its timeouts are off: the pool enforces them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from megatron_dapo.reward.math_verifier import judge_answer  # here, so the trainer never loads sympy
    from megatron_dapo.reward.verdict import Verdict

    # Warm up (imports, regex compilation, the LaTeX parser) so an answer's time limit measures only its own work.
    judge_answer("\\frac{1}{2}", "0.5")
    conn.send(READY)
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the pool's process is gone
            return
        results = []
        for position, (task, answer, ground_truth) in enumerate(batch):
            progress[STARTED] = time.monotonic()
            progress[POSITION] = position
            try:
                verdict = judge_answer(answer, ground_truth)
            except Exception as error:  # a bug or an unexpected input must cost one answer, not the worker
                verdict = Verdict(False, f"error: {type(error).__name__}: {str(error)[:200]}")
            results.append((task, verdict.correct, verdict.reason))
        conn.send(results)
