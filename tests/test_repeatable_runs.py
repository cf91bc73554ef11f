"""Issue 52: runs that repeat. The same config and seed give bitwise the same weights after N steps, in sync and in
one_step_off, sampling from two SGLang servers whose answers arrive in another order each run: the second sits
behind a proxy that holds each of its answers for a random time (the system's entropy, not a seeded generator), so
the least-busy pick sends other groups to each server, and groups complete in another order.

What makes it hold: each sample's seed is derived from the run's seed, the step and its place in the draw
(rollout/engine.py's sample_seed), servers in deterministic mode sample per (request, seed) whatever else they have
batched, dynamic sampling keeps the first mixed groups in draw order (not in completion order), and the trainer's
step is deterministic on the CPU."""

import asyncio
import json
import os
import random
import threading

import pytest
import torch
import yaml

from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.server_key import SERVER_KEY_ENV

pytestmark = pytest.mark.slow
STEPS = 2


class DelayingProxy:
    """An HTTP proxy in front of one server, in a thread of its own: every call forwarded as it came (path, body,
    headers), its answer held for a random 0 to 300 ms first."""

    def __init__(self, target: str):
        from aiohttp import web

        self.target, self.port = target.rstrip("/"), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._draw = random.SystemRandom()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    def _serve(self):
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            async with session.request(request.method, f"{self.target}{request.path_qs}", data=await request.read(),
                                       headers=headers) as answer:
                body, status, kind = await answer.read(), answer.status, answer.content_type
        if request.path == "/generate":
            await asyncio.sleep(self._draw.uniform(0.0, 0.3))
        return web.Response(body=body, status=status, content_type=kind)

    def close(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="module")
def servers(task, tmp_path_factory):
    """Two deterministic CPU servers on the task's model, the second behind the delaying proxy: their URLs, and
    the API key they were started with (the lane's, which an earlier module's run may have set; None: none)."""
    from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig

    root = tmp_path_factory.mktemp("repeat_servers")
    config = SGLangServerConfig(str(task / "model"), device="cpu", dtype="float32", max_total_tokens=4096,
                                startup_timeout_s=600, extra_args=["--enable-deterministic-inference"])
    with SGLangServer(config, root / "a.log") as a, SGLangServer(config, root / "b.log") as b:
        proxy = DelayingProxy(b.url)
        try:
            yield [a.url, proxy.url], os.environ.get(SERVER_KEY_ENV)
        finally:
            proxy.close()


def run(task, servers, out, mode: str, monkeypatch) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A run of STEPS steps in this process from the task's model, the servers first given its weights back: the
    policy's weights at the end, and the steps' metrics."""
    from megatron_dapo.rollout.sglang_server import post_json
    from megatron_dapo.run_config import load_config
    from megatron_dapo.trainer import DapoTrainer

    servers, key = servers
    if key:  # the run's calls carry the servers' key (given servers take the key they were started with)
        monkeypatch.setenv(SERVER_KEY_ENV, key)
    else:
        monkeypatch.delenv(SERVER_KEY_ENV, raising=False)
    for url in servers:
        assert post_json(f"{url}/update_weights_from_disk", {"model_path": str(task / "model"),
                                                             "weight_version": "0"}, 300)["success"]
    cfg = {
        "model": {"path": str(task / "model"), "max_tokens_per_micro_batch": 1024, "dtype": "float32"},
        "data": {"train_path": str(task / "train.jsonl"), "seed": 3, "max_prompt_len": 32},
        "parallel": {"device": "cpu", "seed": 7},
        "reward": {"num_workers": 1, "timeout_s": 5.0},
        "algorithm": {"batch_size": 4, "group_size": 4, "oversample_factor": 2.0, "max_sampling_rounds": 3,
                      "max_response_len": 8, "overlong_cache_len": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "rollout": {"engine": "sglang", "server_urls": servers, "weight_sync": "disk", "mode": mode},
        "loss": {"correction": {"preset": "tis"}},
        "train": {"steps": STEPS, "output_dir": str(out), "checkpoint_every": 0, "tensorboard": False},
        "eval": {"every": 0},
    }
    (out.parent / f"{out.name}.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = DapoTrainer(load_config(out.parent / f"{out.name}.yaml"))
    try:
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.policy.module.state_dict().items()
                   if isinstance(v, torch.Tensor)}
    finally:
        trainer.close()
    return weights, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_the_same_config_and_seed_give_bitwise_the_same_weights_whatever_order_the_servers_answer_in(
        task, servers, tmp_path, mode, monkeypatch):
    first, rows = run(task, servers, tmp_path / "first", mode, monkeypatch)
    second, again = run(task, servers, tmp_path / "second", mode, monkeypatch)
    assert first.keys() == second.keys()
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, differ
    # Every step trained (the weights moved), on the same batches.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r, r2 in zip(rows, again):
        assert r["updates"] >= 1 and r["updates_skipped"] == 0 and r["loss_tokens"] > 0, r
        assert (r["loss"], r["grad_norm"], r["reward_mean"]) == (r2["loss"], r2["grad_norm"], r2["reward_mean"])
    if mode == "one_step_off":
        assert [r["staleness"] for r in rows] == [0] + [1] * (STEPS - 1)
