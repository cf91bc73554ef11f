"""Tiny random-weight Hugging Face models and batches, identical on every rank that builds them."""

import torch
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 300  # not a multiple of 128: the padded vocabulary has columns to leave out
# Parity and invariance checks build the policy in float32: the device-faithful mode's default, bf16 as on a GPU,
# would bury a wrong mapping or a split that changes the sum under its rounding.
PARITY_DTYPE = torch.float32

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=96, rms_norm_eps=1e-5)


# Llama 3.1 and 3.2's rotary scaling (`rope_type: llama3`, low / high frequency factors 1 / 4) with the original
# length cut from 8192 to 32 and 64, so that it acts within the test sequences (up to 62 tokens): at head_dim 16 the
# rotations of wavelength between original / 4 and original are interpolated, the longer ones divided by factor.
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA31_ROPE = dict(LLAMA3_ROPE, rope_theta=50000.0, factor=8.0, original_max_position_embeddings=32)
LLAMA32_ROPE = dict(LLAMA3_ROPE, rope_theta=500000.0, factor=32.0, original_max_position_embeddings=64)

TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                mlp_only_layers=[1], router_aux_loss_coef=0.001)
# GLM-4.5's routing (DeepSeek-V3's): sigmoid scores with a per-expert bias for the choice, the best of n_group
# groups of experts first (each group by its top-2 scores), a shared expert, a routed scaling factor, a dense first
# layer, q/k norms, QKV biases, and rotary on half of each head
TINY_GLM = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0)


def hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen2":
        cfg = Qwen2Config(**TINY, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
        model = Qwen2ForCausalLM(cfg)
    elif kind == "qwen2_tied":
        cfg = Qwen2Config(**TINY, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
        model = Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # q/k RMSNorm, and a head_dim that is not hidden_size / heads
        cfg = Qwen3Config(**TINY, head_dim=24, architectures=["Qwen3ForCausalLM"])
        model = Qwen3ForCausalLM(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(**TINY, rope_theta=50000.0, architectures=["LlamaForCausalLM"])
        model = LlamaForCausalLM(cfg)
    elif kind == "llama31":
        cfg = LlamaConfig(**TINY, rope_parameters=dict(LLAMA31_ROPE), architectures=["LlamaForCausalLM"])
        model = LlamaForCausalLM(cfg)
    elif kind == "llama32":  # Llama 3.2 ties its embeddings
        cfg = LlamaConfig(**TINY, rope_parameters=dict(LLAMA32_ROPE), tie_word_embeddings=True,
                          architectures=["LlamaForCausalLM"])
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen3_moe":  # 4 experts, top 2, a dense layer among the sparse ones (mlp_only_layers)
        cfg = Qwen3MoeConfig(**TINY, **TINY_MOE, head_dim=24, architectures=["Qwen3MoeForCausalLM"])
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3_moe_sparse":  # experts in every layer, as Qwen3-30B-A3B and 235B-A22B have (and SGLang serves)
        cfg = Qwen3MoeConfig(**TINY, **{**TINY_MOE, "mlp_only_layers": []}, head_dim=24,
                             architectures=["Qwen3MoeForCausalLM"])
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen2_moe":  # a shared expert with its sigmoid gate; the top k not renormalised (Qwen1.5-MoE's)
        cfg = Qwen2MoeConfig(**TINY, **{**TINY_MOE, "norm_topk_prob": False}, shared_expert_intermediate_size=48,
                             architectures=["Qwen2MoeForCausalLM"])
        model = Qwen2MoeForCausalLM(cfg)
    elif kind == "glm4_moe":
        cfg = Glm4MoeConfig(**TINY, **TINY_GLM, architectures=["Glm4MoeForCausalLM"])
        model = Glm4MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    with torch.no_grad():  # biases are zero at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # routers decisive: no near-tie for rounding to flip
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: a bias that moves the choice
                b.copy_(0.3 * torch.randn_like(b))
    return model, cfg.to_dict()


def sequences(seed: int = 1, lengths=((5, 20), (3, 41), (9, 4), (2, 60), (7, 13))):
    """(prompt_len, response_len) pairs of very different lengths."""
    from megatron_dapo.policy.batch import Sequence

    g = torch.Generator().manual_seed(seed)
    return [Sequence(torch.randint(0, VOCAB, (p + r,), generator=g), p) for p, r in lengths]


@torch.no_grad()
def hf_response_logprobs(model, seqs):
    out = []
    for s in seqs:
        logits = model(s.tokens[None]).logits[0].double()
        logp_all = torch.log_softmax(logits, dim=-1)
        pos = torch.arange(s.prompt_len - 1, s.tokens.numel() - 1)
        logp = logp_all[pos].gather(1, s.tokens[s.prompt_len:, None]).squeeze(1)
        entropy = -(logp_all[pos].exp() * logp_all[pos]).sum(-1)
        out.append((logp, entropy))
    return out


CORPUS = [
    "What is 3 plus 4? Answer: 7", "Compute 12 times 3. The answer is \\boxed{36}.",
    "If x + 2 = 5 then x = 3", "The sum of the first ten odd numbers is 100",
    "A triangle has angles 30, 60 and 90 degrees", "Divide 81 by 9 to get 9",
] * 40


def save_with_tokenizer(path, kind: str = "qwen2", seed: int = 0):
    """A tiny random model and a byte-level BPE tokenizer trained here, saved as one HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    model, _ = hf_model(kind, seed)
    model.config.eos_token_id = fast.eos_token_id
    model.config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return fast
