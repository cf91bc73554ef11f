"""The rollout service's job runner: jobs run beside the main thread one after another, in order, and a server
that restarts during one gets its weights from the main thread (where every collective runs), never from the
engine's threads."""

import queue
import threading

import pytest

from megatron_dapo.service.rollout_service import READY, RESYNC, JobRunner


def test_a_restart_during_a_job_waits_for_the_main_threads_resync():
    jobs = JobRunner(threaded=True)
    synced = []

    def rollout():
        engine_thread = threading.Thread(target=jobs.server_restarted, args=("http://s1",))  # an engine thread
        engine_thread.start()
        engine_thread.join()
        return f"sampled after {len(synced)} resync(s)"

    jobs.start("batch", rollout)
    assert jobs.wait() == RESYNC and jobs.restarted == "http://s1"
    synced.append(1)  # the trainer syncs the weights to every server here, with every rank
    jobs.resynced()
    assert jobs.wait() == READY
    assert jobs.take() == "sampled after 1 resync(s)"
    assert jobs.wait() == READY  # no job: nothing to wait for


def test_jobs_run_one_after_another_in_order_and_errors_reach_the_main_thread():
    jobs = JobRunner(threaded=True)
    release = threading.Event()
    ran = []
    jobs.start("batch", lambda: ran.append(1) or release.wait())
    jobs.start("batch", lambda: ran.append(2) or 2)  # queued: the next step's batch
    jobs.start("eval", lambda: ran.append(3) or {"eval/avg@4": 0.5})
    assert jobs.pending == ["batch", "batch", "eval"]
    with pytest.raises(RuntimeError, match="no finished job to take"):
        jobs.take()
    assert jobs.wait(timeout=0.2) is None and ran == [1]  # the second waits for the first
    release.set()
    assert jobs.wait() == READY and jobs.take() is True
    assert jobs.wait() == READY and jobs.take() == 2
    assert jobs.wait() == READY and jobs.take() == {"eval/avg@4": 0.5}
    assert ran == [1, 2, 3] and jobs.pending == []

    def fail():
        raise ValueError("the server refused the group")

    jobs.start("batch", fail)
    jobs.start("batch", lambda: "next")
    assert jobs.wait() == READY
    with pytest.raises(ValueError, match="refused"):
        jobs.take()
    assert jobs.wait() == READY and jobs.take() == "next"  # a failed job does not stop the queue
    assert jobs.idle_s >= 0


class _RestartsThatMustNotBlock:
    """A restart queue with nothing in it that fails the test if wait() blocks on it."""

    def get(self, block=True, timeout=None):
        if block and timeout != 0:
            raise AssertionError(f"wait() blocked on the restart queue (timeout {timeout}) for a finished job")
        raise queue.Empty

    def get_nowait(self):
        raise queue.Empty


@pytest.mark.parametrize("threaded", [False, True])
def test_a_finished_job_is_ready_at_once(threaded):
    """The in-process engine's jobs are done when start() returns; wait() must not sit on the restart queue first
    (it slept 50 ms a step, 8% of the demo's step)."""
    jobs = JobRunner(threaded=threaded)
    jobs.start("batch", lambda: "sampled")
    jobs._jobs[0].done.wait()
    jobs._restarts = _RestartsThatMustNotBlock()
    assert jobs.wait() == READY and jobs.take() == "sampled"


def test_a_restart_where_no_rank_waits_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="restarted outside a rollout or an evaluation"):
        JobRunner(threaded=True).server_restarted("http://s1")
    inline = JobRunner(threaded=False)  # the in-process engine: no servers
    assert inline.wait() == READY
    inline.start("batch", lambda: 3)
    assert inline.wait() == READY and inline.take() == 3


# -- the service in its own process -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def service_config(tmp_path_factory):
    """A run whose servers are given by URL (nothing listens there: these tests send no group)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    from tiny_models import save_with_tokenizer

    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.run_config import config_from_dict

    root = tmp_path_factory.mktemp("service")
    save_with_tokenizer(root / "model")
    write_rows(root / "train.jsonl", generate_rows(64, 0))

    def make(parallel=None, rollout=None, **data):
        return config_from_dict({"model": {"path": str(root / "model")},
                                 "data": {"train_path": str(root / "train.jsonl"), **data},
                                 "rollout": {"server_urls": ["http://127.0.0.1:9"], **(rollout or {})},
                                 "parallel": parallel or {},
                                 "reward": {"num_workers": 1}, "train": {"output_dir": str(root / "run")}})
    return make


def test_the_service_process_reports_its_servers_and_its_data_position(service_config):
    from megatron_dapo.service.rollout_service_process import RolloutServiceProcess

    service = RolloutServiceProcess(service_config(), dp_size=1)
    try:
        assert service.server_urls == []  # until it is up
        service.wait_up()
        assert service.server_urls == ["http://127.0.0.1:9"] and service.wait() == READY
        state = service.state_dict()
        service.load_state_dict(state)
        assert service.state_dict() == state
        service.start_eval()  # no held-out prompts: {} without a group sent
        service.start_eval()
        assert service.pending == ["eval", "eval"]
        for _ in range(2):
            assert service.wait() == READY and service.take() == {}
        assert service.pending == []
    finally:
        service.close()
    assert service._proc.exitcode == 0


def test_a_service_that_cannot_start_or_dies_is_named_not_waited_for(service_config, tmp_path):
    import os
    import signal

    from megatron_dapo.service.rollout_service_process import RolloutServiceError, RolloutServiceProcess

    with pytest.raises(RolloutServiceError, match="did not start: .*missing.jsonl"):
        RolloutServiceProcess(service_config(train_path=str(tmp_path / "missing.jsonl")), dp_size=1).wait_up()

    service = RolloutServiceProcess(service_config(), dp_size=1)
    service.wait_up()
    os.kill(service._proc.pid, signal.SIGKILL)
    with pytest.raises(RolloutServiceError, match=r"process exited \(code -9\); its log: .*rollout.log"):
        service.start_batch(0)
        service.wait()
    service.close()


def test_a_stopped_service_process_is_named_within_the_heartbeat_timeout(service_config):
    import os
    import signal
    import time

    from megatron_dapo.service.rollout_service_process import RolloutServiceError, RolloutServiceProcess

    service = RolloutServiceProcess(service_config(parallel={"heartbeat_timeout_s": 2.0}), dp_size=1)
    try:
        service.wait_up()
        os.kill(service._proc.pid, signal.SIGSTOP)
        service.start_eval()
        begin = time.monotonic()
        with pytest.raises(RolloutServiceError, match=rf"process \(pid {service._proc.pid}\) has sent nothing, not "
                           r"even its heartbeat, for 2 s \(parallel.heartbeat_timeout_s\): it is stuck"):
            service.wait()
        assert time.monotonic() - begin < 2.0 + 1.0
    finally:
        os.kill(service._proc.pid, signal.SIGCONT)
        service.close()


def test_a_job_past_its_deadline_fails_the_run_naming_it(service_config):
    """Nothing listens at the server's URL: the engine waits for it to come back (rollout.server_urls servers are
    not ours to restart), far longer than the job may take."""
    from megatron_dapo.service.rollout_service_process import RolloutServiceError, RolloutServiceProcess

    cfg = service_config(rollout={"request_timeout_s": 1.0, "job_timeout_s": 3.0}, chat_template=False)
    service = RolloutServiceProcess(cfg, dp_size=1)
    try:
        service.wait_up()
        service.start_batch(0)
        assert service.wait() == READY
        with pytest.raises(RolloutServiceError, match=r"batch job did not finish within rollout.job_timeout_s = 3 s"):
            service.take()
        service._proc.join(60)
        assert service._proc.exitcode == 0  # it stopped on its own
    finally:
        service.close()


@pytest.mark.parametrize("when", ["up", "starting"])
def test_the_service_process_stops_when_the_driver_is_gone(service_config, when):
    """Up, or still starting (the driver fails while it builds the policy beside the service's start-up)."""
    from megatron_dapo.service.rollout_service_process import RolloutServiceProcess

    service = RolloutServiceProcess(service_config(), dp_size=1)
    if when == "up":
        service.wait_up()
    service._conn.close()  # as when the driver dies
    service._proc.join(60)
    assert service._proc.exitcode == 0


def test_closing_releases_a_job_that_waits_for_a_resync_that_will_not_come():
    """The driver stops (an error elsewhere): a job blocked on a restarted server's resync fails at once instead
    of holding the service's shutdown."""
    jobs = JobRunner(threaded=True)
    jobs.start("batch", lambda: jobs.server_restarted("http://s1"))
    assert jobs.wait() == RESYNC
    jobs.close()
    assert jobs.wait() == READY
    with pytest.raises(RuntimeError, match="closed while the restarted server http://s1 waited for the weights"):
        jobs.take()
