"""A mixture of experts with a real SGLang server on the CPU (fp32; started with --enable-return-routed-experts, which
runs on the CPU through cpu_shim's plugin): a tiny Qwen3-MoE with experts in every layer, as SGLang builds it, and a
tiny GLM-4.5 (sigmoid routing with an expert bias, groups, a shared expert, a dense first layer). The routes a server
returns are its routers' choices, read into the trainer's layout; a policy whose experts are spread over two
expert-parallel ranks trains a step and syncs into it through every route, after which the server samples from the
new weights."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import save_with_tokenizer  # noqa: E402

from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint  # noqa: E402
from megatron_dapo.policy.hf_config import model_spec_from_hf  # noqa: E402
from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.routes import RouteLayout  # noqa: E402
from megatron_dapo.rollout.sglang_engine import SGLangEngine  # noqa: E402
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig  # noqa: E402
from megatron_dapo.weight_sync import ROUTES, buckets  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 40, 33], [8, 9, 10], [60, 61, 62, 63, 64, 65, 66]]


def serving(root: Path, kind: str):
    """A CPU SGLang server of a tiny random model of `kind` (fp32, returning its routes)."""
    save_with_tokenizer(root / "model", kind=kind)
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=4096,
                                startup_timeout_s=600, extra_args=["--enable-return-routed-experts"])
    return SGLangServer(config, root / "server.log")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-moe")
    with serving(root, "qwen3_moe_sparse") as srv:
        yield srv, root


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-glm")
    with serving(root, "glm4_moe") as srv:
        yield srv, root


def test_the_routes_sglang_returns_are_its_routers_choices_in_the_trainers_layout(server):
    """Each response's routes, token by token at every layer, are top-k experts of transformers' Qwen3-MoE router
    for the same sequence: where the k-th and next probabilities differ, exactly those experts; where they tie (fp32
    softmax saturates on this tiny model's decisive routers, and engines break ties as they like), tied ones."""
    from transformers import AutoModelForCausalLM

    srv, root = server
    spec = model_spec_from_hf(HFCheckpoint(root / "model").config)
    engine = SGLangEngine(srv.url, routes=RouteLayout.of(spec))
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, temperature=1.0))
    hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    k, untied = spec.moe_topk, 0
    for s in (s for g in groups for s in g):
        ids = PROMPTS[s.prompt_index] + s.output_ids
        assert s.routes.shape == (len(ids) - 1, spec.num_layers, k) and s.routes.dtype == np.uint8
        with torch.no_grad():
            logits = hf(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
        probs = torch.stack(logits, dim=1).softmax(-1)  # [positions, layers, experts]
        routes = torch.from_numpy(s.routes.astype(np.int64))
        ranked = probs.sort(dim=-1, descending=True).values
        assert (routes.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts
        assert (probs.gather(-1, routes) >= ranked[..., k - 1:k]).all(), s.prompt_index
        untied += (ranked[..., k - 1] > ranked[..., k]).sum().item()
    assert untied > 0.5 * sum(len(s.routes) for g in groups for s in g) * spec.num_layers


def test_an_expert_parallel_policy_syncs_into_the_server_through_every_route(server, tmp_path):
    """EP = 2 over 2 data-parallel ranks, each with half the experts: after a step, for each route the server is
    put back to the original weights, synced, and samples from the new policy (its log-probs the policy's)."""
    syncs_through_every_route(server, tmp_path)


def syncs_through_every_route(server, tmp_path):
    srv, root = server
    torchrun("weight_sync_worker.py", 2, str(tmp_path / "out.json"), str(root / "model"), srv.url, str(tmp_path),
             "ep2", ",".join(ROUTES), "0.05")
    r = json.loads((tmp_path / "out.json").read_text())["ep2"]
    assert r["before"] < 1e-4 and r["stale"] > 1e-3, r
    spec = model_spec_from_hf(HFCheckpoint(root / "model").config)
    for route in ROUTES:
        s = r["routes"][route]
        assert s["reset"] > 1e-3 and s["versions_reset"] == ["0"], (route, s)
        assert s["after"] < 1e-4 and s["versions_after"] == ["1"] and s["samples_after"] == 16, (route, s)
        if route != "disk":  # every expert's tensors sent exactly once, whichever rank holds them
            assert s["bytes"] == buckets.model_bytes(spec, torch.float32), (route, s)


def test_a_moe_with_routing_replay_starts_against_given_server_urls_and_trains_a_step(server, tmp_path):
    """Issue 50, finding 3: with rollout.server_urls (as the SLURM launcher sets them) the start-up log-prob check
    recomputed the servers' samples with the replaying policy but without routes, and every rank failed with
    RoutesMissing. Now the check asks the servers for their routes and replays them. Last in this module: the run
    syncs its step into the server (the test before resets it to the model's weights first, as this one does)."""
    import os
    import subprocess

    import yaml
    from transformers import AutoTokenizer

    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.demo.tiny_model import CHAT_TEMPLATE
    from megatron_dapo.rollout.sglang_server import post_json

    srv, root = server
    # the server back to model.path's weights (the expert-parallel test left a step's in it)
    assert post_json(f"{srv.url}/update_weights_from_disk", {"model_path": str(root / "model"),
                                                              "weight_version": "0"}, 300)["success"]
    tok = AutoTokenizer.from_pretrained(root / "model")
    tok.chat_template = CHAT_TEMPLATE  # the served weights are untouched
    tok.save_pretrained(root / "model")
    write_rows(tmp_path / "train.jsonl", generate_rows(16, 0, digits=1, operations="+", num_operands=2,
                                                       style="short"))
    out = tmp_path / "run"
    cfg = {"model": {"path": str(root / "model"), "max_tokens_per_micro_batch": 1024, "moe_aux_loss_coef": 0.0},
           "data": {"train_path": str(tmp_path / "train.jsonl"), "max_prompt_len": 48},
           "parallel": {"device": "cpu"},
           "rollout": {"engine": "sglang", "server_urls": [srv.url], "routing_replay": True, "weight_sync": "disk"},
           "reward": {"num_workers": 1},
           "algorithm": {"batch_size": 2, "group_size": 2, "dynamic_sampling": False, "oversample_factor": 1.0,
                         "max_response_len": 8, "overlong_cache_len": 2},
           "train": {"steps": 1, "updates_per_step": 1, "output_dir": str(out), "tensorboard": False},
           "eval": {"every": 0}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", str(path)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:] + log[-4000:]
    assert "rollout.server_urls: log-probs match the policy's" in log and "the servers' routes replayed" in log
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_sglang_serves_glm_style_routing_as_transformers_computes_it(glm_server):
    """Issue 50: a tiny GLM-4.5 (sigmoid routing with an expert bias, 2 groups, a shared expert, a dense first layer,
    partial rotary) served by SGLang on this CPU: its log-probs are transformers' (fp32), and the routes it returns,
    read into the trainer's layout (its MoE layers only), are transformers' routers' own choices, token by token."""
    from transformers import AutoModelForCausalLM

    srv, root = glm_server
    spec = model_spec_from_hf(HFCheckpoint(root / "model").config)
    engine = SGLangEngine(srv.url, routes=RouteLayout.of(spec))
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, temperature=1.0))
    hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    for s in (s for g in groups for s in g):
        ids = PROMPTS[s.prompt_index] + s.output_ids
        chosen = []
        hooks = [g.register_forward_hook(lambda _m, _a, out: chosen.append(out[2])) for g in gates]
        try:
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        finally:
            for h in hooks:
                h.remove()
        p = len(PROMPTS[s.prompt_index])
        expected = logp[p - 1:-1].gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
        assert (torch.tensor(s.logprobs, dtype=torch.float64) - expected).abs().max() < 1e-5
        own = torch.stack(chosen, 1)[: len(ids) - 1].sort(-1).values  # [positions, MoE layers, k]
        assert s.routes.shape == (len(ids) - 1, sum(spec.moe_layers), spec.moe_topk)
        assert torch.equal(torch.from_numpy(s.routes.astype(np.int64)).sort(-1).values, own)


def test_a_glm_style_expert_parallel_policy_syncs_into_the_server_through_every_route(glm_server, tmp_path):
    """The same as Qwen3-MoE's: EP = 2, every route; the expert bias goes over in fp32 with the rest."""
    syncs_through_every_route(glm_server, tmp_path)

