"""Trainer ranks beat (parallel/rank_heartbeat.py): a stopped rank, or a stopped store host, is named within the
heartbeat timeout, and the rank that sees it ends the job; ranks that end normally raise no alarm. Real processes,
real SIGSTOP. A trainer rank stopped in a whole run at TP=2 (named, the job ended, no process left) is the stopped
run of test_trainer_loop.py's TP=2 resume test."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.parallel.rank_heartbeat import PEER_FAILED_EXIT_CODE, STUCK_EXIT_CODE
from megatron_dapo.parallel.runtime import free_port

WORKER = Path(__file__).parent / "distributed" / "heartbeat_worker.py"
# A hang guard, not a timing: the ranks' collectives wait 900 s (heartbeat_worker.py), their heartbeats 2 s; a
# shared 2-core machine may take a minute to start two processes that import torch (CI's did).
HUNG_AFTER_S = 300


def start(*args: str) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                             "MASTER_PORT": str(port)}) for r in range(2)]


def wait(procs: list[subprocess.Popen], rank: int) -> int:
    """Rank `rank`'s exit code; a failure showing what every rank said, if it is still running after HUNG_AFTER_S."""
    try:
        return procs[rank].wait(timeout=HUNG_AFTER_S)
    except subprocess.TimeoutExpired:
        end(procs)
        said = "\n".join(f"rank {r}:\n{p.stdout.read()}" for r, p in enumerate(procs))
        pytest.fail(f"rank {rank} still running after {HUNG_AFTER_S} s:\n{said}")


def end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_heartbeat_timeout(stopped):
    """Rank 1 stopped: rank 0 names it (node, pid, what it was doing). Rank 0 stopped: the store lives in it, so
    rank 1 names the store. Either way the watching rank exits with STUCK_EXIT_CODE within the 2 s timeout and
    a beat or two, while the collective it waits in would have waited 900 s."""
    procs = start("stop", str(stopped))
    try:
        watcher = procs[1 - stopped]
        begin = time.monotonic()
        assert wait(procs, 1 - stopped) == STUCK_EXIT_CODE
        took = time.monotonic() - begin
        out = watcher.stdout.read()
        if stopped == 1:
            assert f"rank 1 (node node-a, pid {procs[1].pid}) has not beaten for" in out
            assert "stuck while doing: scenario stop" in out
        else:
            assert "key-value store at 127.0.0.1" in out and "stopped answering" in out
        assert "parallel.heartbeat_timeout_s = 2" in out
        print(f"rank {stopped} stopped: named after {took:.1f} s (from the start of both ranks)")
        assert procs[stopped].poll() is None  # still stopped: the launcher (torchrun, srun) kills it
    finally:
        end(procs)


def test_a_rank_that_fails_says_why_and_the_other_ends_at_its_next_beat_naming_it():
    """Issue 49: a rank that fails while the others wait for it in a collective (rank 0 reading a prompt file that is
    not there, the others already in the policy's build) tells them through its heartbeat; each ends at once with
    the failed rank's error, rather than wait out the collective's 30 minutes. The failed rank is left alive here,
    as a process whose exit hangs would be."""
    procs = start("fail", "0")
    try:
        begin = time.monotonic()
        assert wait(procs, 1) == PEER_FAILED_EXIT_CODE
        took = time.monotonic() - begin
        out = procs[1].stdout.read()
        assert (f"rank 1: rank 0 (node node-a, pid {procs[0].pid}) failed: FileNotFoundError: train.jsonl: no such "
                "file. Ending this rank too (exit code 1)") in out, out
        print(f"rank 0 failed: rank 1 ended after {took:.1f} s (from the start of both ranks)")
    finally:
        end(procs)


def test_the_other_ranks_end_only_after_a_failed_rank_has_said_its_own_error():
    """A failed rank stops its helpers before it says its error and exits; another rank's early exit made the
    launcher kill it before it said it (torchrun under load: the run's one-line error never printed). The other rank
    now ends two beats after the failed one said it was ending, naming its error. (The failed rank stays alive
    after saying it here: its exit would break the other's barrier before the beats tell.)"""
    procs = start("fail_slowly", "0")
    try:
        assert wait(procs, 1) == PEER_FAILED_EXIT_CODE
        ended = time.time()
        assert procs[0].poll() is None
        end(procs)
        said = procs[0].stdout.read()
        assert "rank 0: its own error at " in said, said
        assert float(said.split("its own error at ")[1].split()[0]) < ended
        assert "failed: FileNotFoundError: train.jsonl: no such file. Ending this rank too" in procs[1].stdout.read()
    finally:
        end(procs)


def test_ranks_that_end_raise_no_alarm():
    procs = start("finish")
    try:
        for r, p in enumerate(procs):
            assert wait(procs, r) == 0, p.stdout.read()
            assert f"rank {r} done" in p.stdout.read()
    finally:
        end(procs)


def test_a_main_thread_past_its_deadline_ends_the_run_naming_what_it_was_doing():
    """A job of one rank has no beats to watch, but its main thread's deadlines hold all the same."""
    code = ("import time; from megatron_dapo.parallel.rank_heartbeat import RankHeartbeat; "
            "h = RankHeartbeat(0, 1, 'node-a', None, 0, 5.0); "
            "h.set_doing('writing the checkpoint of step 3 in /ckpt', 1.0, 'train.checkpoint_timeout_s'); "
            "time.sleep(60)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == STUCK_EXIT_CODE
    assert ("rank 0: its main thread is still writing the checkpoint of step 3 in /ckpt after 1 s "
            "(train.checkpoint_timeout_s)") in done.stderr
