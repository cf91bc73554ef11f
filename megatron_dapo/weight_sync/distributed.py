"""The disaggregated route: broadcast the weights from trainer rank 0 into the servers' own ranks.

Trainer global rank 0 and every tensor-parallel rank of every server form one weight-update process
group (gloo on the CPU, NCCL on GPUs), rendezvousing on a fresh TCP store of its own, so the trainer's
default group and megatron's groups are untouched. Per bucket, rank 0 first gathers the whole bucket
(that gather runs over the trainer's groups), then POSTs its names/dtypes/shapes to each server from a
thread while it broadcasts the bucket's bytes as one flat tensor (SGLang's `flattened_bucket` format).
Gathering first matters: a server that has entered the broadcast waits only on the weight group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.runtime import free_port
from megatron_dapo.weight_sync.buckets import iter_hf_buckets
from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.server_calls import WeightUpdateError, call_all, call_each, push_buckets, server_info

log = logging.getLogger(__name__)


def _join_as_rank0(backend: str, address: str, port: int, world_size: int, group_name: str,
                   timeout: timedelta) -> dist.ProcessGroup:
    """Rank 0 of the weight group, built the way SGLang builds its side (a prefixed store of the
    group's own, then torch's group constructor), so the stores' keys match."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, _, _ = next(rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, 0, [], backend, PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _settle(futures, what: str) -> None:
    """Wait for all futures; the first failure raises at once instead of waiting on the others."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            raise WeightUpdateError(f"{what}: {f.exception()}")
    for f in futures:
        f.result()


class DistributedSyncer:
    """Collective over the trainer's ranks; only global rank 0 joins the weight group and sends.

    `master_address` is where the servers reach trainer rank 0 (127.0.0.1 when they share its machine).
    A server that restarted since the group formed (its `startup_time` changed) left the group with its
    old process, and a server a sync is told to skip (down: `skip`) cannot take part: such a sync forms the
    group anew first, of the servers it pushes to.
    """

    def __init__(self, server_urls: list[str], spec: ModelSpec, parallel: ParallelConfig, bucket_bytes: int, *,
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0):
        self.urls, self.spec, self.parallel = list(server_urls), spec, parallel
        self.bucket_bytes, self.master_address, self.timeout_s = bucket_bytes, master_address, timeout_s
        self.group: dist.ProcessGroup | None = None
        self.group_name = ""
        self.members: list[str] = []  # the servers in the group
        self.started: dict[str, float] = {}  # each member's startup_time when the group formed
        if dist.get_rank() == 0:
            self._form_group(self.urls, [server_info(u) for u in self.urls])

    def _form_group(self, urls: list[str], infos: list[dict]) -> None:
        if not urls:  # every server is down: the group forms again once one is back
            self.members, self.started = [], {}
            return
        backend = "gloo" if self.parallel.device == "cpu" else "nccl"
        tp_sizes = [int(i["tp_size"]) for i in infos]
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        world_size = 1 + sum(tp_sizes)
        port = free_port(self.master_address)
        name = f"megatron_dapo_weights_{port}"
        pool = ThreadPoolExecutor(max_workers=len(urls) + 1)
        try:
            joins = call_each(pool, urls, "/init_weights_update_group",
                              lambda i: {"master_address": self.master_address, "master_port": port,
                                         "rank_offset": offsets[i], "world_size": world_size,
                                         "group_name": name, "backend": backend}, self.timeout_s)
            mine = pool.submit(_join_as_rank0, backend, self.master_address, port, world_size, name,
                               timedelta(seconds=self.timeout_s))
            _settle([*joins, mine], f"forming the weight-update group at {self.master_address}:{port}")
        finally:
            pool.shutdown(wait=False)  # a join left waiting after a failure ends with its timeout
        self.group, self.group_name = mine.result(), name
        self.members, self.started = list(urls), {u: i["startup_time"] for u, i in zip(urls, infos)}

    def _leave_group(self, urls: list[str]) -> None:
        if self.group is None:  # none formed: every server was down
            return
        call_all(urls, "/destroy_weights_update_group", {"group_name": self.group_name}, self.timeout_s)
        dist.destroy_process_group(self.group)
        self.group = None

    def _regroup(self, skip) -> None:
        """The group anew if its servers changed: one restarted, is skipped, or is back."""
        urls = [u for u in self.urls if u not in skip]
        infos = [server_info(u) for u in urls]
        kept = [u for u, i in zip(urls, infos) if self.started.get(u) == i["startup_time"]]  # same process, in it
        if kept != urls or self.members != urls:
            log.warning("weight sync: forming the weight-update group anew: %d of its %d server(s) restarted or are "
                        "down; pushing to %d of %d", len(self.members) - len(kept), len(self.members), len(urls),
                        len(self.urls))
            self._leave_group(kept)
            self._form_group(urls, infos)

    def _push(self, bucket, version: str) -> None:
        dtype = str(bucket.dtype).removeprefix("torch.")
        payload = {"names": bucket.names, "dtypes": [dtype] * len(bucket.names),
                   "shapes": [list(s) for s in bucket.shapes], "group_name": self.group_name,
                   "load_format": "flattened_bucket", "flush_cache": bucket.last,
                   "weight_version": version if bucket.last else None}
        with ThreadPoolExecutor(max_workers=len(self.members)) as pool:
            posts = call_each(pool, self.members, "/update_weights_from_distributed", lambda _: payload, self.timeout_s)
            sent = dist.broadcast(bucket.flat, group=self.group, group_src=0, async_op=True)
            # A server that refuses the call never joins the broadcast: its answer must not wait on it.
            _settle(posts, "update_weights_from_distributed")
            sent.wait()

    def sync(self, model: torch.nn.Module, version: str, skip: Sequence[str] = ()) -> SyncMetrics | None:
        if dist.get_rank() == 0:
            self._regroup(skip)
        buckets = iter_hf_buckets(model, self.spec, self.parallel, self.bucket_bytes)
        members = self.members if dist.get_rank() == 0 else []
        return push_buckets(members, buckets, (lambda bucket: self._push(bucket, version)) if members else _no_push,
                            self.timeout_s)

    def close(self) -> None:
        """Leave the weight group on both sides."""
        self._leave_group(self.members)


def _no_push(bucket) -> None:
    """No server to push to (all down): the trainer's ranks still walk the buckets together."""
