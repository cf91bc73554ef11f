"""A tiny Qwen2 policy (or a Qwen3-MoE one) and its tokenizer, made from scratch for the CPU demo (nothing is
downloaded).

The tokenizer is byte-level BPE trained on the task's own text, with digits always split into single
tokens (so numbers are spelled digit by digit) and a minimal chat template; the model has random
weights. Both are saved as one Hugging Face folder, the format the trainer and SGLang load.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def train_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path, corpus: list[str], *, seed: int, hidden: int = 128, layers: int = 4, heads: int = 4,
                    max_positions: int = 64, moe: bool = False):
    """Save a random tiny Qwen2 (with `moe`, a Qwen3-MoE: 8 experts of width `hidden`, top 2, in every layer) and a
    tokenizer trained on `corpus` to `path`; returns the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = train_tokenizer(corpus, vocab_size=320)
    torch.manual_seed(seed)
    shape = dict(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=len(tokenizer),
                 max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if moe:
        config = Qwen3MoeConfig(**shape, head_dim=hidden // heads, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=hidden, norm_topk_prob=True, router_aux_loss_coef=0.0,
                                architectures=["Qwen3MoeForCausalLM"])
        model = Qwen3MoeForCausalLM(config).float()
    else:
        config = Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"])
        model = Qwen2ForCausalLM(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer
