"""Single-process pieces of the policy: config reading, the HF mapping, log-probs, micro-batching."""

import pytest
import torch

from megatron_dapo.checkpoint.hf_mapping import (
    MappingError,
    hf_names,
    hf_shape,
    hf_tensors,
    expected_hf_names,
    megatron_names,
    megatron_shard,
)
from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.policy import logprobs as logprobs_module
from megatron_dapo.policy.batch import Sequence, check_sequences, micro_batches, plan_micro_batches
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.logprobs import vocab_parallel_logprobs
from megatron_dapo.policy.model import check_divisibility, padded_vocab_size

QWEN2 = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=96,
             rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})


def test_spec_from_qwen2_and_llama_configs():
    spec = model_spec_from_hf(QWEN2)
    assert (spec.num_query_groups, spec.head_dim, spec.rope_theta, spec.qkv_bias) == (2, 16, 1e6, True)
    llama = model_spec_from_hf({**QWEN2, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                                "rope_parameters": None, "tie_word_embeddings": True})
    assert (llama.qkv_bias, llama.rope_theta, llama.tie_word_embeddings) == (False, 5e5, True)
    qwen3 = model_spec_from_hf({**QWEN2, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_layernorm and qwen3.head_dim == 32


def test_llama3_rope_scaling_is_read_as_transformers_reads_it():
    from megatron_dapo.policy.hf_config import Llama3RopeScaling

    # Llama 3.1's published config.json: rope_scaling beside a top-level rope_theta
    llama31 = {**QWEN2, "architectures": ["LlamaForCausalLM"], "rope_parameters": None, "rope_theta": 5e5,
               "max_position_embeddings": 131072,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    spec = model_spec_from_hf(llama31)
    assert (spec.rope_theta, spec.rope_scaling) == (5e5, Llama3RopeScaling(8.0, 1.0, 4.0, 8192))
    # transformers 5's rope_parameters (theta inside); without original_max_position_embeddings transformers takes
    # max_position_embeddings
    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}
    spec = model_spec_from_hf({**llama31, "rope_scaling": None, "rope_parameters": params})
    assert (spec.rope_theta, spec.rope_scaling) == (5e5, Llama3RopeScaling(32.0, 1.0, 4.0, 131072))
    # Both given: transformers takes rope_scaling whole, theta from the top level
    spec = model_spec_from_hf({**llama31, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert (spec.rope_theta, spec.rope_scaling) == (5e5, Llama3RopeScaling(8.0, 1.0, 4.0, 8192))
    assert model_spec_from_hf(QWEN2).rope_scaling is None


@pytest.mark.parametrize("override,message", [
    (dict(architectures=["GPT2LMHeadModel"]), "architectures: .*not supported"),
    (dict(architectures=None), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_key_value_heads: 3 does not divide"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     r"rope_parameters.rope_type: 'yarn' is not supported; supported: default, llama3"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling.rope_type: 'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     r"rope_scaling.rope_type: 'longrope' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     r"rope_scaling.high_freq_factor: missing \(rope_type llama3 needs factor, low_freq_factor, high_freq_factor\)"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_bad_hf_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        model_spec_from_hf({**QWEN2, **override})


def test_missing_config_key():
    cfg = dict(QWEN2)
    del cfg["rms_norm_eps"]
    with pytest.raises(ConfigError, match="rms_norm_eps: missing from config.json"):
        model_spec_from_hf(cfg)


def test_config_path_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        model_spec_from_hf(tmp_path)


@pytest.mark.parametrize("tp,pp,key", [(8, 1, "num_attention_heads"), (1, 3, "num_hidden_layers")])
def test_sizes_that_do_not_divide_are_refused(tp, pp, key):
    with pytest.raises(ConfigError, match=f"{key}: .* not divisible by parallel"):
        check_divisibility(model_spec_from_hf(QWEN2), ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))


def test_query_groups_must_divide_by_tp():
    spec = model_spec_from_hf({**QWEN2, "num_attention_heads": 8, "hidden_size": 128, "num_key_value_heads": 2})
    with pytest.raises(ConfigError, match="num_key_value_heads: 2 is not divisible by parallel.tensor_parallel = 4"):
        check_divisibility(spec, ParallelConfig(tensor_parallel=4))


@pytest.mark.parametrize("kw,message", [
    (dict(tensor_parallel=0), "parallel.tensor_parallel"),
    (dict(device="tpu"), "parallel.device"),
    (dict(context_parallel=0), "parallel.context_parallel"),
])
def test_bad_parallel_config(kw, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kw)


def test_world_size_must_divide():
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        ParallelConfig(tensor_parallel=4).data_parallel(6)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_mapping_round_trip_is_exact(tp, tied):
    spec = model_spec_from_hf({**QWEN2, "tie_word_embeddings": tied})
    g = torch.Generator().manual_seed(0)
    hf = {}
    names = megatron_names(spec)
    for mname in names:
        for n in hf_names(mname, spec):
            hf.setdefault(n, torch.randn(hf_shape(n, spec), generator=g))
    vocab = padded_vocab_size(spec.vocab_size, tp)
    back = {}
    for mname in names:
        shards = [megatron_shard(mname, hf.__getitem__, spec, tp_rank=r, tp_size=tp, padded_vocab_size=vocab)
                  for r in range(tp)]
        back.update(hf_tensors(mname, shards, spec))
    assert back.keys() == hf.keys() == expected_hf_names(spec)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_layout_groups_heads():
    spec = model_spec_from_hf(QWEN2)  # 4 heads, 2 groups, head_dim 16
    d = spec.head_dim
    q = torch.arange(4 * d, dtype=torch.float32)[:, None].expand(-1, 64)
    k = 1000 + torch.arange(2 * d, dtype=torch.float32)[:, None].expand(-1, 64)
    v = 2000 + torch.arange(2 * d, dtype=torch.float32)[:, None].expand(-1, 64)
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    rank1 = megatron_shard("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, spec, tp_rank=1,
                           tp_size=2, padded_vocab_size=384)[:, 0]
    # Rank 1 holds query group 1: its two q heads, then its k head, then its v head.
    expected = torch.cat([q[2 * d:4 * d, 0], k[d:2 * d, 0], v[d:2 * d, 0]])
    assert torch.equal(rank1, expected)


def test_mapping_errors():
    spec = model_spec_from_hf(QWEN2)
    with pytest.raises(MappingError, match="no Hugging Face counterpart"):
        hf_names("decoder.layers.0.mystery.weight", spec)
    bad = {"model.norm.weight": torch.zeros(65)}
    with pytest.raises(MappingError, match=r"model.norm.weight: shape \(65,\) disagrees with config.json"):
        megatron_shard("decoder.final_layernorm.weight", bad.__getitem__, spec, tp_rank=0, tp_size=1,
                       padded_vocab_size=384)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("inplace", [False, True])
def test_logprobs_match_full_softmax_with_padding_and_chunks(monkeypatch, inplace, temperature, dtype):
    """log p and entropy of softmax(x / T), and d log p / dx, against float64 log_softmax(x / T) and autograd."""
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 7 * 384)  # several chunks
    g = torch.Generator().manual_seed(0)
    vocab, padded = 300, 384
    logits = (3 * torch.randn(40, padded, generator=g, dtype=torch.float64)).to(dtype).double()
    logits[:, vocab:] = 1e4  # padding columns must be ignored whatever they hold
    targets = torch.randint(0, vocab, (40,), generator=g)
    w = torch.randn(40, generator=g, dtype=torch.float64)
    ref = logits[:, :vocab].clone().requires_grad_()
    ref_logp_all = torch.log_softmax(ref / temperature, -1)
    ref_logp = ref_logp_all.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref_logp_all.exp() * ref_logp_all).sum(-1)
    (ref_logp * w).sum().backward()
    x = logits.to(dtype).requires_grad_()
    work = x * 1.0  # a non-leaf the in-place backward may overwrite
    logp, ent = vocab_parallel_logprobs(work, targets, vocab_start=0, vocab_size=vocab, inplace_backward=inplace,
                                        temperature=temperature)
    (logp * w.to(dtype)).sum().backward()
    assert logp.dtype == ent.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=0, atol=10 * tol)
    assert not ent.requires_grad
    torch.testing.assert_close(x.grad[:, :vocab].double(), ref.grad, rtol=0, atol=tol)
    assert torch.all(x.grad[:, vocab:] == 0)
    if temperature != 1.0:  # the temperature changes every value the test looks at
        plain = torch.log_softmax(ref.detach(), -1).gather(1, targets[:, None]).squeeze(1)
        assert (plain - logp.double()).abs().max() > 0.1


def test_bad_temperatures_are_refused():
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(30, 128, generator=g)
    targets = torch.randint(0, 100, (30,), generator=g)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
            vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=100, temperature=bad)


def test_logprobs_bad_shapes():
    with pytest.raises(ValueError, match="logits must be"):
        vocab_parallel_logprobs(torch.zeros(3, 4, 5), torch.zeros(3, dtype=torch.long), vocab_start=0, vocab_size=5)


def test_micro_batches_respect_the_budget_and_keep_every_token():
    g = torch.Generator().manual_seed(0)
    lens = [(3, 10), (2, 50), (5, 5), (1, 30), (4, 4), (2, 61)]
    seqs = [Sequence(torch.randint(0, 50, (p + r,), generator=g), p) for p, r in lens]
    mbs = micro_batches(seqs, max_tokens=130)
    assert sorted(i for mb in mbs for i in mb.sample_index) == list(range(6))
    for mb in mbs:
        assert mb.input_ids.numel() <= 130
        flat_ids = mb.input_ids.reshape(-1)
        # each response token is the target at its position, and the next input token
        for row, (i, n) in enumerate(zip(mb.sample_index, mb.response_lens)):
            assert n == seqs[i].response_len
        assert torch.equal(mb.targets[mb.response_positions], flat_ids[mb.response_positions + 1])
    assert plan_micro_batches([10, 10, 10], 30) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="more than max_tokens_per_micro_batch"):
        plan_micro_batches([10, 40], 30)


@pytest.mark.parametrize("seq,message", [
    (Sequence(torch.zeros(200, dtype=torch.long), 5), "exceed the model's max_position_embeddings 96"),
    (Sequence(torch.zeros(10, dtype=torch.long), 10), "prompt_len 10 must be in"),
    (Sequence(torch.zeros(10, dtype=torch.int32), 2), "1-D int64"),
])
def test_bad_sequences(seq, message):
    with pytest.raises(ValueError, match=message):
        check_sequences([seq], max_positions=96)
