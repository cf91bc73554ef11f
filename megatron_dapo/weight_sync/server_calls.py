"""The SGLang admin endpoints the weight-sync routes call, on one server or on all of them at once."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch.distributed as dist

from megatron_dapo.errors import DapoError
from megatron_dapo.rollout.server_key import auth_headers
from megatron_dapo.rollout.sglang_server import post_json
from megatron_dapo.weight_sync.buckets import Bucket
from megatron_dapo.weight_sync.metrics import SyncMetrics

log = logging.getLogger(__name__)


class WeightUpdateError(DapoError, RuntimeError):
    """A server refused or failed a weight-update call; the message names the server and its reason."""


class ServerUnreachable(WeightUpdateError):
    """The server did not answer at all: it is down (or its machine unreachable)."""


def call(url: str, endpoint: str, payload: dict, timeout_s: float) -> dict:
    """POST `payload` to `url + endpoint`; raises WeightUpdateError unless the reply says success."""
    target = f"{url.rstrip('/')}{endpoint}"
    try:
        reply = post_json(target, payload, timeout_s)
    except urllib.error.HTTPError as e:  # SGLang answers a refused update with 400 and a message
        raise WeightUpdateError(f"{target}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise ServerUnreachable(f"{target}: server unreachable: {e}") from None
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightUpdateError(f"{target}: {reply.get('message', reply)}")
    return reply


def call_each(pool: ThreadPoolExecutor, urls: list[str], endpoint: str, payload: Callable[[int], dict],
              timeout_s: float) -> list[Future]:
    """Start `endpoint` on every server (server i gets `payload(i)`); the futures raise WeightUpdateError."""
    return [pool.submit(call, url, endpoint, payload(i), timeout_s) for i, url in enumerate(urls)]


def call_all(urls: list[str], endpoint: str, payload: dict | Callable[[int], dict], timeout_s: float) -> None:
    """`endpoint` on every server at once (server i gets `payload` or `payload(i)`); raises the first
    failure after all have answered."""
    if not urls:
        return
    make = payload if callable(payload) else (lambda _: payload)
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        futures = call_each(pool, urls, endpoint, make, timeout_s)
    for f in futures:
        f.result()


def call_up(urls: list[str], endpoint: str, payload: dict, timeout_s: float) -> list[str]:
    """`endpoint` on every server at once; the servers that answered. One that does not answer is down: logged
    and left out (the rollout engine restarts a dead server on its next failed call, and the trainer resyncs
    it then); any other failure is raised, the first, after all have answered."""
    with ThreadPoolExecutor(max_workers=max(len(urls), 1)) as pool:
        futures = call_each(pool, urls, endpoint, lambda _: payload, timeout_s)
    up = []
    for url, f in zip(urls, futures):
        try:
            f.result()
            up.append(url)
        except ServerUnreachable as e:
            log.warning("weight push: %s; down, left out", e)
    return up


def servers_idle(urls: list[str], timeout_s: float) -> list[str]:
    """Before an update between batches: wait until each server has finished or dropped every request, then flush
    its cache. An aborted group's requests can stay on a server for a moment after the abort was answered, and an
    update meanwhile loads the weights but flushes nothing (SGLang answers 400, "the cache was not flushed because
    requests are still running"). SGLang's deferred /flush_cache waits for the server to be idle; one still busy
    after the wait is an error. The servers that answered (one down is left out, as in call_up)."""
    wait = max(timeout_s - 30.0, timeout_s / 2)  # the server gives up before this call does
    return call_up(urls, f"/flush_cache?timeout={wait:g}", {}, timeout_s)


@contextmanager
def generation_paused(urls: list[str], timeout_s: float) -> Iterator[list[str]]:
    """Pause the servers' generation for a weight update pushed while they sample, then let it go on. The
    running requests are retracted (SGLang's pause mode "retract"): they keep their tokens and log-probs, the
    update flushes the cache (no KV of the old weights stays), and on continuing each recomputes its prompt and
    tokens so far under the new weights and samples the rest with them, which the server records per response
    (its weight-version spans: the partial rollouts of rollout.mode async). Yields the servers paused: one that
    does not answer is down, left out of the update; one that dies during the update is not asked to go on (a
    restarted server is not paused)."""
    paused = call_up(urls, "/pause_generation", {"mode": "retract"}, timeout_s)
    try:
        yield paused
    finally:
        call_up(paused, "/continue_generation", {}, timeout_s)


def server_info(url: str, timeout_s: float = 30.0) -> dict:
    """The server's `/server_info`: its launch settings (`tp_size`) and `startup_time` among them."""
    target = f"{url.rstrip('/')}/server_info"
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers=auth_headers()), timeout=timeout_s) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as e:
        raise WeightUpdateError(f"{target}: cannot read the server's info: {e}") from None
    for key in ("tp_size", "startup_time"):
        if key not in info:
            raise WeightUpdateError(f"{target}: the reply has no {key!r}; is this an SGLang server?")
    return info


def push_buckets(urls: list[str], buckets: Iterable[Bucket], push: Callable[[Bucket], None],
                 timeout_s: float) -> SyncMetrics | None:
    """Collective over the trainer's ranks: every rank walks `buckets`; a rank given the `urls` of the
    servers it feeds (an empty list elsewhere) `push`es each bucket between their /begin_weight_update and
    /end_weight_update. The metrics where there were servers to push to, None elsewhere.
    A failed call ends the pushing, not the walk: the other ranks' gathers need this one, so it walks on
    without pushing, ends the update on the servers, meets them at the barrier, and then raises the first
    failure (a failure to end the update after it is logged: it must not hide the cause)."""
    start = time.perf_counter()
    nbytes = 0
    failure: WeightUpdateError | None = None
    try:
        call_all(urls, "/begin_weight_update", {}, timeout_s)
    except WeightUpdateError as e:
        failure = e
    for bucket in buckets:
        if failure is None:
            try:
                push(bucket)
                nbytes += bucket.nbytes
            except WeightUpdateError as e:
                failure = e
    try:
        call_all(urls, "/end_weight_update", {}, timeout_s)
    except WeightUpdateError as e:
        if failure is None:
            failure = e
        else:
            log.warning("weight push: ending the update after the failure (%s): %s", failure, e)
    dist.barrier()
    if failure is not None:
        raise failure
    return SyncMetrics(nbytes, time.perf_counter() - start) if urls else None
