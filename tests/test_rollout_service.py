"""The rollout service's job runner: a job runs beside the main thread, and a server that restarts during it
gets its weights from the main thread (where every collective runs), never from the engine's threads."""

import threading

import pytest

from megatron_dapo.rollout_service import READY, RESYNC, JobRunner


def test_a_restart_during_a_job_waits_for_the_main_threads_resync():
    jobs = JobRunner(threaded=True)
    synced = []

    def rollout():
        engine_thread = threading.Thread(target=jobs.server_restarted)  # as an engine worker thread calls it
        engine_thread.start()
        engine_thread.join()
        return f"sampled after {len(synced)} resync(s)"

    jobs.start("batch", rollout)
    assert jobs.wait() == RESYNC
    synced.append(1)  # the trainer syncs the weights to every server here, with every rank
    jobs.resynced()
    assert jobs.wait() == READY
    assert jobs.take() == "sampled after 1 resync(s)"
    assert jobs.wait() == READY  # no job: nothing to wait for


def test_one_job_at_a_time_and_errors_reach_the_main_thread():
    jobs = JobRunner(threaded=True)
    release = threading.Event()
    jobs.start("batch", lambda: release.wait())
    with pytest.raises(RuntimeError, match="cannot start a eval job while a batch job's result is not taken"):
        jobs.start("eval", dict)
    with pytest.raises(RuntimeError, match="no finished job to take"):
        jobs.take()
    release.set()
    assert jobs.wait() == READY and jobs.take() is True

    def fail():
        raise ValueError("the server refused the group")

    jobs.start("batch", fail)
    assert jobs.wait() == READY
    with pytest.raises(ValueError, match="refused"):
        jobs.take()
    assert jobs.job is None  # the failed job is gone: the next one may start


def test_a_restart_where_no_rank_waits_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="restarted outside a rollout or an evaluation"):
        JobRunner(threaded=True).server_restarted()
    inline = JobRunner(threaded=False)  # the in-process engine: no servers
    assert inline.wait() == READY
    inline.start("batch", lambda: 3)
    assert inline.wait() == READY and inline.take() == 3
