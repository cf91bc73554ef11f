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

Then the rollout service's host seconds per step, before the batch is ready: for --service-groups groups of
the same lengths, SGLang's /generate answers (JSON with every token's log-prob) decoded and parsed, the
responses detokenised (a byte-level BPE tokenizer trained here), and each response, ending in an answer line,
judged by the reward pool (--reward-workers processes); scaled to --groups groups.

    python bench/bench_data_path.py [--groups 512] [--group 16] [--ranks 4] [--mean-len 5000]
                                    [--service-groups 16] [--reward-workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

import orjson
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.parallel.rank_shares import PackedShare, deal_by_tokens
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.samples import TrainItem


def response_lengths(g: torch.Generator, group: int, mean_len: int, max_len: int = 20480) -> list[int]:
    sigma = 0.8  # lognormal: mean = exp(mu + sigma^2 / 2)
    mu = torch.log(torch.tensor(float(mean_len))) - sigma**2 / 2
    return (mu + sigma * torch.randn(group, generator=g)).exp().clamp(16, max_len).long().tolist()


def make_batch(groups: int, group: int, mean_len: int, max_len: int = 20480) -> list[TrainItem]:
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(groups):
        prompt = torch.randint(0, 150_000, (int(torch.randint(100, 400, (1,), generator=g)),), generator=g).tolist()
        for n in response_lengths(g, group, mean_len, max_len):
            items.append(TrainItem(prompt, torch.randint(0, 150_000, (n,), generator=g).tolist(),
                                   (-torch.rand(n, generator=g, dtype=torch.float64)).tolist(),
                                   advantage=float(torch.randn(1, generator=g)), in_loss=True))
    return items


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from megatron_dapo.parallel.share_scatter import ShareScatter

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


def service_host_seconds(args) -> dict[str, float]:
    """Seconds per response of the rollout service's host work: (part -> seconds, "responses": count)."""
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.demo.tiny_model import train_tokenizer
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.reward.config import RewardConfig
    from megatron_dapo.rollout.sglang_engine import parse_group

    rows = generate_rows(4000, 0, digits=3, operations="+-*", num_operands=3, style="dapo", steps=True)
    tokenizer = train_tokenizer([r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows], 8000)
    answer = tokenizer.encode("\nAnswer: 42")
    g = torch.Generator().manual_seed(1)
    bodies = []  # what SGLang sends back for each group
    for _ in range(args.service_groups):
        items = []
        for n in response_lengths(g, args.group, args.mean_len):
            ids = torch.randint(0, len(tokenizer) - 3, (n - len(answer),), generator=g).tolist() + answer
            logprobs = (-torch.rand(n, generator=g, dtype=torch.float64)).tolist()
            items.append({"output_ids": ids, "meta_info": {
                "finish_reason": {"type": "stop"}, "weight_version": "7",
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}})
        bodies.append(json.dumps(items).encode())
    seconds = {}
    start = time.perf_counter()
    groups = [parse_group(i, orjson.loads(body), args.group) for i, body in enumerate(bodies)]
    seconds["JSON decode + parse"] = time.perf_counter() - start
    start = time.perf_counter()
    texts = [tokenizer.batch_decode([s.output_ids for s in group], skip_special_tokens=True) for group in groups]
    seconds["detokenise"] = time.perf_counter() - start
    with RewardPool(RewardConfig(num_workers=args.reward_workers, timeout_s=10.0)) as pool:
        pool.score(["Answer: 1"], ["1"])  # the workers are up
        start = time.perf_counter()
        for group_texts in texts:
            verdicts = pool.score(group_texts, ["42"] * len(group_texts))
            assert all(v.correct for v in verdicts)
        seconds[f"reward ({args.reward_workers} workers)"] = time.perf_counter() - start
    responses = args.service_groups * args.group
    return {**{k: v / responses for k, v in seconds.items()}, "responses": responses,
            "json_mb_per_response": sum(map(len, bodies)) / responses / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mean-len", type=int, default=5000)
    parser.add_argument("--service-groups", type=int, default=16)
    parser.add_argument("--reward-workers", type=int, default=2)
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

    host = service_host_seconds(args)
    per_step = args.groups * args.group
    print(f"\n== rollout service host seconds: {host['responses']} responses measured "
          f"({host['json_mb_per_response']:.2f} MB of JSON each), scaled to {per_step} per step ==")
    print(f"{'part':<24}{'ms / response':>15}{'s / step':>10}")
    parts = {k: v for k, v in host.items() if k not in ("responses", "json_mb_per_response")}
    for name, s in [*parts.items(), ("total", sum(parts.values()))]:
        print(f"{name:<24}{1e3 * s:>15.2f}{s * per_step:>10.1f}")


if __name__ == "__main__":
    main()
