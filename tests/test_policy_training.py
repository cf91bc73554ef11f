"""The training step under torchrun (gloo): split invariance across DP / micro-batches / TP / PP and with full
activation recompute, and learning."""

import json

import pytest
import torch
from torchrun_launch import torchrun

from megatron_dapo.config import ConfigError
from megatron_dapo.policy.train_step import OptimConfig, RolloutSample

BASE = "tp1-pp1-dp1-mb100000"  # DP=1, one micro-batch
SPLITS = ["tp1-pp1-dp2-mb62", "tp2-pp1-dp1-mb200", "tp1-pp2-dp1-mb200"]
RECOMPUTE = ["tp2-pp1-dp1-mb200-r", "tp1-pp2-dp1-mb200-r"]  # model.activation_recompute: full
SAMPLE_BASE, SAMPLE_SPLIT = "tp1-pp1-dp1-mb100000-s", "tp1-pp1-dp2-mb62-s"  # loss.aggregation: sample
# model.packing: whole sequences end to end (p), against the padded BASE; with SP at TP2 (sp)
PACKED = ["tp1-pp1-dp1-mb100000-p", "tp1-pp1-dp2-mb62-p", "tp2-pp1-dp1-mb200-p-sp", "tp1-pp2-dp1-mb200-r-p"]
# parallel.context_parallel = 2 (policy/context_parallel.py): padded blocks with a micro-batch split, and packed
CONTEXT = ["tp1-pp1-dp1-mb64-cp", "tp1-pp1-dp1-mb100000-p-cp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    torchrun("train_worker.py", 1, str(out), "1,1,100000", "1,1,100000,s", "1,1,100000,p", "tis", "bf16")
    torchrun("train_worker.py", 2, str(out), "1,1,62", "1,1,62,s", "2,1,200", "1,2,200", "2,1,200,r", "1,2,200,r",
             "1,1,62,p", "2,1,200,p,sp", "1,2,200,r,p", "1,1,64,cp", "1,1,100000,p,cp", "adam", "adam-cp-bf16",
             "nan")

    def load(tag):
        deltas = {}
        for f in sorted(out.glob(f"{tag}-stage*.pt")):
            deltas.update(torch.load(f))
        return json.loads((out / f"{tag}.json").read_text()), deltas

    return {**{tag: load(tag) for tag in [BASE, *SPLITS, *RECOMPUTE, *PACKED, *CONTEXT, SAMPLE_BASE, SAMPLE_SPLIT,
                                          "adam", "adam-cp-bf16"]},
            **{k: json.loads((out / f"{k}.json").read_text()) for k in ("tis", "nan", "bf16")}}


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_a_bf16_policy_trains_the_weights_it_loaded(runs, optimizer):
    """The GPU's precision on the CPU (bf16 weights, fp32 master copy): one update at an lr below bf16's
    resolution leaves every weight as loaded; a master copy taken before the load (the random initialisation)
    would have replaced them all."""
    r = runs["bf16"][optimizer]
    assert r["applied"] and r["loss"] == r["loss"]  # not nan
    assert r["dtypes"] == ["torch.bfloat16"]  # the model at one dtype, its norms included
    assert r["max_change"] <= 1e-2 * r["max_weight"], r


def test_a_nan_in_one_micro_batch_skips_the_update_on_every_rank(runs):
    nan = runs["nan"]
    assert nan["applied"] == [[False, True], [False, True]]  # both TP ranks agree
    assert nan["bad_loss"] == "nan" and nan["bad_grad_norm"] == "nan"
    assert nan["unchanged"] and nan["moved"] and nan["good_grad_norm"] > 0
    assert nan["step_count"] == 2  # the LR schedule counts the skipped update


def test_base_layout_is_one_micro_batch(runs):
    assert runs[BASE][0]["micro_batches_per_rank"] == [1]


def test_data_parallel_layout_splits_into_many_micro_batches(runs):
    assert runs["tp1-pp1-dp2-mb62"][0]["micro_batches_per_rank"] == [2, 4]


def test_packed_micro_batches_hold_the_real_tokens_of_whole_sequences(runs):
    """At 62 tokens a micro-batch, rank 0's 25 + 20 + 15 tokens share one where padded blocks (rows x the longest)
    need two: 2 and 3 micro-batches against 2 and 4."""
    assert runs["tp1-pp1-dp2-mb62-p"][0]["micro_batches_per_rank"] == [2, 3]


@pytest.mark.parametrize("split", CONTEXT)
def test_context_parallel_logprobs_and_entropies_are_the_unsplit_ones(runs, split):
    """Each CP rank computes its chunks of every sequence; gathered back they are CP = 1's, token by token, on both
    ranks."""
    base, other = runs[BASE][0]["logprobs"], runs[split][0]["logprobs"]
    assert [len(lp) for lp, _ in other] == [len(lp) for lp, _ in base] == [20, 41, 4, 60, 13, 30, 9, 25]
    for (lp, en), (lp0, en0) in zip(other, base):
        assert torch.tensor(lp) == pytest.approx(torch.tensor(lp0), abs=1e-5)
        assert torch.tensor(en) == pytest.approx(torch.tensor(en0), abs=1e-5)
    assert runs[split][0]["logprobs_on_every_rank"]


@pytest.mark.parametrize("split", SPLITS + RECOMPUTE + PACKED + CONTEXT)
def test_one_step_is_the_same_whatever_the_split(runs, split):
    base_meta, base = runs[BASE]
    meta, other = runs[split]
    assert other.keys() == base.keys() and len(base) == 51  # every HF tensor of the 4-layer model
    scale = max(v.abs().max().item() for v in base.values())
    assert scale > 1e-3  # the step moved the weights
    worst = max((other[k] - base[k]).abs().max().item() for k in base) / scale
    assert worst < 1e-5, f"weight change differs from DP=1/one micro-batch by {worst:.2e} (relative)"
    assert meta["grad_norm"] == pytest.approx(base_meta["grad_norm"], rel=1e-5)
    assert meta["loss"] == pytest.approx(base_meta["loss"], rel=1e-5)
    assert meta["stats"]["num_tokens"] == base_meta["stats"]["num_tokens"]


def test_sample_level_aggregation_is_its_definition_and_the_same_whatever_the_split(runs):
    """loss.aggregation "sample" (GRPO): the step's loss is the float64 definition's (each response's token mean,
    then the mean over responses), one step is the same under a data-parallel, many-micro-batch split, and it is
    not the token-level step (the batch's responses are 4 to 60 tokens long)."""
    base_meta, base = runs[SAMPLE_BASE]
    meta, split = runs[SAMPLE_SPLIT]
    # fp32 against float64, of a loss that cancels (0.0029 from terms of either sign): off by 2.0e-5 of it on an
    # AVX2-only EPYC (on main too), within 1e-5 on the machines before
    assert base_meta["loss"] == pytest.approx(base_meta["reference_loss"], rel=5e-5)
    assert meta["loss"] == pytest.approx(base_meta["loss"], rel=1e-5)
    assert meta["grad_norm"] == pytest.approx(base_meta["grad_norm"], rel=1e-5)
    scale = max(v.abs().max().item() for v in base.values())
    assert max((split[k] - base[k]).abs().max().item() for k in base) / scale < 1e-5
    token_meta, token = runs[BASE]
    assert abs(base_meta["grad_norm"] - token_meta["grad_norm"]) > 0.01 * token_meta["grad_norm"]
    assert max((token[k] - base[k]).abs().max().item() for k in base) / scale > 1e-2


@pytest.mark.parametrize("split", RECOMPUTE)
def test_recompute_checkpoints_every_layer_of_every_micro_batch(runs, split):
    meta = runs[split][0]
    micro_batches = meta["micro_batches_per_rank"]  # DP = 1: the same micro-batches on every rank
    assert meta["checkpoints_per_rank"] == [meta["layers_per_stage"] * n for n in micro_batches]
    assert runs[split.removesuffix("-r")][0]["checkpoints_per_rank"] == [0, 0]  # none without it


def test_activation_recompute_is_megatron_full_uniform_one_layer_at_a_time():
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import transformer_config

    spec = model_spec_from_hf({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6})
    parallel = ParallelConfig(pipeline_parallel=2, device="cpu")
    full = transformer_config(spec, parallel, activation_recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert full.distribute_saved_activations is False
    assert transformer_config(spec, parallel).recompute_granularity is None  # the default: none


def test_a_zero_tis_weight_keeps_its_token_in_the_normaliser(runs):
    record = runs["tis"]
    weighted, left_out = record["grad_norms"]["weighted"], record["grad_norms"]["left_out"]
    tokens = record["loss_tokens"]
    assert weighted == pytest.approx(left_out * tokens["left_out"] / tokens["weighted"], rel=1e-5)


@pytest.mark.parametrize("layout", ["adam", "adam-cp-bf16"])
def test_a_few_adam_steps_lower_the_loss(runs, layout):
    """At TP 2 in fp32, and at CP 2 in the GPU's precision (bf16 weights, fp32 master copy)."""
    losses = runs[layout][0]["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.7 * losses[0]


def test_learning_rate_warmup_then_constant():
    optim = OptimConfig(lr=1e-6, warmup_steps=4)
    assert [optim.lr_at(s) for s in range(6)] == pytest.approx([2.5e-7, 5e-7, 7.5e-7, 1e-6, 1e-6, 1e-6])


def test_the_papers_warmup_ends_at_rollout_step_20_whatever_the_updates_per_step():
    optim = OptimConfig()  # lr 1e-6 after 20 warmup steps
    updates = 16  # the paper's updates per rollout step
    last_update_of = [optim.lr_at(s * updates + updates - 1, updates) for s in range(22)]
    assert last_update_of[:20] == pytest.approx([1e-6 * (s + 1) / 20 for s in range(20)])  # rollout step s + 1
    assert last_update_of[19:] == pytest.approx([1e-6] * 3)
    assert optim.lr_at(0, updates) == pytest.approx(1e-6 / 320)  # the very first update


@pytest.mark.parametrize("kw,key", [(dict(lr=0.0), "optim.lr"), (dict(warmup_steps=-1), "optim.warmup_steps"),
                                    (dict(clip_grad=-1.0), "optim.clip_grad")])
def test_bad_optim_config(kw, key):
    with pytest.raises(ConfigError, match=key):
        OptimConfig(**kw)


def test_rollout_sample_shapes_are_checked():
    from megatron_dapo.policy.batch import Sequence

    seq = Sequence(torch.arange(10), 4)
    with pytest.raises(ValueError, match=r"RolloutSample.advantages: shape \(5,\), expected \(6,\)"):
        RolloutSample(seq, torch.zeros(6), torch.zeros(5), torch.ones(6, dtype=torch.bool))
