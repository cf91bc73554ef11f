"""The disaggregated route: broadcast the weights from trainer rank 0 into the servers' own ranks.

Trainer global rank 0 and every tensor-parallel rank of every server form one weight-update process
group (gloo on the CPU, NCCL on GPUs), rendezvousing on a fresh TCP store of its own, so the trainer's
default group and megatron's groups are untouched. Per bucket, rank 0 first gathers the whole bucket
(that gather runs over the trainer's groups), then POSTs its names/dtypes/shapes to each server from a
thread while it broadcasts the bucket's bytes as one flat tensor (SGLang's `flattened_bucket` format).
Gathering first matters: a server that has entered the broadcast waits only on the weight group.

A server that fails in a bucket (killed: its call refused or cut off) ends the sync at once, not after the
timeouts: the first failure of a bucket's calls or broadcast counts, the group is dropped here at once (which
also ends the broadcast the other servers wait in), and the next sync forms it anew. The error names the
server, the bucket and what failed, and the other servers, left with part of the version until a sync
completes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.policy.hf_config import ModelSpec
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


def _failed(future: Future) -> BaseException | None:
    return future.exception() if future.done() else None


def _completion(work: dist.Work) -> Future:
    """A future that ends as the collective `work` does, with its error if it fails."""
    done: Future = Future()

    def settle(f) -> None:
        try:
            f.wait()
            done.set_result(None)
        except Exception as e:  # the collective's error, read by whoever waits on `done`
            # Its text in a fresh exception: this one's traceback holds `f`, and through it the collective and its
            # gloo context, whose sockets the servers left in the broadcast wait on until the group's timeout;
            # the failed push's error, which holds `done`, lives on in the caller.
            done.set_exception(RuntimeError(str(e)))

    work.get_future().add_done_callback(settle)
    return done


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
        self.broken = False  # dropped here after a failed push (or never formed): the next sync forms it anew
        if dist.get_rank() == 0:
            self._form_group(self.urls, [server_info(u) for u in self.urls])

    def _form_group(self, urls: list[str], infos: list[dict]) -> None:
        if not urls:  # every server is down: the group forms again once one is back
            self.members, self.started, self.broken = [], {}, False
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
        self.broken = False

    def _leave_group(self, urls: list[str]) -> None:
        """The servers `urls` (members still running the process that joined) drop the group, and so does
        rank 0 unless a failed push dropped it already. A server that cannot is logged, not raised: the new
        group, under a new name, does not need the old one gone."""
        self.broken = True  # until a group forms again
        if self.group_name and urls:
            try:
                call_all(urls, "/destroy_weights_update_group", {"group_name": self.group_name}, self.timeout_s)
            except WeightUpdateError as e:
                log.warning("weight sync: leaving the old weight-update group %s: %s", self.group_name, e)
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _drop_group(self, held: list) -> None:
        """After a failed push: rank 0 leaves the group now, without waiting. Its sockets closing ends the
        broadcast the other servers wait in (their update calls then fail, and they answer again); they close
        once the last reference to the group and to its collectives (`held`, handed over) is gone, and not
        before a send to a dead peer, which gloo cannot cancel, has waited out the group's timeout
        (rollout.weight_sync_timeout_s). So a thread of its own destroys the group and lets go of them; a
        daemon, not to hold up the process's exit. The servers drop their side when the next sync forms the
        group anew."""
        held.append(self.group)
        self.group, self.broken = None, True

        def release() -> None:
            try:
                dist.destroy_process_group(held[-1])
            finally:
                held.clear()

        threading.Thread(target=release, daemon=True).start()

    def _regroup(self, skip) -> None:
        """The group anew if its servers changed: one restarted, is skipped, or is back."""
        urls = [u for u in self.urls if u not in skip]
        infos = [server_info(u) for u in urls]
        kept = [u for u, i in zip(urls, infos) if self.started.get(u) == i["startup_time"]]  # same process, in it
        if self.broken or kept != urls or self.members != urls:
            log.warning("weight sync: forming the weight-update group anew: %d of its %d server(s) restarted or are "
                        "down%s; pushing to %d of %d", len(self.members) - len(kept), len(self.members),
                        ", and the last push failed" if self.broken else "", len(urls), len(self.urls))
            self._leave_group(kept)
            self._form_group(urls, infos)

    def _push(self, bucket, version: str, index: int) -> None:
        """Bucket `index` (from 1) of `version` to every member."""
        dtype = str(bucket.dtype).removeprefix("torch.")
        payload = {"names": bucket.names, "dtypes": [dtype] * len(bucket.names),
                   "shapes": [list(s) for s in bucket.shapes], "group_name": self.group_name,
                   "load_format": "flattened_bucket", "flush_cache": bucket.last,
                   "weight_version": version if bucket.last else None}
        pool = ThreadPoolExecutor(max_workers=len(self.members))
        try:
            posts = call_each(pool, self.members, "/update_weights_from_distributed", lambda _: payload, self.timeout_s)
            work = dist.broadcast(bucket.flat, group=self.group, group_src=0, async_op=True)
            sent = _completion(work)
            # The first failure ends the bucket: a server that refuses the call never joins the broadcast, one
            # killed in it leaves the others waiting there, and a send to it may wait out the group's timeout.
            wait([*posts, sent], return_when=FIRST_EXCEPTION)
        finally:
            pool.shutdown(wait=False)  # the calls left end with the group dropped below, or their timeout
        refused = {url: e for url, post in zip(self.members, posts) if (e := _failed(post)) is not None}
        if not refused and _failed(sent) is None:
            work.wait()  # done; on GPUs this orders the next bucket's refill of the buffer after the broadcast
            return
        held = [work]
        del work  # the raised error's traceback keeps this frame: only `held` may keep the broadcast
        self._drop_group(held)
        what = [str(e) for e in refused.values()]  # each names its server's URL and endpoint
        if _failed(sent) is not None:
            what.append(f"the broadcast to the weight-update group of {', '.join(self.members)}: {_failed(sent)}")
        others = [u for u in self.members if u not in refused]
        left = (f"; {', '.join(others)} got part of version {version} (its buckets before bucket {index}, perhaps "
                f"that one too) over the weights before: mixed until a sync completes" if others else "")
        raise WeightUpdateError(f"weight sync of version {version}: bucket {index} ({len(bucket.names)} tensors from "
                                f"{bucket.names[0]}): {'; '.join(what)}{left}; the next sync forms the weight-update "
                                "group anew")

    def sync(self, model: torch.nn.Module, version: str, skip: Sequence[str] = ()) -> SyncMetrics | None:
        if dist.get_rank() == 0:
            self._regroup(skip)
        buckets = iter_hf_buckets(model, self.spec, self.parallel, self.bucket_bytes)
        members = self.members if dist.get_rank() == 0 else []
        index = itertools.count(1)
        return push_buckets(members, buckets,
                            (lambda bucket: self._push(bucket, version, next(index))) if members else _no_push,
                            self.timeout_s)

    def close(self) -> None:
        """Leave the weight group on both sides."""
        self._leave_group(self.members)


def _no_push(bucket) -> None:
    """No server to push to (all down): the trainer's ranks still walk the buckets together."""
