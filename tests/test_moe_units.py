"""Single-process pieces of mixture-of-experts support: reading Qwen3-MoE's config, the layouts refused, the experts'
names and shards, and the micro-batch count expert parallelism needs."""

import pytest
import torch

from megatron_dapo.checkpoint.hf_mapping import (
    expected_hf_names,
    hf_names,
    hf_shape,
    hf_tensors,
    megatron_names,
    megatron_shard,
    renumber_expert,
    tp_dim,
)
from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.policy.batch import Sequence, at_least, micro_batches
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import check_divisibility, padded_vocab_size

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=300,
                 max_position_embeddings=96, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 router_aux_loss_coef=0.001)


def test_spec_reads_the_experts_and_which_layers_have_them():
    spec = model_spec_from_hf(QWEN3_MOE)
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.norm_topk_prob) == (8, 2, 32, True)
    assert spec.moe_layers == (True,) * 4 and spec.router_aux_loss_coef == 0.001 and spec.qk_layernorm
    # transformers' own rule: sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0
    mixed = model_spec_from_hf({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert mixed.moe_layers == (False, True, False, False)
    # transformers 5 writes the expert count as num_local_experts
    local = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert model_spec_from_hf({**local, "num_local_experts": 8}).num_experts == 8
    assert not model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]}).is_moe


@pytest.mark.parametrize("override,message", [
    (dict(architectures=["Qwen2MoeForCausalLM"]), "shared_expert_intermediate_size: must be a whole number"),
    (dict(architectures=["DeepseekV3ForCausalLM"]), "DeepseekV3ForCausalLM is not supported: multi-head latent"),
    (dict(num_experts=None), "num_experts: missing"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size: missing"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok: 9 must be in \[1, num_experts = 8\]"),
    (dict(mlp_only_layers=[4]), r"mlp_only_layers: \[4\] are not layers"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "no layer has experts"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step: must be a whole number >= 1"),
])
def test_bad_moe_config_names_the_key(override, message):
    config = {k: v for k, v in {**QWEN3_MOE, **override}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        model_spec_from_hf(config)


@pytest.mark.parametrize("kw,message", [
    (dict(expert_parallel=3), "num_experts: 8 is not divisible by parallel.expert_parallel = 3"),
    (dict(tensor_parallel=2), "parallel.sequence_parallel: a mixture of experts at parallel.tensor_parallel = 2"),
])
def test_layouts_megatron_core_cannot_build_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        check_divisibility(model_spec_from_hf(QWEN3_MOE), ParallelConfig(**kw))


def test_expert_parallelism_of_a_dense_model_is_refused():
    dense = model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ConfigError, match="parallel.expert_parallel: 2, but Qwen3ForCausalLM is a dense model"):
        check_divisibility(dense, ParallelConfig(expert_parallel=2))
    check_divisibility(model_spec_from_hf(QWEN3_MOE),
                       ParallelConfig(tensor_parallel=2, sequence_parallel=True, expert_parallel=4))


@pytest.mark.parametrize("kw,world,message", [
    (dict(sequence_parallel=True), 1,
     "parallel.sequence_parallel: splits activations .* parallel.tensor_parallel is 1"),
    (dict(expert_parallel=4, pipeline_parallel=2), 4, "parallel.expert_parallel: 4 does not divide the 2 ranks"),
])
def test_parallel_layouts_refused_up_front(kw, world, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kw).data_parallel(world)


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_mapping_round_trip_is_exact(tp):
    spec = model_spec_from_hf({**QWEN3_MOE, "mlp_only_layers": [1]})
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(hf_shape(n, spec), generator=g) for n in sorted(expected_hf_names(spec))}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf and "model.layers.1.mlp.down_proj.weight" in hf
    assert hf_shape("model.layers.0.mlp.experts.7.gate_proj.weight", spec) == (32, 64)
    assert hf_shape("model.layers.0.mlp.gate.weight", spec) == (8, 64)
    vocab = padded_vocab_size(spec.vocab_size, tp)
    back = {}
    for mname in megatron_names(spec):
        shards = [megatron_shard(mname, hf.__getitem__, spec, tp_rank=r, tp_size=tp, padded_vocab_size=vocab)
                  for r in range(tp)]
        back.update(hf_tensors(mname, shards if tp_dim(mname) is not None else shards[:1], spec))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    fc1 = megatron_shard("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight", hf.__getitem__, spec,
                         tp_rank=1, tp_size=2, padded_vocab_size=vocab)  # experts stay whole at any TP
    assert torch.equal(fc1, torch.cat([hf["model.layers.2.mlp.experts.5.gate_proj.weight"],
                                       hf["model.layers.2.mlp.experts.5.up_proj.weight"]]))


def test_transformer_engine_expert_names_map_like_the_local_ones():
    spec = model_spec_from_hf(QWEN3_MOE)
    te = megatron_names(spec, te_names=True)
    assert "decoder.layers.0.mlp.experts.linear_fc2.weight7" in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te  # not fused into an fc1 on a layer with experts
    assert {n for m in te for n in hf_names(m, spec)} == expected_hf_names(spec)
    assert renumber_expert("decoder.layers.3.mlp.experts.linear_fc1.weight1", 4) == \
        "decoder.layers.3.mlp.experts.linear_fc1.weight5"
    assert renumber_expert("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight", 4) == \
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight"


def test_every_rank_can_run_as_many_micro_batches_as_the_busiest():
    """Expert parallelism exchanges tokens in every micro-batch's forward and backward: a rank with fewer
    sequences halves its widest blocks, then adds fillers (a padding row that carries no sample)."""
    assert at_least([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]
    assert at_least([[0], [1]], 4) == [[0], [1], [], []]
    seqs = [Sequence(torch.arange(1, 8), 3), Sequence(torch.arange(1, 6), 2)]
    mbs = micro_batches(seqs, max_tokens=100, length_multiple=2, count=3)
    assert [mb.sample_index for mb in mbs] == [[0], [1], []]
    assert [mb.input_ids.shape[1] for mb in mbs] == [8, 6, 2]  # sequence parallelism's multiple of TP
    assert mbs[2].num_response_tokens == 0 and mbs[2].response_lens == []


def test_the_load_balancing_coefficient_is_a_model_key():
    from megatron_dapo.config import ModelConfig
    from megatron_dapo.policy.load_balancing import aux_coefficient
    from megatron_dapo.policy.model import moe_options

    spec = model_spec_from_hf(QWEN3_MOE)
    assert aux_coefficient(spec, None) == 0.001  # config.json's router_aux_loss_coef
    assert aux_coefficient(spec, 0.0) == 0.0
    assert moe_options(spec, 0.01)["moe_aux_loss_coeff"] == 0.0  # megatron-core's own stays off: load_balancing's
    assert moe_options(spec, None)["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top k
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coef: must be a number >= 0 or null"):
        ModelConfig(path="m", moe_aux_loss_coef=-1)
    dense = model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coef: 0.01, but Qwen3ForCausalLM is a dense model"):
        moe_options(dense, 0.01)


def test_a_resume_checks_the_experts_as_trainer_state_json_holds_them():
    import dataclasses
    import json

    from megatron_dapo.checkpoint.safetensors_io import CheckpointError
    from megatron_dapo.checkpoint.trainer_checkpoint import check_model_shape

    spec = model_spec_from_hf({**QWEN3_MOE, "mlp_only_layers": [1]})
    saved = {"model": json.loads(json.dumps(dataclasses.asdict(spec)))}  # moe_layers a list, as JSON has it
    check_model_shape(saved, spec, "ckpt")
    with pytest.raises(CheckpointError, match=r"different model shape: num_experts=8 \(this model: 16\)"):
        check_model_shape(saved, dataclasses.replace(spec, num_experts=16), "ckpt")
    dense = model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    before_moe = {"model": {k: v for k, v in dataclasses.asdict(dense).items() if k in (
        f.name for f in dataclasses.fields(dense) if f.default is dataclasses.MISSING)}}
    check_model_shape(before_moe, dense, "ckpt")  # a dense checkpoint saved before the expert fields existed


def test_routes_travel_with_their_sequences_into_micro_batches():
    routes = torch.tensor([[[3, 1]], [[2, 0]], [[1, 2]]], dtype=torch.int16)  # 3 tokens, 1 MoE layer, top 2
    seqs = [Sequence(torch.arange(1, 4), 1, routes), Sequence(torch.arange(1, 6), 2, torch.zeros(5, 1, 2).long())]
    mbs = micro_batches(seqs, max_tokens=100, length_multiple=2)
    assert len(mbs) == 1 and mbs[0].routes.shape == (2, 6, 1, 2)
    row = mbs[0].sample_index.index(0)
    assert torch.equal(mbs[0].routes[row, :3], routes)
    assert mbs[0].route_fill[row].tolist() == [False] * 3 + [True] * 3  # padding: the replayer spreads it
    without = micro_batches([seqs[0], Sequence(torch.arange(1, 6), 2)], max_tokens=100)
    assert without[0].routes is None and without[0].routes_missing == [1]


def test_bad_routes_and_replay_of_a_dense_model_are_refused():
    from megatron_dapo.policy.batch import check_sequences
    from megatron_dapo.policy.model import moe_options

    with pytest.raises(ValueError, match=r"sequence 0: routes must be integer expert ids \[tokens = 3 \(or 2"):
        check_sequences([Sequence(torch.arange(3), 1, torch.zeros(1, 1, 2).long())], 96)
    check_sequences([Sequence(torch.arange(3), 1, torch.zeros(2, 1, 2).long())], 96)  # the last token's left out
    dense = model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ConfigError, match="rollout.routing_replay: Qwen3ForCausalLM is a dense model"):
        moe_options(dense, None, routing_replay=True)
    assert moe_options(model_spec_from_hf(QWEN3_MOE), None, routing_replay=True)["moe_enable_routing_replay"]


def routes_of(*tokens):
    """A sequence of len(tokens) + 1 tokens whose routes are `tokens` (each a list of MoE layers' expert lists)."""
    return Sequence(torch.arange(len(tokens) + 1), 1, torch.tensor(tokens, dtype=torch.uint8))


@pytest.mark.parametrize("bad,says", [
    ([[[0, 1, 2]], [[0, 1, 2]]], "routes of 1 MoE layers x 3 experts a token, but the model routes 2 MoE layers x top "
                                 "2: routes of another model"),  # top-k + 1
    ([[[0], [1]], [[0], [1]]], "routes of 2 MoE layers x 1 experts a token"),  # top-k - 1
    ([[[0, 1], [2, 3], [0, 1]], [[0, 1], [2, 3], [0, 1]]], "routes of 3 MoE layers x 2"),  # an extra layer column
    ([[[0, 1]], [[2, 3]]], "routes of 1 MoE layers x 2"),  # a layer too few
    ([[[0, 1], [2, 3]], [[0, 1], [2, 8]]], "token 1, MoE layer 1: expert id 8 is not one of the model's 8 experts "
                                           r"\(0 to 7\)"),
    ([[[0, 1], [2, 3]], [[5, 5], [2, 3]]], r"token 1, MoE layer 0 names an expert twice \(\[5, 5\]\): a token's top 2 "
                                           "experts are distinct"),
])
def test_routes_that_do_not_fit_the_model_are_refused_by_sequence(bad, says):
    """Issue 50, finding 2: the trainer replayed routes of any shape (top-k + 1 or - 1, a duplicated expert, an extra
    layer column) without a word; a layer too few or an id past the experts was a bare IndexError or RuntimeError."""
    from megatron_dapo.policy.routing_replay import RoutesInvalid, check_routes

    good = routes_of([[0, 1], [2, 3]], [[4, 5], [6, 7]])
    check_routes([good, Sequence(torch.arange(3), 1)], moe_layers=2, topk=2, experts=8)  # one without: not checked
    with pytest.raises(RoutesInvalid, match=f"^sequence 1: {says}"):
        check_routes([good, routes_of(*bad)], moe_layers=2, topk=2, experts=8)


def test_the_steps_metrics_carry_the_load_balancing_loss_when_there_is_one():
    from megatron_dapo.config import LossConfig
    from megatron_dapo.loop.step_metrics import train_metrics
    from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
    from megatron_dapo.policy.train_step import StepResult

    def update(balance):
        return StepResult(0.5, 1.0, 1e-6, {**dict.fromkeys(STAT_NAMES, 0.0), "num_tokens": 10.0}, units=10.0,
                          load_balancing_loss=balance)

    loss = LossConfig(old_logprobs="rollout")
    assert train_metrics([update(1.2), update(1.4)], None, None, loss)["moe/load_balancing_loss"] == \
        pytest.approx(1.3)
    assert "moe/load_balancing_loss" not in train_metrics([update(None)], None, None, loss)


def test_sglang_is_refused_a_mixture_of_experts_with_dense_layers_it_would_serve_as_sparse(tmp_path):
    """SGLang 0.5.23 gives every Qwen3-MoE layer experts: preflight (which `train` runs before anything starts)
    refuses a model with dense layers for SGLang, naming them, and passes one with experts everywhere."""
    import json

    from megatron_dapo.preflight import preflight
    from megatron_dapo.run_config import config_from_dict

    def preflight_with(model_config: dict, engine: str):
        (tmp_path / "config.json").write_text(json.dumps(model_config))
        cfg = config_from_dict({"model": {"path": str(tmp_path)},
                                "rollout": {"engine": engine, "server_device": "cpu"},
                                "data": {"train_path": "d.jsonl", "max_prompt_len": 32},
                                "algorithm": {"max_response_len": 64, "overlong_cache_len": 16},
                                "parallel": {"device": "cpu"}})
        return preflight(cfg)

    with pytest.raises(ConfigError, match=r"model.path: layers \[0, 2\] of this Qwen3MoeForCausalLM are dense"):
        preflight_with({**QWEN3_MOE, "decoder_sparse_step": 2}, "sglang")
    preflight_with(QWEN3_MOE, "sglang").raise_first_failure()
    preflight_with({**QWEN3_MOE, "decoder_sparse_step": 2}, "local").raise_first_failure()


def test_the_steps_metrics_carry_each_moe_layers_expert_load():
    from megatron_dapo.config import LossConfig
    from megatron_dapo.loop.step_metrics import train_metrics
    from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
    from megatron_dapo.policy.train_step import StepResult

    def update(load):
        return StepResult(loss=0.1, grad_norm=1.0, lr=1e-6, stats={k: 1.0 for k in STAT_NAMES}, units=1.0,
                          expert_load=load)

    loss = LossConfig(old_logprobs="rollout")
    out = train_metrics([update([1.0, 2.0]), update([1.5, 3.0])], None, None, loss)
    assert out["moe/expert_load_by_layer/00"] == 1.25 and out["moe/expert_load_by_layer/01"] == 2.5
    assert out["moe/expert_load/max"] == 2.5 and out["moe/expert_load/mean"] == 1.875
    assert not any(k.startswith("moe/expert_load") for k in train_metrics([update(None)], None, None, loss))


def test_the_steps_metrics_carry_the_routing_agreement_of_the_old_pass_or_else_the_first_update():
    from megatron_dapo.config import LossConfig
    from megatron_dapo.loop.step_metrics import train_metrics
    from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
    from megatron_dapo.policy.train_step import StepResult

    def update(agreement=None):
        return StepResult(loss=0.1, grad_norm=1.0, lr=1e-6, stats={k: 1.0 for k in STAT_NAMES}, units=1.0,
                          routing_agreement=agreement)

    loss = LossConfig(old_logprobs="rollout")
    out = train_metrics([update([1.0, 0.5]), update()], None, None, loss)
    assert out["moe/routing_agreement"] == 0.75 and out["moe/routing_agreement_by_layer/01"] == 0.5
    assert train_metrics([update()], None, None, loss, [0.25, 0.75])["moe/routing_agreement_by_layer/00"] == 0.25
    assert not any(k.startswith("moe/routing") for k in train_metrics([update()], None, None, loss))


GLM4_MOE = dict(architectures=["Glm4MoeForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=96,
                rms_norm_eps=1e-5, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
                num_nextn_predict_layers=1)


def test_glm_style_routing_is_read_into_megatron_cores_options():
    from megatron_dapo.policy.model import moe_options

    spec = model_spec_from_hf(GLM4_MOE)
    assert spec.moe_layers == (False, True, True, True) and spec.qk_layernorm and spec.qkv_bias
    assert (spec.rotary_percent, spec.shared_expert_ffn_hidden_size, spec.mtp_layers) == (0.5, 32, 1)
    options = moe_options(spec, None)
    assert {k: options[k] for k in ("moe_router_score_function", "moe_router_enable_expert_bias",
                                    "moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk",
                                    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                                    "moe_layer_freq", "moe_aux_loss_coeff")} == {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
        "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 32,
        "moe_layer_freq": [0, 1, 1, 1], "moe_aux_loss_coeff": 0.0}
    # older configs keep partial_rotary_factor at the top level
    top = {k: v for k, v in GLM4_MOE.items() if k != "rope_parameters"}
    assert model_spec_from_hf({**top, "partial_rotary_factor": 0.5, "rope_theta": 1e6}).rotary_percent == 0.5
    # the expert bias and the shared expert in the names, the bias kept in fp32
    names = megatron_names(spec)
    assert "decoder.layers.1.mlp.router.expert_bias" in names and "decoder.layers.0.mlp.router.expert_bias" not in names
    assert hf_names("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", spec) == [
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert tp_dim("decoder.layers.1.mlp.shared_experts.linear_fc2.weight") == 1
    assert hf_shape("model.layers.1.mlp.gate.e_score_correction_bias", spec) == (8,)


@pytest.mark.parametrize("override,message", [
    (dict(n_group=3), "n_group: 3 does not divide n_routed_experts 8"),
    (dict(num_experts_per_tok=4), "n_group: grouped routing with num_experts_per_tok 4 and topk_group 1"),
    (dict(norm_topk_prob=False), "norm_topk_prob: false is not supported with sigmoid routing"),
    (dict(topk_group=3), r"topk_group: must be a whole number in \[1, 2\]"),
    (dict(first_k_dense_replace=4), r"first_k_dense_replace: must be a whole number in \[0, 3\]"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor: must be a finite number > 0"),
    (dict(n_routed_experts=None), "n_routed_experts: missing"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1875}), "partial_rotary_factor: must be in"),
])
def test_bad_glm_config_names_the_key(override, message):
    config = {k: v for k, v in {**GLM4_MOE, **override}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        model_spec_from_hf(config)


def test_a_checkpoints_multi_token_prediction_layer_is_left_out(tmp_path, caplog):
    from safetensors.torch import save_file

    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint

    spec = model_spec_from_hf(GLM4_MOE)
    tensors = {n: torch.zeros(hf_shape(n, spec)) for n in expected_hf_names(spec)}
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)  # GLM-4.5's MTP layer, after the 4 decoder's
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(__import__("json").dumps(GLM4_MOE))
    HFCheckpoint(tmp_path).validate(spec)
    assert "leaving out its 1 multi-token prediction layer(s) (model.layers.4 on" in caplog.text
    tensors["model.layers.5.eh_proj.weight"] = torch.zeros(64, 128)  # past it: another model
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match="model.layers.5.eh_proj.weight' is not part of a Glm4MoeForCausalLM"):
        HFCheckpoint(tmp_path).validate(spec)


def test_qwen2_moes_shared_expert_and_its_gate_are_read_and_mapped():
    from megatron_dapo.policy.model import moe_options

    spec = model_spec_from_hf({**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False,
                               "shared_expert_intermediate_size": 48})
    assert (spec.shared_expert_ffn_hidden_size, spec.shared_expert_gate, spec.qkv_bias) == (48, True, True)
    options = moe_options(spec, None)
    assert (options["moe_shared_expert_intermediate_size"], options["moe_shared_expert_gate"],
            options["moe_router_pre_softmax"]) == (48, True, True)  # the top k of the softmax over all, kept so
    assert hf_names("decoder.layers.2.mlp.shared_experts.linear_fc2.weight", spec) == [
        "model.layers.2.mlp.shared_expert.down_proj.weight"]
    assert hf_names("decoder.layers.2.mlp.shared_experts.gate_weight", spec) == [
        "model.layers.2.mlp.shared_expert_gate.weight"]
    assert hf_shape("model.layers.2.mlp.shared_expert_gate.weight", spec) == (1, 64)
    assert hf_shape("model.layers.2.mlp.shared_expert.up_proj.weight", spec) == (48, 64)
    assert tp_dim("decoder.layers.2.mlp.shared_experts.gate_weight") is None

