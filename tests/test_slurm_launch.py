"""launch/dapo.sbatch on a real two-node Slurm cluster on this machine (tests/slurm/cluster-up.sh).

Disaggregated: one fake node trains on the CPU, the other serves SGLang. A job runs 2 DAPO steps; a second
job, whose SGLang step is cancelled, fails naming that step and leaves no process behind; a third (the same
script again) resumes from the first job's checkpoint. Colocated: both nodes train and serve, each node's
first trainer pushing the weights to the server beside it, the servers releasing their memory while the
trainer trains; a trainer task stopped there fails the job, naming it, and the same script resumes it. One
job per fact would start twice the servers and trainers: the colocated layout is checked on the resumed job."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.checkpoint.trainer_checkpoint import latest_checkpoint
from megatron_dapo.config import RolloutConfig
from megatron_dapo.slurm.allocation import AllocationError, Node, colocate_nodes, job_nodes, split_nodes
from megatron_dapo.slurm.job import servers_per_node

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "launch" / "dapo.sbatch", ROOT / "tests" / "slurm" / "cluster-up.sh",
           ROOT / "tests" / "slurm" / "cluster-down.sh"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def test_split_nodes_keeps_the_first_nodes_for_training():
    nodes = [Node(f"n{i}", f"10.0.0.{i}") for i in range(1, 5)]
    layout = split_nodes(nodes, 2)
    assert [n.name for n in layout.train] == ["n1", "n2"] and [n.name for n in layout.rollout] == ["n3", "n4"]
    assert layout.master.address == "10.0.0.1"
    with pytest.raises(AllocationError, match="--rollout-nodes: 2 of a 2-node job leaves no node to train on"):
        split_nodes(nodes[:2], 2)
    with pytest.raises(AllocationError, match="SLURM_JOB_NODELIST is not set"):
        job_nodes({})


def test_colocated_jobs_train_and_serve_on_every_node():
    nodes = [Node(f"n{i}", f"10.0.0.{i}") for i in range(1, 3)]
    layout = colocate_nodes(nodes, None)
    assert layout.train == nodes and layout.rollout == nodes and layout.master.name == "n1"
    with pytest.raises(AllocationError, match="ROLLOUT_NODES / --rollout-nodes \\(1\\): a colocated job"):
        colocate_nodes(nodes, 1)


def test_job_nodes_reads_hostnames_and_addresses():
    answers = {("show", "hostnames", "n[1-2]"): "n1\nn2\n",
               ("show", "node", "-o", "n1"): "NodeName=n1 Arch=x86_64 NodeAddr=10.1.0.7 NodeHostName=a",
               ("show", "node", "-o", "n2"): "NodeName=n2 NodeHostName=b"}
    nodes = job_nodes({"SLURM_JOB_NODELIST": "n[1-2]"}, scontrol=lambda *a: answers[a])
    assert nodes == [Node("n1", "10.1.0.7"), Node("n2", "n2")]


def test_servers_per_node_fill_the_node_gpus():
    tp4 = RolloutConfig(server_tensor_parallel=4)
    assert servers_per_node({"SLURM_GPUS_PER_NODE": "8"}, tp4) == 2
    assert servers_per_node({"SLURM_GPUS_PER_NODE": "h100:8"}, tp4) == 2
    assert servers_per_node({"SLURM_GPUS_ON_NODE": "4"}, tp4) == 1
    assert servers_per_node({}, tp4) == 1
    assert servers_per_node({"SLURM_GPUS_PER_NODE": "8"}, RolloutConfig(server_device="cpu")) == 1


def test_shellcheck_passes_on_every_script():
    if subprocess.run(["which", "shellcheck"], capture_output=True).returncode != 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "shellcheck"], check=True, timeout=600, env=env)
    result = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment that reaches a fresh 2-node cluster; the daemons are stopped afterwards."""
    state = tmp_path_factory.mktemp("slurm")
    subprocess.run([str(SCRIPTS[1]), str(state), "2"], check=True, timeout=600)
    try:
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "OMP_NUM_THREADS": "1",
               "DAPO_PYTHON": sys.executable}
    finally:
        subprocess.run([str(SCRIPTS[2]), str(state)], timeout=120)


def submit(env: dict, out: Path, data: Path, *overrides: str) -> str:
    cmd = ["sbatch", "--parsable", f"--output={out}/%x-%j.out", str(SCRIPTS[0]),
           str(ROOT / "launch" / "configs" / "tiny-cpu.yaml"), f"model.path={data / 'model'}",
           f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}", "data.seed=3",
           f"train.output_dir={out}", *overrides]
    return subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def job_field(env: dict, job: str, name: str) -> str:
    line = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, check=True, capture_output=True,
                          text=True).stdout
    return re.search(rf"\b{name}=(\S+)", line).group(1)


def wait_job(env: dict, job: str, out: Path, timeout_s: float = 1200) -> tuple[str, str]:
    """(JobState, ExitCode) once the job has ended; cancels it and fails when it takes too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in ENDED:
            return state, job_field(env, job, "ExitCode")
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still running after {timeout_s} s:\n{job_output(out, job)}")


def job_output(out: Path, job: str) -> str:
    return (out / f"dapo-{job}.out").read_text(errors="replace")[-8000:]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def processes_mentioning(*texts: str) -> list[str]:
    """Live processes whose command line names any of `texts` (the run's folders, the model's)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and any(t in cmdline for t in texts) and int(proc.name) != os.getpid():
            found.append(f"{proc.name}: {cmdline}")
    return found


def run_data(task: Path, tmp_path: Path) -> Path:
    """The task's folder under this test's own: every process of the job names it, so the check for leftovers
    looks for this test's folder alone (the task's own is named by the other lane's runs too)."""
    (tmp_path / "task").symlink_to(task)
    return tmp_path / "task"


def assert_no_process_left(*texts: str) -> None:
    deadline = time.monotonic() + 30  # slurmstepd reaps a step's processes right after the step ends
    while processes_mentioning(*texts) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(*texts) == []


@pytest.mark.slow
def test_train_then_sglang_step_killed_then_resume(cluster, task, tmp_path):
    """Disaggregated, in rollout.mode one_step_off (then async): the server samples the next batch while the
    trainer trains. The SGLang step is cancelled once step 2's checkpoint is written: the job stops training and
    fails, naming it; the same job script again resumes from the latest checkpoint and trains to the end."""
    out, task = tmp_path / "run", run_data(task, tmp_path)
    out.mkdir()
    job = submit(cluster, out, task, "train.steps=30", "rollout.mode=one_step_off", "loss.correction.preset=tis")
    marker = out / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.monotonic() + 900
    while not marker.exists() and job_field(cluster, job, "JobState") not in ENDED and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), job_output(out, job)
    assert (out / "slurm" / f"job-{job}" / "sglang-0.url").is_file()
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], env=cluster, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    (step,) = [s.split()[0] for s in steps if s.endswith(" sglang-0")]
    subprocess.run(["scancel", step], env=cluster, check=True)
    state, code = wait_job(cluster, job, out)
    text = job_output(out, job)
    assert state == "FAILED" and code != "0:0", text
    assert "launch: FAILED: step 'sglang-0' on n2 exited with code" in text
    assert_no_process_left(str(tmp_path))
    assert [r["step"] for r in metrics(out)][:2] == [1, 2]
    assert [r["staleness"] for r in metrics(out)][:2] == [0, 1]  # step 2's batch was sampled during step 1

    # the same job script again, in rollout.mode async: it resumes from the latest checkpoint (step 2's, or
    # step 3's if that was written before the job stopped) and runs two more steps: the first trains on the
    # batch the stopped job had sampled for it (in the checkpoint's buffer, staleness 1), the second's batch is
    # sampled during the first, and the first's weights are pushed into the server as it samples
    resumed_from = int(latest_checkpoint(out / "checkpoints").name.removeprefix("step_"))
    job = submit(cluster, out, task, f"train.steps={resumed_from + 2}", "rollout.mode=async", "loss.correction.preset=tis")
    state, code = wait_job(cluster, job, out)
    assert (state, code) == ("COMPLETED", "0:0"), job_output(out, job)
    assert [r["step"] for r in metrics(out)] == list(range(1, resumed_from + 3))
    assert [r["staleness"] for r in metrics(out)][-2:] == [1, 1]
    assert (out / "checkpoints" / f"step_{resumed_from + 2:06d}" / "COMPLETE").is_file()
    text = (out / f"dapo-{job}.out").read_text(errors="replace")
    assert "resumed from" in text and "launch: training finished" in text
    assert_no_process_left(str(tmp_path))


def trainer_task(procid: int) -> int:
    """The pid of the `megatron-dapo train` task with this SLURM_PROCID (its global rank)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_dapo.cli" in cmdline and b"train" in cmdline and f"SLURM_PROCID={procid}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no trainer task with SLURM_PROCID={procid}")


@pytest.mark.slow
def test_colocated_job_on_two_nodes_a_stopped_trainer_task_fails_it_naming_it_and_resubmitting_resumes(
        cluster, task, tmp_path):
    """Colocated: both nodes train (one task each) and serve, each node's first trainer pushing the weights as
    tensors to the server beside it, the servers releasing their memory while the trainer trains. ROLLOUT_NODES is
    refused first. The task of rank 1 is stopped after the first checkpoint: rank 0's heartbeat names it (node,
    pid) within parallel.heartbeat_timeout_s, the train step fails, the launcher stops every step; the same script
    again resumes from that checkpoint and trains to the end in the colocated layout."""
    out, task = tmp_path / "run", run_data(task, tmp_path)
    out.mkdir()
    settings = ("rollout.colocate=true", "rollout.weight_sync=tensor", "parallel.heartbeat_timeout_s=10")
    # ROLLOUT_NODES asks for separate rollout nodes: refused by name before anything starts
    job = submit({**cluster, "ROLLOUT_NODES": "1"}, out, task, *settings)
    state, _ = wait_job(cluster, job, out)
    assert state == "FAILED" and "launch: FAILED: ROLLOUT_NODES / --rollout-nodes (1)" in job_output(out, job)

    job = submit(cluster, out, task, "train.steps=30", *settings)
    marker = out / "checkpoints" / "step_000001" / "COMPLETE"
    deadline = time.monotonic() + 900
    while not marker.exists() and job_field(cluster, job, "JobState") not in ENDED and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), job_output(out, job)
    pid = trainer_task(1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    state, code = wait_job(cluster, job, out)
    ended_s = time.monotonic() - stopped
    # The whole output: the stopped task's torch stack traces, printed as it is terminated, can fill the tail.
    text = (out / f"dapo-{job}.out").read_text(errors="replace")
    print(f"stopped trainer task: the job ended after {ended_s:.1f} s")
    assert state == "FAILED", text[-8000:]
    assert f"rank 1 (node n2, pid {pid}) has not beaten for" in text, text[-8000:]
    assert "launch: FAILED: step 'train' on n1,n2 exited with code" in text
    assert_no_process_left(str(tmp_path))

    resumed_from = len(metrics(out))
    job = submit(cluster, out, task, "train.steps=4", *settings)
    state, code = wait_job(cluster, job, out)
    assert (state, code) == ("COMPLETED", "0:0"), job_output(out, job)
    text = (out / f"dapo-{job}.out").read_text()
    assert "resumed from" in text
    assert 'rollout.server_nodes=["n1", "n2"]' in text and "launch: training finished" in text
    records = metrics(out)
    assert records[-1]["step"] == 4 and (out / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    resumed = records[resumed_from:]
    assert [r["step"] for r in resumed][-3:] == [2, 3, 4]
    for r in resumed:  # both servers were released after the rollout and resumed around the sync
        assert r["time/release"] > 0 and r["time/resume"] > 0, r
    for i in (0, 1):  # each server paused, released, resumed, and took its weights as tensors, at least twice
        log = (out / "slurm" / f"job-{job}" / f"sglang-{i}.log").read_text()
        for endpoint in ("pause_generation", "release_memory_occupation", "resume_memory_occupation",
                         "update_weights_from_tensor", "continue_generation"):
            assert log.count(f"POST /{endpoint} HTTP/1.1\" 200") >= 2, (i, endpoint)
    assert_no_process_left(str(tmp_path))
