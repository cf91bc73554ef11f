"""torchrun worker (1 process): a server SIGKILLed in the middle of a distributed weight sync to two servers.

The fault hooks live here, in the test, not in the library. The syncs go in small buckets, and on bucket
KILL_AT the victim server's whole process group is killed, at one of two points:

- "broadcast": the victim has taken the bucket's /update_weights_from_distributed call and waits in the
  broadcast; it is killed, then the bucket is broadcast to it, dead;
- "call": the victim is killed just before the bucket's call, which it then refuses, while the survivor
  takes it and waits in a broadcast that cannot reach it all.

Each time the sync has to raise a WeightUpdateError soon after the kill, naming the victim, the bucket, and
the survivor as holding part of the version; the survivor has to answer at once (not left waiting in the
broadcast). The worker says so (FAILED-<point>) and waits while the test starts the victim again on its port
(RESTARTED-<point>, holding the new process group's id); then it changes the weights and syncs the next
version with the same syncer, which has to form the weight-update group anew, and checks both servers'
new samples against the policy.

argv: OUT_JSON MODEL_DIR VICTIM_URL SURVIVOR_URL FLAG_DIR VICTIM_PGID TIMEOUT_S
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from weight_sync_restart_worker import perturb, policy, wait_for
from weight_sync_worker import parity, sample, versions

from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import shutdown_runtime
from megatron_dapo.rollout.sglang_server import post_json
from megatron_dapo.weight_sync import distributed, make_weight_syncer
from megatron_dapo.weight_sync.server_calls import WeightUpdateError

KILL_AT = 3  # a bucket in the middle: the model makes more than a dozen at 0.05 MB
IN_FLIGHT_S = 1.0  # time for the servers to take the bucket's call and wait in the broadcast


class Killer:
    """Kill the victim's process group at `point` of bucket KILL_AT of the next sync, then stand down."""

    def __init__(self, syncer, pgid: int, point: str):
        self.syncer, self.pgid, self.point = syncer, pgid, point
        self.buckets, self.at = 0, None
        self.real_broadcast, self.real_call_each = dist.broadcast, distributed.call_each
        dist.broadcast, distributed.call_each = self.broadcast, self.call_each

    def kill(self) -> None:
        os.killpg(self.pgid, signal.SIGKILL)
        self.at = time.monotonic()

    def call_each(self, pool, urls, endpoint, payload, timeout_s):
        if endpoint == "/update_weights_from_distributed":
            self.buckets += 1
            if self.point == "call" and self.buckets == KILL_AT:
                self.kill()
                time.sleep(0.5)  # dead, its sockets closed
        return self.real_call_each(pool, urls, endpoint, payload, timeout_s)

    def broadcast(self, tensor, *args, group=None, **kwargs):
        if self.point == "broadcast" and group is self.syncer.group and self.buckets == KILL_AT:
            time.sleep(IN_FLIGHT_S)
            self.kill()
        return self.real_broadcast(tensor, *args, group=group, **kwargs)

    def stand_down(self) -> None:
        dist.broadcast, distributed.call_each = self.real_broadcast, self.real_call_each


def answers_within(url: str, timeout_s: float) -> float | None:
    """Seconds the server takes to generate a token (through its scheduler), None if not within `timeout_s`."""
    start = time.monotonic()
    try:
        post_json(f"{url}/generate", {"input_ids": [5, 17], "sampling_params": {"max_new_tokens": 1}}, timeout_s)
    except OSError:  # timed out
        return None
    return time.monotonic() - start


def main(out_json, model_dir, victim, survivor, flag_dir, pgid, timeout_s):
    parallel = ParallelConfig(device="cpu", seed=3)
    trainer, spec, hf_config, runtime = policy(model_dir, parallel)
    syncer = make_weight_syncer("distributed", [victim, survivor], spec, parallel, hf_config, bucket_mb=0.05,
                                timeout_s=float(timeout_s))
    flags = Path(flag_dir)
    result = {}
    for seed, point in enumerate(["broadcast", "call"], start=1):
        perturb(trainer.module, seed)
        killer = Killer(syncer, int(pgid), point)
        r = result[point] = {}
        start = time.monotonic()
        try:
            syncer.sync(trainer.module, str(2 * seed - 1))
            r["error"] = None
        except Exception as e:  # the test checks the type and the message
            r["error"] = {"type": type(e).__name__, "is_weight_update_error": isinstance(e, WeightUpdateError),
                          "message": str(e)}
        r["sync_s"] = time.monotonic() - start
        r["detect_s"] = time.monotonic() - killer.at if killer.at else None
        killer.stand_down()
        r["survivor_answers_s"] = answers_within(survivor, 30.0)
        if r["survivor_answers_s"] is None:  # left waiting in the broadcast: the rest would wait on it
            Path(out_json).write_text(json.dumps(result))
            sys.exit(f"the survivor {survivor} did not answer within 30 s after the failed sync: {r}")
        (flags / f"FAILED-{point}").touch()
        wait_for(flags / f"RESTARTED-{point}")
        pgid = (flags / f"RESTARTED-{point}").read_text()
        perturb(trainer.module, 10 + seed)
        version = str(2 * seed)
        start = time.monotonic()
        syncer.sync(trainer.module, version)
        r["recover_s"] = time.monotonic() - start
        r["version"] = version
        for name, url in [("victim", victim), ("survivor", survivor)]:
            after = sample(url)
            r[name] = {"after": parity(trainer, spec, runtime, after)[0], "versions_after": versions(after)}
    syncer.close()
    Path(out_json).write_text(json.dumps(result))
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
