"""torchrun worker: the driver deals a batch of responses of very different lengths to 2 data-parallel replicas
of 2 ranks each (dp rank = global rank // 2, as TP=2 lays them out) and scatters the packed shares.
argv: OUT_DIR. Every rank writes OUT_DIR/rank{r}.json: what it received, as lists."""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_dapo.parallel import cpu_compat
from megatron_dapo.parallel.rank_shares import PackedShare, deal_by_tokens
from megatron_dapo.parallel.share_scatter import ShareScatter
from megatron_dapo.samples import TrainItem

DP, UPDATES = 2, 3


def batch() -> list[TrainItem]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(12):
        n = int(torch.randint(1, 200, (1,), generator=g))
        routes = (np.arange((n + 1) * 2 * 2) % 251).astype(np.uint8).reshape(n + 1, 2, 2)  # a MoE's, as engines give
        out.append(TrainItem([i, i + 1], list(range(n)), torch.randn(n, generator=g, dtype=torch.float64).tolist(),
                             advantage=i / 7, in_loss=i % 5 != 0, routes=routes))
    return out


def main(out_dir: str) -> None:
    cpu_compat.activate(faithful=True, local_rank=int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")  # the default group stands for NCCL in the device-faithful mode
    rank = dist.get_rank()
    scatter = ShareScatter(dp_rank=rank // 2)
    if rank == 0:
        share = scatter.send([PackedShare.pack(s) for s in deal_by_tokens(batch(), DP, UPDATES)])
    else:
        share = scatter.receive()
    record = {"seqs": [s.tolist() for s in share.sequences()], "prompt_lens": share.prompt_lens.tolist(),
              "rollout_logp": share.rollout_logp.tolist(), "advantages": share.advantages.tolist(),
              "in_loss": share.in_loss.tolist(), "update_sizes": share.update_sizes.tolist(),
              "routes": [r.tolist() for r in share.response_routes()],
              "dtypes": [str(t.dtype) for t in share.tensors()], "dp_rank_of": scatter.dp_rank_of,
              "faithful": cpu_compat.is_active()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
