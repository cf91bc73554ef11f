"""DAPO inside a SLURM allocation: `python -m megatron_dapo.slurm.job CONFIG [overrides...]`.

Run by launch/dapo.sbatch on the job's first node. Disaggregated (the default), the last `--rollout-nodes`
nodes run SGLang servers; colocated (rollout.colocate: true), every node does, on the GPUs it trains on.
Each server is one `srun --overlap` step of `megatron_dapo.slurm.serve`, as many per node as its GPUs hold
at rollout.server_tensor_parallel (one on CPUs); once all answer /health, the training nodes train (one
`srun` step of `megatron-dapo train`, one task per GPU, rendezvous on the first node) with
`rollout.server_urls` pointing at them (and, colocated, `rollout.server_nodes` saying where each one runs,
so that each node's trainers push the weights to their own servers). When training ends, or any step fails,
every step started here is stopped; a failure exits non-zero naming the step. A requeued or resubmitted
job with the same `train.output_dir` resumes from its newest complete checkpoint (the trainer does that
by itself).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.errors import DapoError
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.server_key import ensure_server_key
from megatron_dapo.rollout.sglang_server import health_ok
from megatron_dapo.run_config import load_config
from megatron_dapo.slurm.allocation import AllocationError, Node, colocate_nodes, job_nodes, split_nodes

POLL_S = 0.5


class StepFailed(DapoError, RuntimeError):
    """A step exited, or a server did not come up in time; the message names the step."""


@dataclass
class Step:
    name: str
    nodes: list[Node]
    proc: subprocess.Popen

    def describe(self) -> str:
        return f"step '{self.name}' on {','.join(n.name for n in self.nodes)}"


def srun(name: str, nodes: list[Node], tasks_per_node: int, command: list[str], env: dict[str, str]) -> Step:
    """An srun step beside the others in the allocation (--overlap: steps do not wait for each other's CPUs)."""
    cmd = ["srun", "--overlap", f"--job-name={name}", f"--nodes={len(nodes)}", f"--ntasks-per-node={tasks_per_node}",
           f"--nodelist={','.join(n.name for n in nodes)}", "--kill-on-bad-exit=1", *command]
    print(f"launch: {name}: {' '.join(cmd)}", flush=True)
    return Step(name, nodes, subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))


def stop(step: Step, grace_s: float = 30.0) -> None:
    """SIGTERM makes srun signal its tasks and end the step; SIGKILL if it is still there after `grace_s`."""
    if step.proc.poll() is not None:
        return
    step.proc.terminate()
    try:
        step.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        step.proc.kill()
        step.proc.wait()


def check_alive(steps: list[Step]) -> None:
    for step in steps:
        rc = step.proc.poll()
        if rc is not None:
            raise StepFailed(f"{step.describe()} exited with code {rc}")


def wait_for_servers(servers: list[Step], url_files: list[Path], timeout_s: float) -> list[str]:
    """The servers' URLs once every one answers /health; fails fast if a server step exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive(servers)
        if all(f.is_file() for f in url_files):
            urls = [f.read_text().strip() for f in url_files]
            if all(health_ok(u) for u in urls):
                return urls
        time.sleep(POLL_S)
    waiting = [s.name for s, f in zip(servers, url_files) if not f.is_file()]
    raise StepFailed(f"step(s) {', '.join(waiting) or 'sglang'} not healthy after {timeout_s:.0f} s "
                     f"(rollout.server_startup_timeout_s); see the server logs next to {url_files[0]}")


def watch(train: Step, servers: list[Step]) -> None:
    """Until training ends: returns when it succeeds, raises when it or any server step exits."""
    while True:
        rc = train.proc.poll()
        if rc == 0:
            return
        if rc is not None:
            raise StepFailed(f"{train.describe()} exited with code {rc}")
        check_alive(servers)
        time.sleep(POLL_S)


def servers_per_node(environ, rollout) -> int:
    """As many TP-wide servers as a node's GPUs hold (SLURM_GPUS_PER_NODE is "8" or "h100:8"); 1 on CPUs."""
    gpus = environ.get("SLURM_GPUS_PER_NODE") or environ.get("SLURM_GPUS_ON_NODE") or ""
    if rollout.server_device == "cpu" or not gpus:
        return 1
    return max(1, int(gpus.split(":")[-1].split("(")[0]) // rollout.server_tensor_parallel)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m megatron_dapo.slurm.job", description=__doc__)
    parser.add_argument("config", help="the run's YAML config (see launch/configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as for megatron-dapo train")
    parser.add_argument("--rollout-nodes", type=int, default=None,
                        help="nodes serving SGLang, the job's last ones (default 1; none when rollout.colocate)")
    parser.add_argument("--servers-per-node", type=int, default=None,
                        help="SGLang servers per rollout node (default: its GPUs / rollout.server_tensor_parallel)")
    parser.add_argument("--train-tasks-per-node", type=int,
                        default=int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
                        help="training processes per node: one per GPU (default: sbatch's --ntasks-per-node)")
    return parser.parse_args(argv)


def run(args) -> None:
    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.engine != "sglang":
        raise ConfigError("rollout.engine: the SLURM launcher serves rollouts with SGLang; set it to 'sglang'")
    if cfg.rollout.colocate:
        layout = colocate_nodes(job_nodes(), args.rollout_nodes)
    elif cfg.rollout.weight_sync == "tensor":
        raise ConfigError("rollout.weight_sync: 'tensor' needs the server on the trainer's node; with separate "
                          "rollout nodes use 'distributed' (GPUs) or 'disk' (a shared filesystem), or set "
                          "rollout.colocate to true")
    else:
        layout = split_nodes(job_nodes(), args.rollout_nodes or 1)
    job_dir = Path(cfg.train.output_dir).resolve() / "slurm" / f"job-{os.environ.get('SLURM_JOB_ID', 'local')}"
    job_dir.mkdir(parents=True, exist_ok=True)
    config = str(Path(args.config).resolve())
    ensure_server_key()  # one for the job: its servers require it, its trainers send it (their environment)
    env = dict(os.environ)
    py = sys.executable
    steps: list[Step] = []
    try:
        per_node = args.servers_per_node or servers_per_node(env, cfg.rollout)
        slots = [(node, k * cfg.rollout.server_tensor_parallel) for node in layout.rollout for k in range(per_node)]
        url_files = [job_dir / f"sglang-{i}.url" for i in range(len(slots))]
        for i, (node, base_gpu) in enumerate(slots):
            url_files[i].unlink(missing_ok=True)
            steps.append(srun(f"sglang-{i}", [node], 1,
                              [py, "-m", "megatron_dapo.slurm.serve", "--advertise", node.address,
                               "--base-gpu-id", str(base_gpu), "--log", str(job_dir / f"sglang-{i}.log"),
                               config, str(url_files[i]), *args.overrides], env))
        servers = list(steps)
        urls = wait_for_servers(servers, url_files, cfg.rollout.server_startup_timeout_s)
        print(f"launch: SGLang servers healthy: {' '.join(urls)}", flush=True)
        train_env = {**env, "MASTER_ADDR": layout.master.address, "MASTER_PORT": str(free_port())}
        nodes = [node.name for node, _ in slots]
        placed = [f"rollout.server_nodes={json.dumps(nodes)}"] if cfg.rollout.colocate else []
        train = srun("train", layout.train, args.train_tasks_per_node,
                     [py, "-m", "megatron_dapo.cli", "train", config, *args.overrides,
                      "rollout.engine=sglang", f"rollout.server_urls={json.dumps(urls)}", *placed], train_env)
        steps.append(train)
        watch(train, servers)
        print("launch: training finished", flush=True)
    finally:
        for step in reversed(steps):
            stop(step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # scancel / preemption: unwind through run()'s finally so every step is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run(args)
    except (ConfigError, AllocationError, StepFailed) as e:
        print(f"launch: FAILED: {e}; stopped every step of this job", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
