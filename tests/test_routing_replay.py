"""Routing replay under torchrun (gloo, 4 CPU processes): a tiny Qwen3-MoE's routers take each token's given experts
(random ones, not their own) in the log-prob recompute and in training, at (TP, EP, PP) layouts with a micro-batch
split, sequence parallelism, pipeline parallelism with activation recompute, and context parallelism with sequence
parallelism over packed micro-batches."""

import json

import pytest
import torch
from torchrun_launch import torchrun

BASE = "tp1-ep1-pp1-mb100000"
LAYOUTS = [BASE, "tp1-ep2-pp1-mb62", "tp2-ep2-pp1-sp-mb200", "tp1-ep2-pp2-mb200-r", "tp2-ep2-pp1-sp-mb130-cp2-p"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    torchrun("replay_worker.py", 4, str(out))

    def change(tag):
        merged = {}
        for f in sorted(out.glob(f"replay-{tag}-rank*.pt")):
            merged.update(torch.load(f))
        return merged

    return json.loads((out / "replay.json").read_text()), {t: change(t) for t in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_recomputed_logprobs_are_transformers_with_the_same_routes(runs, layout):
    """Each token at each layer goes where its routes say: transformers with its routers forced to the same experts
    gives the same log-probs, which the routes move far from the routers' own choice."""
    results, _ = runs
    assert results["forced_vs_own"] > 1e-2
    errors = [r["max_abs_logp"] for r in results[layout] if "max_abs_logp" in r]
    assert errors and max(errors) < 1e-5, results[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_router_call_of_a_training_step_takes_its_routes(runs, layout):
    results, _ = runs
    assert all(r["router_calls"] > 0 and r["wrong_calls"] == 0 for r in results[layout]), results[layout]
    if layout.endswith("-r"):  # the recomputed forwards in the backward replay their micro-batch's routes too
        assert all(r["recomputed_calls"] > 0 for r in results[layout])


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_a_replayed_step_is_the_same_whatever_the_split(runs, layout):
    results, changes = runs
    base, other = changes[BASE], changes[layout]
    assert other.keys() == base.keys() and len(base) == 77
    scale = max(v.abs().max().item() for v in base.values())
    worst = max((other[k] - base[k]).abs().max().item() for k in base) / scale
    assert worst < 1e-5, f"weight change differs from the unsplit replayed step by {worst:.2e} (relative)"
    assert results[layout][0]["loss"] == pytest.approx(results[BASE][0]["loss"], rel=1e-5)
    routers = [k for k in base if k.endswith("mlp.gate.weight")]
    assert all(base[k].abs().max() > 0 for k in routers)  # the routers still learn through their scores


def test_a_sequence_without_routes_is_refused_by_name(runs):
    results, _ = runs
    assert results["missing"].startswith("sequence 1 has no routes, and routing replay is on")
    assert "never falls back to the trainer's own routing" in results["missing"]


@pytest.mark.parametrize("layout", ["tp1-ep2-pp1", "tp2-ep2-pp1-sp"])
def test_glm_style_routes_replayed_are_transformers_forced_to_them(runs, layout):
    """Issue 50: GLM-4.5-style routing (sigmoid scores with the expert bias, grouped top-k) replayed at EP 2: the
    log-probs are transformers' with its routers forced to the same routes (their sigmoid scores at those experts,
    renormalised and scaled; the bias only chooses, so it plays no part), within 1e-5."""
    results, _ = runs
    found = results[f"glm4_moe-{layout}"]
    assert all(own > 1e-2 for _, own in found)  # the random routes are not the routers' own
    errors = [e for e, _ in found if e is not None]
    assert errors and max(errors) < 1e-5, found


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_the_routing_agreement_of_a_step_is_the_same_whatever_the_split(runs, layout):
    """The share of response tokens whose routers' own top k is the replayed one, over the whole batch: the same
    at every layout (its counts are summed over the ranks), with pipeline stages and activation recompute too,
    where a layer's forward runs again in its backward after later micro-batches' forwards (counted once)."""
    results, _ = runs
    base = results[BASE][0]["routing_agreement"]
    assert len(base) == 3 and all(0 < a < 1 for a in base)  # random routes: some agree by chance, not all
    for record in results[layout]:
        assert record["routing_agreement"] == pytest.approx(base, abs=1e-12), record

