"""The loop of one judging process: receive (index, text, ground truth), send back (index, Verdict)."""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from megatron_dapo.reward.verdict import Verdict

READY = "ready"


def serve(conn: Connection) -> None:
    # Ctrl-C reaches the whole process group; the pool decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns that its timeouts are off: the pool enforces them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from megatron_dapo.reward.math_verifier import judge  # here, so the trainer's process never loads sympy

    # Warm up (imports, regex compilation, the LaTeX parser) so a sample's time limit measures only its own work.
    judge("Answer: $\\frac{1}{2}$", "0.5")
    conn.send(READY)
    while True:
        try:
            index, text, ground_truth = conn.recv()
        except EOFError:  # the pool's process is gone
            return
        try:
            verdict = judge(text, ground_truth)
        except Exception as error:  # a bug or an unexpected input must cost one sample, not the worker
            verdict = Verdict(False, f"error: {type(error).__name__}: {str(error)[:200]}")
        conn.send((index, verdict))
