"""One rank of a 2-rank gloo job with heartbeats (timeout 2 s): `python heartbeat_worker.py SCENARIO [RANK]`.

stop R: rank R stops itself (SIGSTOP) after the first barrier; the other waits in the second barrier.
finish: both end normally, rank 1 first (rank 0 outlives its last beat by three timeouts).
fail R: rank R fails (an error, as in a trainer's setup) and stays alive afterwards, as a process whose exit hangs
        would; the other waits in the second barrier.
fail_slowly R: rank R fails, takes 1.5 s to stop what it started (the other ranks told at once), then prints its
        error with the time and stays alive, as a process whose exit takes a while (its exit would break the
        other's barrier at once, so this is the only way to see the other end on its own); the other waits in
        the second barrier.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_dapo.parallel.rank_heartbeat import RankHeartbeat

scenario = sys.argv[1]
rank, world, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=900))
heartbeat = RankHeartbeat(rank, world, "node-a", "127.0.0.1", port, 2.0)
heartbeat.set_doing(f"scenario {scenario}")
dist.barrier()
if scenario == "finish":
    if rank == 0:
        time.sleep(6.0)
    heartbeat.close()
    print(f"rank {rank} done", flush=True)
    sys.exit(0)
if scenario == "fail" and rank == int(sys.argv[2]):
    try:
        with heartbeat:
            raise FileNotFoundError("train.jsonl: no such file")
    except FileNotFoundError:
        print(f"rank {rank} failed", flush=True)
    time.sleep(600)
if scenario == "fail_slowly" and rank == int(sys.argv[2]):
    error = FileNotFoundError("train.jsonl: no such file")
    heartbeat.failing(error)
    time.sleep(1.5)
    heartbeat.close(error)
    print(f"rank {rank}: its own error at {time.time()!r}", flush=True)
    time.sleep(600)
if scenario == "stop" and rank == int(sys.argv[2]):
    time.sleep(1.0)  # beats that say what it does
    os.kill(os.getpid(), signal.SIGSTOP)
dist.barrier()  # waits on the stopped rank: only the heartbeat can end this
