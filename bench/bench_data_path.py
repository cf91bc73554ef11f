"""The paper-scale data path: from "batch ready on the driver" to "every rank holds its share".

A batch of --groups x --group responses (default 512 x 16, the paper's), output lengths drawn from a long-CoT
distribution (lognormal, mean about 5k tokens, capped at 20k), prompts of 100-400 tokens, engine log-probs per
token, is built on global rank 0 of --ranks trainer ranks (data-parallel, gloo on this machine). Two routes:
- broadcast (before issue 14): the whole list of responses pickled and broadcast to every rank
  (broadcast_object_list), each rank keeping every dp_size-th response;
- scatter: rank_shares.deal_by_tokens, PackedShare.pack, share_scatter.ShareScatter: each rank receives its own
  share as flat tensors.
Seconds are the driver's wall time from the batch being ready to a barrier after every rank holds its share;
bytes are what one non-driver rank receives.

    python bench/bench_data_path.py [--groups 512] [--group 16] [--ranks 4] [--mean-len 5000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.rank_shares import PackedShare, deal_by_tokens
from megatron_dapo.runtime import free_port
from megatron_dapo.samples import TrainItem


def make_batch(groups: int, group: int, mean_len: int, max_len: int = 20480) -> list[TrainItem]:
    g = torch.Generator().manual_seed(0)
    sigma = 0.8  # lognormal: mean = exp(mu + sigma^2 / 2)
    mu = torch.log(torch.tensor(float(mean_len))) - sigma**2 / 2
    items = []
    for _ in range(groups):
        prompt = torch.randint(0, 150_000, (int(torch.randint(100, 400, (1,), generator=g)),), generator=g).tolist()
        lens = (mu + sigma * torch.randn(group, generator=g)).exp().clamp(16, max_len).long().tolist()
        for n in lens:
            items.append(TrainItem(prompt, torch.randint(0, 150_000, (n,), generator=g).tolist(),
                                   (-torch.rand(n, generator=g, dtype=torch.float64)).tolist(),
                                   advantage=float(torch.randn(1, generator=g)), in_loss=True))
    return items


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from megatron_dapo.share_scatter import ShareScatter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scatter = ShareScatter(dp_rank=rank)
    items = make_batch(args.groups, args.group, args.mean_len) if rank == 0 else None
    result = {}
    for route in ("broadcast", "scatter"):
        dist.barrier()
        start = time.perf_counter()
        if route == "broadcast":
            box = [items]
            dist.broadcast_object_list(box, src=0)
            share = box[0][rank::world]
        else:
            if rank == 0:
                share = scatter.send([PackedShare.pack(s) for s in deal_by_tokens(items, world, 16)])
            else:
                share = scatter.receive()
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 1:  # what this rank received, measured after the clock stopped
            received = share.nbytes if route == "scatter" else len(pickle.dumps(box[0], pickle.HIGHEST_PROTOCOL))
        del share
        box = None
        if rank == 0:
            result[route] = {"seconds": seconds}
        if rank == 1:
            queue.put((route, received))
    if rank == 0:
        tokens = sum(len(it.prompt_ids) + len(it.output_ids) for it in items)
        queue.put(("batch", (len(items), tokens, result)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mean-len", type=int, default=5000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in range(3))
    for p in procs:
        p.join()
    n, tokens, seconds = got["batch"]
    print(f"== data path: {n} responses, {tokens / 1e6:.1f}M tokens, {args.ranks} data-parallel ranks (gloo) ==")
    print(f"{'route':<12}{'seconds':>10}{'GB per rank':>14}")
    for route in ("broadcast", "scatter"):
        print(f"{route:<12}{seconds[route]['seconds']:>10.2f}{got[route] / 1e9:>14.3f}")
    print(f"{'ratio':<12}{seconds['broadcast']['seconds'] / seconds['scatter']['seconds']:>9.1f}x"
          f"{got['scatter'] / got['broadcast']:>13.3f}x  (bytes: scatter / broadcast; 1/DP = {1 / args.ranks:.3f})")


if __name__ == "__main__":
    main()
