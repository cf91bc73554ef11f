"""torchrun worker: the driver works alone for longer than the process group's timeout while the other rank
waits for it through DriverSignal; both then meet in collectives. argv: OUT_FILE (written by rank 1)."""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_dapo.parallel.runtime import DriverSignal

TIMEOUT_S, WORK_S = 2.0, 5.0
START_S = 120.0  # for the ranks to meet at all: on a loaded machine one may still be importing torch after 2 s


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=START_S))
    group = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))  # the collectives' timeout the driver outlasts
    signal = DriverSignal(poll_s=0.01)
    box = [None]
    if dist.get_rank() == 0:
        time.sleep(WORK_S)  # a rollout: longer than any collective may wait
        signal.post("resync")
        dist.barrier(group=group)  # the weight sync the message asks for
        time.sleep(WORK_S)
        signal.post("batch")
        box = [{"groups": 3}]
        dist.broadcast_object_list(box, src=0, group=group)
    else:
        start = time.monotonic()
        got = [signal.wait()]
        dist.barrier(group=group)
        got.append(signal.wait())
        dist.broadcast_object_list(box, src=0, group=group)
        with open(out, "w") as f:
            f.write(f"{got[0]} {got[1]} {box[0]['groups']} {time.monotonic() - start:.1f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
