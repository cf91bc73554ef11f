"""Trainer ranks beat (rank_heartbeat.py): a stopped rank, or a stopped store host, is named within the heartbeat
timeout, and the rank that sees it ends the job; ranks that end normally raise no alarm. Real processes, real
SIGSTOP."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_trainer_loop import config, kill_tree, launch, metrics

from megatron_dapo.rank_heartbeat import STUCK_EXIT_CODE
from megatron_dapo.runtime import free_port

WORKER = Path(__file__).parent / "distributed" / "heartbeat_worker.py"


def start(*args: str) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                             "MASTER_PORT": str(port)}) for r in range(2)]


def end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_heartbeat_timeout(stopped):
    """Rank 1 stopped: rank 0 names it (node, pid, what it was doing). Rank 0 stopped: the store lives in it, so
    rank 1 names the store. Either way the watching rank exits with STUCK_EXIT_CODE within the 2 s timeout and
    a beat or two, while the collective it waits in would have waited 300 s."""
    procs = start("stop", str(stopped))
    try:
        watcher = procs[1 - stopped]
        begin = time.monotonic()
        assert watcher.wait(timeout=60) == STUCK_EXIT_CODE
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


def test_ranks_that_end_raise_no_alarm():
    procs = start("finish")
    try:
        for r, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, p.stdout.read()
            assert f"rank {r} done" in p.stdout.read()
    finally:
        end(procs)


def test_a_main_thread_past_its_deadline_ends_the_run_naming_what_it_was_doing():
    """A job of one rank has no beats to watch, but its main thread's deadlines hold all the same."""
    code = ("import time; from megatron_dapo.rank_heartbeat import RankHeartbeat; "
            "h = RankHeartbeat(0, 1, 'node-a', None, 0, 5.0); "
            "h.set_doing('writing the checkpoint of step 3 in /ckpt', 1.0, 'train.checkpoint_timeout_s'); "
            "time.sleep(60)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == STUCK_EXIT_CODE
    assert ("rank 0: its main thread is still writing the checkpoint of step 3 in /ckpt after 1 s "
            "(train.checkpoint_timeout_s)") in done.stderr


@pytest.mark.slow
def test_a_stopped_trainer_rank_at_tp2_ends_the_job_naming_it_and_leaves_no_process(task, tmp_path):
    """`megatron-dapo train` at TP=2 with a real SGLang server: rank 1 is stopped mid-run. Without the heartbeat
    rank 0 would wait in its next collective for parallel.distributed_timeout_minutes; with it, rank 0 names rank 1
    within parallel.heartbeat_timeout_s and exits, torchrun stops rank 1, and the rollout service stops its
    server: no process of the run is left."""
    sglang = {"engine": "sglang", "server_device": "cpu", "weight_sync": "disk", "server_startup_timeout_s": 900}
    out = tmp_path / "stuck"
    cfg = config(task, out, rollout=sglang, train={"steps": 50},
                 parallel={"device": "cpu", "seed": 7, "tensor_parallel": 2, "heartbeat_timeout_s": 10})
    proc = launch(cfg, 2)
    try:
        deadline = time.monotonic() + 900
        while not ((out / "metrics.jsonl").is_file() and metrics(out)) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, cfg.with_suffix(".log").read_text()[-8000:]
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        (rank1,) = [p for p in tree if "megatron_dapo.cli" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"]
        assert any("sglang.launch_server" in " ".join(p.cmdline()) for p in tree)
        os.kill(rank1.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        rc = proc.wait(timeout=300)
        ended_s = time.monotonic() - stopped
        _, alive = psutil.wait_procs(tree, timeout=60)
        left_s = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = cfg.with_suffix(".log").read_text()
    print(f"stopped trainer rank: the job ended after {ended_s:.1f} s, its last process after {left_s:.1f} s")
    assert rc != 0
    assert f"rank 1 (node {socket.gethostname()}, pid {rank1.pid}) has not beaten for" in log, log[-8000:]
    assert "parallel.heartbeat_timeout_s = 10" in log
    assert not alive, [p.cmdline() for p in alive]  # no orphan: the service stopped its server
    assert ended_s < 10 + 30 + 30  # the timeout, torchrun's 30 s grace for the stopped rank, a busy CPU's slack
