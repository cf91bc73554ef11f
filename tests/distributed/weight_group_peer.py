"""A server's side of a gloo weight-update group, without the server: joins as SGLang does (a prefixed store,
torch's group constructor), takes part in BROADCASTS broadcasts from rank 0, then in as many more as come
(gloo's broadcast may or may not deliver the one that fails on the victim to this rank: its sends are concurrent)
and writes how the one that never comes ended. Rank 1 (the victim) is killed by the test instead.

argv: ADDRESS PORT RANK WORLD_SIZE GROUP_NAME BROADCASTS OUT_JSON
"""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous


def main(address, port, rank, world_size, group_name, broadcasts, out_json):
    rank, world_size, timeout = int(rank), int(world_size), timedelta(seconds=30)
    store, _, _ = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    group, _ = _new_process_group_helper(world_size, rank, [], "gloo", PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    bucket = torch.zeros(4096)
    for _ in range(int(broadcasts)):
        dist.broadcast(bucket, group=group, group_src=0)
    if rank == 1:
        time.sleep(600)  # the victim: killed here
    received = 0
    while True:
        start = time.monotonic()
        try:
            dist.broadcast(bucket, group=group, group_src=0)
            received += 1
        except RuntimeError as e:
            ended = str(e)[:200]
            break
    with open(out_json, "w") as f:
        json.dump({"waited_s": time.monotonic() - start, "received_after_kill": received, "ended": ended}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
