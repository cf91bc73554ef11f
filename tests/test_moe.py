"""Mixture-of-experts policies (Qwen3-MoE) under torchrun (gloo, 4 CPU processes): log-prob and entropy parity with
transformers at (TP, EP, PP) layouts with sequence parallelism, and one training step that is the same whatever the
split (expert, tensor, pipeline and data parallel, micro-batches, activation recompute)."""

import json

import pytest
import torch
from torchrun_launch import torchrun

PARITY = ["tp1-ep1-pp1", "tp1-ep2-pp1", "tp2-ep2-pp1-sp", "tp1-ep2-pp2"]
GLM_PARITY = ["tp1-ep1-pp1", "tp2-ep2-pp1-sp", "tp1-ep2-pp2"]
BASE = "tp1-ep1-pp1-mb100000"  # no expert parallelism, one micro-batch per rank
SPLITS = ["tp1-ep2-pp1-mb62", "tp1-ep2-pp1-mb62-r", "tp2-ep2-pp1-sp-mb200", "tp1-ep2-pp2-mb200",
          "tp1-ep2-pp2-mb200-r",
          "tp1-ep2-pp1-mb62-plain",  # optim.distributed_optimizer false: the experts' plain optimizer
          "tp2-ep2-pp1-sp-mb200-p"]  # model.packing, with sequence and expert parallelism
AUX = "tp1-ep2-pp2-mb200-aux"  # the same step with model.moe_aux_loss_coef 0.01
AUX_SP = "tp2-ep2-pp1-sp-mb200-aux"  # ... at TP2 + SP: the same micro-batches (DP2), their tokens split over TP
AUX_RECOMPUTE = "tp1-ep2-pp2-mb200-r-aux"  # ... with activation recompute under the pipeline schedule


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    torchrun("moe_worker.py", 4, str(out))

    def step(tag):
        """The step's record and every HF tensor's change; replicas of a tensor (data-parallel copies) agree."""
        change = {}
        for f in sorted(out.glob(f"{tag}-rank*.pt")):
            for name, delta in torch.load(f).items():
                if name in change:
                    assert torch.allclose(change[name], delta, rtol=0, atol=1e-6), f"{tag}: replicas of {name} differ"
                change[name] = delta
        return json.loads((out / f"{tag}.json").read_text()), change

    return {"parity": json.loads((out / "parity.json").read_text()),
            **{t: step(t) for t in [BASE, *SPLITS, AUX, AUX_SP, AUX_RECOMPUTE]}}


@pytest.mark.parametrize("layout", PARITY)
def test_logprobs_and_entropy_match_transformers(runs, layout):
    found = runs["parity"][layout]
    assert found, f"no rank reported {layout}"
    for r in found:
        assert r["tokens"] == 138
        assert r["max_abs_logp"] < 1e-4, r
        assert r["max_abs_entropy"] < 1e-4, r


@pytest.mark.parametrize("layout", PARITY)
def test_export_and_weight_sync_from_every_layout_are_bitwise_the_source_checkpoint(runs, layout):
    assert runs["parity"][f"export-{layout}"] == {"export_names": True, "export_bitwise": True, "sync_names": True,
                                                  "sync_bitwise": True}


@pytest.mark.parametrize("layout", GLM_PARITY)
def test_glm_style_routing_matches_transformers_and_exports_bitwise(runs, layout):
    """Issue 50: Glm4MoeForCausalLM (sigmoid scores, the expert bias in the choice, the best of 2 groups, a shared
    expert, a routed scaling factor, a dense first layer, q/k norms, QKV biases, rotary on half of each head) against
    transformers' float32 forward, within 1e-5; its export and weight-sync buckets are the source, bitwise (the
    expert bias in fp32)."""
    found = runs["parity"][f"glm4_moe-{layout}"]
    assert found, f"no rank reported {layout}"
    for r in found:
        assert r["tokens"] == 138 and r["max_abs_logp"] < 1e-5 and r["max_abs_entropy"] < 1e-5, r
    assert runs["parity"][f"export-glm4_moe-{layout}"] == {"export_names": True, "export_bitwise": True,
                                                           "sync_names": True, "sync_bitwise": True}


@pytest.mark.parametrize("split", SPLITS)
def test_one_step_is_the_same_whatever_the_split(runs, split):
    base_meta, base = runs[BASE]
    meta, other = runs[split]
    # every HF tensor: 4 layers of 8 around attention, 3 sparse MLPs of a router and 4 experts x 3 tensors, a dense
    # one, embeddings, final norm and output layer
    assert other.keys() == base.keys() and len(base) == 4 * 8 + 3 * (1 + 4 * 3) + 3 + 3
    experts = [k for k in base if ".mlp.experts." in k]
    assert all(base[k].abs().max() > 0 for k in experts), "an expert took no gradient: routing too narrow to test"
    scale = max(v.abs().max().item() for v in base.values())
    worst = max((other[k] - base[k]).abs().max().item() for k in base) / scale
    assert worst < 1e-5, f"weight change differs from the unsplit step by {worst:.2e} (relative)"
    assert meta["grad_norm"] == pytest.approx(base_meta["grad_norm"], rel=1e-5)
    assert meta["loss"] == pytest.approx(base_meta["loss"], rel=1e-5)
    assert meta["num_tokens"] == base_meta["num_tokens"]


def test_the_load_balancing_loss_is_reported_and_acts_on_the_routers(runs):
    """With a coefficient the step reports the loss's value (megatron-core's switch loss: 1 for a perfectly even
    routing, up to the expert count for all tokens on one expert) and moves the routers differently; at 0 it is not
    computed."""
    (plain_meta, plain), (aux_meta, aux) = runs["tp1-ep2-pp2-mb200"], runs[AUX]
    assert plain_meta["load_balancing_loss"] is None
    assert 0.9 < aux_meta["load_balancing_loss"] < 4
    routers = [k for k in plain if k.endswith("mlp.gate.weight")]
    assert all((aux[k] - plain[k]).abs().max() > 1e-7 for k in routers)
    assert aux_meta["loss"] == pytest.approx(plain_meta["loss"], rel=1e-6)  # the policy loss is the same


@pytest.mark.parametrize("other", [AUX_SP, AUX_RECOMPUTE])
def test_the_load_balancing_loss_is_the_same_whatever_the_sequence_parallel_split_or_recompute(runs, other):
    """The same micro-batches (DP 2, budget 200) at PP2 and at TP2 + SP, where each micro-batch's tokens are split
    over the TP ranks and its length padded to a multiple of 2: the same loss value and the same step. Each rank's
    share of the aux gradient has the same weight (the micro-batch's real tokens; megatron-core's padding mask would
    weight it by the real tokens of the rank's share), and padding is left out. With activation recompute under
    the pipeline schedule each micro-batch's loss is attached in its layer's recompute, from the micro-batch queued
    at its first forward."""
    (pp_meta, pp), (sp_meta, sp) = runs[AUX], runs[other]
    assert sp_meta["load_balancing_loss"] == pytest.approx(pp_meta["load_balancing_loss"], rel=1e-5)
    scale = max(v.abs().max().item() for v in pp.values())
    worst = max((sp[k] - pp[k]).abs().max().item() for k in pp) / scale
    assert worst < 1e-5, f"the SP-split aux step differs by {worst:.2e} (relative)"

