"""The Engine interface over one or more SGLang servers' HTTP API, surviving a server that dies mid-rollout.

A group (the n samples of one prompt) is one /generate call carrying n copies of the prompt under one
request id of ours, which SGLang extends to `<id>_<j>` for sample j: its own n > 1 path gives the samples
random ids, and an abort must name them (sglang-router passes only a single id through). A call
comes back whole or fails whole, and only whole groups are handed out, each once: a group whose call
failed is sent again, under new ids, and never returned twice. A group the consumer cancels
(`abort([index])`) is aborted on its server if in flight, never sent (again), never handed out.

HTTP goes through one asyncio event loop (a thread of the engine's) and one aiohttp session with
keep-alive connections: a group in flight is a coroutine, not a thread, and the consumer's thread only
reads finished groups from a queue. At the paper's scale (hundreds of groups in flight, a 20K-token JSON
answer each) a thread per group contends with the trainer for the interpreter.

When a call fails the engine asks whether its server is still there (its process, then /health). If it
is, the failure was transient: wait (exponential backoff) and try again. If not, the server is restarted
(an `SGLangServer` the engine was given) or waited for (a bare URL), `on_server_restart(url)` puts the
trainer's latest weights back into it, and the failed groups go again. Both are bounded: a group is
tried `max_attempts` times, a server restarted `max_server_restarts` times in a row. Recovery blocks (a
restart takes minutes), so it runs on worker threads, off the event loop.

A server can also stop without dying (stopped, swapped out, its machine hung): its calls would wait out the
request timeout, which must outlast the longest response. So while a server has calls in flight the engine
asks its /health every few seconds; one that has not answered within `health_timeout_s` is stuck: its calls
fail at once and it is treated as dead (restarted, or waited for).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from pathlib import Path

import aiohttp
import orjson

from megatron_dapo.errors import DapoError
from megatron_dapo.rollout.engine import Sample, SamplingParams, sample_seed
from megatron_dapo.rollout.router import SGLangRouter
from megatron_dapo.rollout.routes import RouteLayout
from megatron_dapo.rollout.server_key import auth_headers
from megatron_dapo.rollout.sglang_server import ServerError, SGLangServer, SGLangServerConfig, health_ok, wait_until

log = logging.getLogger(__name__)

ROUTER_MIN_SERVERS = 4  # `launch` puts this many servers or more behind sglang-router
ABORT_TIMEOUT_S = 5.0
_WAKE = object()  # put on a stream's queue so its consumer looks again at what is left


class RolloutError(DapoError, RuntimeError):
    """A group could not be sampled (the server refused it, or every try failed)."""


class ServerStuck(RuntimeError):
    """The call's server stopped answering /health (the engine's watchdog): it counts as dead."""


class HTTPStatusError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, code: int, body: str):
        super().__init__(f"HTTP {code}: {body}")
        self.code, self.body = code, body


# What a failed call raises short of an error status: refused, reset, cut short, timed out, its server stuck.
TRANSIENT = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ServerStuck)


class _Server:
    """One SGLang server as the engine sees it. `generation` counts its restarts: a failure seen in an
    older generation has been dealt with already."""

    def __init__(self, url: str, process: SGLangServer | None):
        self.url = url.rstrip("/")
        self.process = process
        self.lock = threading.Lock()  # held (by a recovery thread) while it is being restarted / waited for
        self.generation = 0
        self.in_flight = 0  # calls sent to it and not yet answered (the event loop's count)
        self.restarts_in_a_row = 0
        self.stuck_generation = -1  # the generation the watchdog found stuck
        self._stuck: asyncio.Future | None = None  # event loop: done once this generation is found stuck
        self._stuck_for = -1

    def stuck(self) -> asyncio.Future:
        """Event loop: a future done once the watchdog finds the current generation stuck."""
        if self._stuck_for != self.generation:
            self._stuck, self._stuck_for = asyncio.get_running_loop().create_future(), self.generation
        return self._stuck


class SGLangEngine:
    """Samples groups from SGLang servers. `servers`: URLs of running servers (re-attached when they come
    back after a failure) and / or `SGLangServer`s (restarted when they die); groups go to the least busy.
    With `router` (sglang-router in front of all of them) /generate goes through it instead, and the engine
    aborts, restarts and waits for the router to take a restarted server back."""

    def __init__(self, servers: str | SGLangServer | Sequence[str | SGLangServer], *, max_in_flight: int = 32,
                 request_timeout_s: float = 600.0, max_attempts: int = 4, retry_backoff_s: float = 1.0,
                 max_server_restarts: int = 3, reattach_timeout_s: float = 600.0, health_timeout_s: float = 60.0,
                 on_server_restart: Callable[[str], None] | None = None, router: SGLangRouter | None = None,
                 routes: RouteLayout | None = None):
        """`routes`: a mixture of experts' layout, to ask the servers for each response's routes (routing replay;
        the servers need --enable-return-routed-experts)."""
        if isinstance(servers, (str, SGLangServer)):
            servers = [servers]
        if not servers:
            raise ValueError("SGLangEngine(servers=[]): give at least one server URL or SGLangServer")
        self.servers = []
        for s in servers:
            if isinstance(s, SGLangServer):
                self.servers.append(_Server(s.url, s))
            elif isinstance(s, str) and s.startswith(("http://", "https://")):
                self.servers.append(_Server(s, None))
            else:
                raise ValueError(f"SGLangEngine(servers=...): {s!r} is neither an SGLangServer nor an http:// URL")
        for name, value, low in [("max_in_flight", max_in_flight, 1), ("max_attempts", max_attempts, 1),
                                 ("max_server_restarts", max_server_restarts, 0)]:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"SGLangEngine({name}={value!r}): must be a whole number >= {low}")
        for name, value in [("request_timeout_s", request_timeout_s), ("retry_backoff_s", retry_backoff_s),
                            ("reattach_timeout_s", reattach_timeout_s), ("health_timeout_s", health_timeout_s)]:
            if not value > 0:
                raise ValueError(f"SGLangEngine({name}={value!r}): must be > 0")
        self.router = router
        self.routes = routes
        self.max_in_flight = max_in_flight
        self.timeout = request_timeout_s
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.max_server_restarts = max_server_restarts
        self.reattach_timeout_s = reattach_timeout_s
        self.health_timeout_s = health_timeout_s
        self.on_server_restart = on_server_restart
        self.restarts = 0  # servers restarted or re-attached over the engine's life
        self._router_lock = threading.Lock()
        self._launched: list = []  # processes `launch` started, stopped by `close`
        self._starting = False  # `launch(wait=False)` started them: wait_launched() has not seen them healthy
        # The event loop, its thread and what lives on it, made on first use.
        self._loop_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None  # max_in_flight calls at once, over all streams
        self._watcher: asyncio.Task | None = None  # event loop: the stuck-server watchdog (_watch)

    @classmethod
    def launch(cls, configs: Sequence[SGLangServerConfig], log_dir, *, use_router: bool | None = None,
               wait: bool = True, **engine_kwargs) -> SGLangEngine:
        """Start one server per config (all at once; on GPUs server i starts tensor_parallel * i GPUs past
        its config's base_gpu_id, so they do not share GPUs) and, when asked or when there are
        `ROUTER_MIN_SERVERS` or more, sglang-router in front of them; `close` stops them all. With `wait=False`
        it returns as soon as the servers' processes are started, so that the caller sets up beside their
        start-up (minutes on GPUs), and `wait_launched()` must end before the engine's first use."""
        log_dir = Path(log_dir)
        configs = [dataclasses.replace(c, base_gpu_id=c.base_gpu_id + i * c.tensor_parallel)
                   for i, c in enumerate(configs)]
        procs = [SGLangServer(c, log_dir / f"sglang_{i}.log") for i, c in enumerate(configs)]
        router = None
        if use_router if use_router is not None else len(procs) >= ROUTER_MIN_SERVERS:
            router = SGLangRouter([p.url for p in procs], log_dir / "router.log", host=procs[0].host)
        engine = cls(procs, router=router, **engine_kwargs)
        try:
            for p in procs:
                engine._launched.append(p.start())
        except BaseException:
            engine.close()
            raise
        engine._starting = True
        if wait:
            engine.wait_launched()
        return engine

    def wait_launched(self) -> None:
        """Until the servers `launch` started are healthy, then the router (started now: it registers them
        once they answer); on a failure all of them are stopped. Nothing to wait for otherwise."""
        if not self._starting:
            return
        try:
            for s in self.servers:
                s.process.wait_healthy()
            if self.router is not None:
                self._launched.append(self.router.start())
                self.router.wait_healthy()
        except BaseException:
            self.close()
            raise
        self._starting = False

    def close(self) -> None:
        """Close the HTTP session and stop the processes `launch` started (servers given by the caller are
        theirs to stop)."""
        with self._loop_lock:
            loop, session, self._loop, self._session, self._slots = self._loop, self._session, None, None, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._quit(session), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
        for p in reversed(self._launched):
            p.stop()
        self._launched = []

    def _submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the engine's event loop (started on first use)."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                # Recoveries block on restarts and backoffs: enough threads that one waiting for its server to
                # come back never holds up another group's.
                self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_in_flight, thread_name_prefix="sglang-recover"))
                threading.Thread(target=self._loop.run_forever, name="sglang-engine", daemon=True).start()
                self._loop.call_soon_threadsafe(self._start_watch)
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _http(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """Event loop: the keep-alive session and the in-flight slots, made on first use."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),  # the slots bound it
                                                  headers=auth_headers())
            self._slots = asyncio.Semaphore(self.max_in_flight)
        return self._session, self._slots

    async def _post(self, url: str, payload: dict, timeout: float) -> dict | list | None:
        """Event loop: POST `payload` as JSON on the keep-alive session; the JSON answer, None when empty."""
        async with self._http()[0].post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
        if resp.status >= 400:
            raise HTTPStatusError(resp.status, body.decode(errors="replace")[:1000])
        # orjson: a long response's answer is a few hundred kB of per-token log-probs; 1.7x the stdlib's speed.
        return orjson.loads(body) if body.strip() else None

    async def _quit(self, session: aiohttp.ClientSession | None) -> None:
        """Event loop, at close: end the watchdog and the session."""
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        if session is not None:
            await session.close()

    def _start_watch(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Event loop, for the engine's life: every few seconds, ask /health of each server with calls in flight
        (and not being restarted); one that does not answer within health_timeout_s is stuck."""
        interval = min(max(self.health_timeout_s / 4, 0.5), 15.0)
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._probe(s) for s in self.servers if s.in_flight and not s.lock.locked()))

    async def _probe(self, server: _Server) -> None:
        generation = server.generation
        try:
            async with self._http()[0].get(f"{server.url}/health",
                                           timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                if resp.status == 200:
                    return
                reason = f"/health answered {resp.status}"
        except TRANSIENT as e:
            reason = f"/health did not answer within health_timeout_s={self.health_timeout_s:g} s ({e!r})"
        if server.generation == generation and not server.lock.locked() and server.in_flight:
            log.warning("SGLang server %s is stuck: %s; its %d call(s) in flight fail now", server.url, reason,
                        server.in_flight)
            server.stuck_generation = generation
            if not server.stuck().done():
                server.stuck().set_result(reason)

    async def _call_on(self, server: _Server, call: Coroutine):
        """Event loop: the call's answer; ServerStuck as soon as the watchdog finds its server stuck."""
        task, stuck = asyncio.ensure_future(call), server.stuck()
        try:
            await asyncio.wait({task, stuck}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise ServerStuck(f"SGLang server {server.url}: {stuck.result()}")

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def healthy(self) -> bool:
        return (self.router is None or self.router.healthy()) and all(health_ok(s.url) for s in self.servers)

    def stream(self, prompts: list[list[int]], n: int, params: SamplingParams) -> SGLangGroupStream:
        _check_request(prompts, n, params)
        return SGLangGroupStream(self, prompts, n, params)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        groups: list[list[Sample] | None] = [None] * len(prompts)
        for group in self.stream(prompts, n, params):
            groups[group[0].prompt_index] = group
        return groups

    # --- one group on one server ---------------------------------------------------------------------

    def _pick(self) -> _Server | None:
        """Event loop: the least busy server not being restarted, or None when all are."""
        ready = [s for s in self.servers if not s.lock.locked()]
        if not ready:
            return None
        server = min(ready, key=lambda s: s.in_flight)
        server.in_flight += 1
        return server

    async def _post_group(self, server: _Server, index: int, prompt: list[int], n: int, params: SamplingParams,
                          rid: str) -> list | dict:
        sampling = {"temperature": params.temperature, "top_p": params.top_p,
                    "max_new_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos}
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.stop:  # the response's ids keep the tokens that complete the text (its text trims it)
            sampling["stop"] = list(params.stop)
        if params.seed is not None:  # one seed per sample (a shared one would make the n samples identical)
            sampling = [dict(sampling, sampling_seed=sample_seed(params.seed, index, j)) for j in range(n)]
        payload = {"input_ids": [prompt] * n, "sampling_params": sampling, "rid": rid, "return_logprob": True}
        if self.routes is not None:  # every position's experts, the prompt's included (routing replay)
            payload.update(return_routed_experts=True, routed_experts_start_len=0)
        return await self._post(f"{(self.router or server).url}/generate", payload, self.timeout)

    async def _abort(self, in_flight: list[tuple[_Server, list[str]]]) -> None:
        """Event loop: abort these calls on their servers, all at once (best effort). Through a router a call
        may be on any server; an id a server does not hold is ignored there."""
        calls = [(t.url, rid) for server, rids in in_flight for t in (self.servers if self.router else [server])
                 for rid in rids]
        await asyncio.gather(*(self._abort_one(url, rid) for url, rid in calls))

    async def _abort_one(self, url: str, rid: str) -> None:
        try:
            await self._post(f"{url}/abort_request", {"rid": rid}, ABORT_TIMEOUT_S)
        except (*TRANSIENT, HTTPStatusError):
            pass  # a server that is gone has nothing left to abort

    def _server_alive(self, server: _Server) -> bool:
        if server.stuck_generation == server.generation:
            return False
        if server.process is not None and not server.process.alive():
            return False
        return health_ok(server.url, timeout=self.health_timeout_s)

    def _heal(self, failed: list[_Server], generations: list[int]) -> bool:
        """After a failed call: restart / re-attach each of `failed` that is gone (unless another thread has
        already, in a later generation). True if one was; False if all are up (a transient failure)."""
        healed = False
        for server, generation in zip(failed, generations):
            with server.lock:
                if server.generation != generation:
                    healed = True
                    continue
                if self._server_alive(server):
                    continue
                self._bring_back(server)
                healed = True
        return healed

    def _heal_router(self) -> None:
        """Restart the router if it has exited."""
        if self.router is not None:
            with self._router_lock:
                if not self.router.alive():
                    self.router.restart()

    def _wait_router_ready(self) -> None:
        """After a server came back: the router routes to it again once its health checks pass."""
        if self.router is not None and not wait_until(self.router.healthy, self.reattach_timeout_s):
            raise ServerError(f"sglang-router {self.router.url} did not take the restarted server back within "
                              f"reattach_timeout_s={self.reattach_timeout_s:.0f} s; log {self.router.log_path}:\n"
                              f"{self.router.log_tail()}")

    def _bring_back(self, server: _Server) -> None:
        server.restarts_in_a_row += 1
        if server.restarts_in_a_row > self.max_server_restarts:
            tail = f"; log {server.process.log_path}:\n{server.process.log_tail()}" if server.process else ""
            raise ServerError(f"SGLang server {server.url} is down again after {self.max_server_restarts} restarts "
                              f"in a row with no group completed in between (max_server_restarts="
                              f"{self.max_server_restarts}); giving up{tail}")
        log.warning("SGLang server %s is gone: %s it (restart %d in a row)", server.url,
                    "restarting" if server.process is not None else "waiting for", server.restarts_in_a_row)
        if server.process is not None:
            server.process.restart()
        elif not wait_until(lambda: health_ok(server.url), self.reattach_timeout_s):
            raise ServerError(f"SGLang server {server.url} stopped answering and was not back within "
                              f"reattach_timeout_s={self.reattach_timeout_s:.0f} s; restart it, or give the engine "
                              f"an SGLangServer so it can restart it itself")
        if self.on_server_restart is not None:
            self.on_server_restart(server.url)
        server.generation += 1
        self.restarts += 1


class SGLangGroupStream:
    """Groups of one `SGLangEngine.stream` call, handed out as they complete. Each group is a coroutine on
    the engine's event loop (no more than the engine's `max_in_flight` calls at once, over all streams,
    sent in prompt order); the consumer's thread reads finished groups from a queue."""

    def __init__(self, engine: SGLangEngine, prompts: list[list[int]], n: int, params: SamplingParams):
        self.engine, self.prompts, self.n, self.params = engine, prompts, n, params
        self.id = f"dapo-{uuid.uuid4().hex}"
        self.resubmitted = 0  # group calls sent again after a failure
        self._lock = threading.Lock()  # the sets below, shared by the event loop and the consumer
        self._in_flight: dict[int, tuple[_Server, list[str]]] = {}
        self._done: queue.Queue = queue.Queue()
        self._remaining = set(range(len(prompts)))  # neither handed out nor cancelled
        self._cancelled: set[int] = set()
        self._aborted = False
        self._error: BaseException | None = None
        self.finished = engine._submit(self._run())  # done once no group of the stream is in flight any more

    def __iter__(self) -> Iterator[list[Sample]]:
        while self._remaining:
            group = None if self._aborted else self._done.get()
            if group is None:  # aborted: by the consumer, or by a group that could not be sampled
                if self._error is not None:
                    raise self._error
                return
            if group is _WAKE:
                continue
            with self._lock:
                index = group[0].prompt_index
                if index not in self._remaining:  # cancelled after it completed
                    continue
                self._remaining.discard(index)
            yield group

    def __enter__(self) -> SGLangGroupStream:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def abort(self, indices: Iterable[int] | None = None) -> None:
        if indices is None:
            self.engine._submit(self._abort_all()).result()
            return
        with self._lock:
            if self._aborted:
                return
            new = {int(i) for i in indices} & self._remaining
            if not new:
                return
            self._cancelled |= new
            self._remaining -= new
            in_flight = [self._in_flight[i] for i in new if i in self._in_flight]
        # The queued ones are never sent; the ones in flight are aborted on their servers (their coroutines then
        # drop them, without a retry); the completed ones are never handed out.
        if in_flight:
            self.engine._submit(self.engine._abort(in_flight)).result()
        self._done.put(_WAKE)

    async def _abort_all(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            in_flight = list(self._in_flight.values())
        if in_flight:
            await self.engine._abort(in_flight)
        self._done.put(None)

    async def _run(self) -> None:
        await asyncio.gather(*(self._group(i) for i in range(len(self.prompts))))

    async def _group(self, index: int) -> None:
        try:
            group = await self._sample(index)
        except Exception as e:  # noqa: BLE001 -- handed to the consumer, who raises it
            with self._lock:
                if not self._aborted and self._error is None:
                    self._error = e
            await self._abort_all()
            return
        if group is not None:
            self._done.put(group)

    def _dropped(self, index: int) -> bool:
        return self._aborted or index in self._cancelled

    async def _sample(self, index: int) -> list[Sample] | None:
        """One group, tried until it comes back whole; None if the stream was aborted, or the group
        cancelled, meanwhile."""
        engine = self.engine
        error: BaseException | None = None
        for attempt in range(engine.max_attempts):
            async with engine._http()[1]:
                server = await self._pick_server()
                if server is None:
                    return None
                generation = server.generation
                rid = f"{self.id}-p{index}-a{attempt}"
                rids = [f"{rid}_{j}" for j in range(self.n)]  # SGLang's names for the samples of a batch call
                try:
                    with self._lock:
                        if self._dropped(index):
                            return None
                        self._in_flight[index] = (server, rids)
                    out = await engine._call_on(server, engine._post_group(server, index, self.prompts[index], self.n,
                                                                           self.params, rid))
                    error = None
                except HTTPStatusError as e:
                    out, error = None, e
                    if e.code < 500 and e.code != 429 and not self._dropped(index):
                        raise RolloutError(f"SGLang refused the group of prompt {index} ({e.code}): {e.body}") from e
                except TRANSIENT as e:
                    out, error = None, e
                finally:
                    with self._lock:
                        self._in_flight.pop(index, None)
                    server.in_flight -= 1
            if self._dropped(index):
                return None
            if error is None:
                samples = parse_group(index, out, self.n, self.engine.routes, len(self.prompts[index]))
                if samples is not None:
                    server.restarts_in_a_row = 0
                    return samples
                error = RolloutError("the server aborted it")  # not at our request: e.g. it was paused
            await engine._abort([(server, rids)])  # a call that timed out may still be running there
            if attempt + 1 < engine.max_attempts:
                self.resubmitted += 1
                await asyncio.to_thread(self._recover, server, generation, attempt)
        raise RolloutError(f"the group of prompt {index} failed {engine.max_attempts} times (max_attempts); "
                           f"last error: {error!r}") from error

    def _recover(self, server: _Server, generation: int, attempt: int) -> None:
        """A worker thread, before trying a failed group again: bring back what died, else back off."""
        engine = self.engine
        engine._heal_router()
        # Through a router any server may have held the call: check them all.
        suspects = engine.servers if engine.router else [server]
        generations = [generation if s is server else s.generation for s in suspects]
        if engine._heal(suspects, generations):
            engine._wait_router_ready()
        else:
            time.sleep(min(engine.retry_backoff_s * 2 ** attempt, 30.0))

    async def _pick_server(self) -> _Server | None:
        """A server that is up (waiting while every one is being restarted); None once the group is dropped."""
        while not self._aborted:
            server = self.engine._pick()
            if server is not None:
                return server
            await asyncio.sleep(0.5)
        return None


def _check_request(prompts, n, params) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n: the group size must be a whole number >= 1, got {n!r}")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids, got {p!r:.80}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ValueError(f"prompts[{i}]: token ids must be ints >= 0, got {p!r:.80}")


def parse_group(index: int, out, n: int, routes: RouteLayout | None = None, prompt_len: int = 0
                ) -> list[Sample] | None:
    """The n samples of one call, or None if the server aborted any of them; with `routes`, each one's routes."""
    items = out if isinstance(out, list) else [out]
    if len(items) != n:
        raise RolloutError(f"SGLang returned {len(items)} samples for prompt {index}, asked for {n}")
    samples = []
    for item in items:
        meta = item["meta_info"]
        reason = meta["finish_reason"]["type"]
        if reason == "abort":
            return None
        ids = list(item["output_ids"])
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        if len(logprobs) != len(ids):
            raise RolloutError(f"SGLang returned {len(logprobs)} log-probs for {len(ids)} tokens (prompt {index})")
        # SGLang's weight_version is the newest; with weights pushed mid-response its spans say which made what.
        spans = tuple((str(r["version"]), int(r["start"]), int(r["end"])) for r in meta.get("weight_versions") or ())
        version = spans[0][0] if spans else str(meta.get("weight_version", ""))
        routed = None if routes is None else routes.from_sglang(meta, prompt_len + len(ids) - 1, f"prompt {index}")
        samples.append(Sample(index, ids, logprobs, reason, version, spans, routed))
    return samples
