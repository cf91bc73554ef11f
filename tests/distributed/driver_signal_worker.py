"""torchrun worker: the driver works alone for longer than the process group's timeout while the other rank
waits for it through DriverSignal; both then meet in collectives. argv: OUT_FILE (written by rank 1)."""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_dapo.parallel.runtime import DriverSignal

TIMEOUT_S, WORK_S = 2.0, 5.0


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    signal = DriverSignal(poll_s=0.01)
    box = [None]
    if dist.get_rank() == 0:
        time.sleep(WORK_S)  # a rollout: longer than any collective may wait
        signal.post("resync")
        dist.barrier()  # the weight sync the message asks for
        time.sleep(WORK_S)
        signal.post("batch")
        box = [{"groups": 3}]
        dist.broadcast_object_list(box, src=0)
    else:
        start = time.monotonic()
        got = [signal.wait()]
        dist.barrier()
        got.append(signal.wait())
        dist.broadcast_object_list(box, src=0)
        with open(out, "w") as f:
            f.write(f"{got[0]} {got[1]} {box[0]['groups']} {time.monotonic() - start:.1f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
