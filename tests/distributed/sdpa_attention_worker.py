"""SdpaAttention against megatron-core's local DotProductAttention, module by module and in the whole model.

The helpers serve tests/test_sdpa_attention.py in-process (TP = 1); as a torchrun worker (argv: OUT_DIR)
it runs them at TP = WORLD_SIZE and writes rank{r}.json: {case: {what: max abs difference}}.
"""

import json
import os
import sys

import torch
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences

from megatron_dapo.policy.sdpa_attention import SdpaAttention

HEADS, GROUPS, HEAD_DIM = 4, 2, 16  # GQA: two query heads per KV head


def attention_config(tp: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
              kv_channels=HEAD_DIM, attention_dropout=0.0, hidden_dropout=0.0, tensor_model_parallel_size=tp,
              use_cpu_initialization=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True)
    return TransformerConfig(**{**kw, **overrides})


def attention_pair(config, softmax_scale=None):
    """(megatron's local DotProductAttention, SdpaAttention), built the way the local spec builds them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
              softmax_scale=softmax_scale)
    return DotProductAttention(**kw), SdpaAttention(**kw)


def random_qkv(sq: int, sk: int, b: int = 2, seed: int = 0):
    """Host q [sq, b, HEADS, hn], k / v [sk, b, GROUPS, hn], and output weights [sq, b, HEADS * hn]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(sk, b, GROUPS, HEAD_DIM, generator=g) for _ in range(2))
    return q, k, v, torch.randn(sq, b, HEADS * HEAD_DIM, generator=g)


def run_attention(module, q, k, v, w, device, mask=None):
    """Output and q / k / v gradients of sum(module(q, k, v) * w), computed on `device`, returned on the host."""
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = module(*leaves, None if mask is None else mask.to(device))
    (out * w.to(device)).sum().backward()
    return out.detach().cpu(), [t.grad.cpu() for t in leaves]


def attention_errors(device, tp: int = 1, tp_rank: int = 0, sq: int = 24, sk: int | None = None, mask=None,
                     softmax_scale=None) -> dict:
    """Max abs differences of SdpaAttention from DotProductAttention on this TP rank's heads."""
    q, k, v, w = random_qkv(sq, sk or sq)
    nh, ng = HEADS // tp, GROUPS // tp
    q, w = q[:, :, tp_rank * nh:(tp_rank + 1) * nh], w[..., tp_rank * nh * HEAD_DIM:(tp_rank + 1) * nh * HEAD_DIM]
    k, v = k[:, :, tp_rank * ng:(tp_rank + 1) * ng], v[:, :, tp_rank * ng:(tp_rank + 1) * ng]
    ref, new = attention_pair(attention_config(tp), softmax_scale)
    (ref_out, ref_grads), (out, grads) = (run_attention(m, q, k, v, w, device, mask) for m in (ref, new))
    return {"output": (out - ref_out).abs().max().item(),
            "grad": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))}


def use_megatron_attention(model) -> None:
    """Swap every layer's SdpaAttention for megatron's DotProductAttention (neither holds weights)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in model.decoder.layers:
        sdpa = layer.self_attention.core_attention
        assert isinstance(sdpa, SdpaAttention), type(sdpa)
        layer.self_attention.core_attention = DotProductAttention(
            config=sdpa.config, layer_number=sdpa.layer_number, attn_mask_type=sdpa.attn_mask_type,
            attention_type="self")


def logits_and_grads(model, ids, w, device):
    """Logits (this rank's vocabulary columns) and weight gradients of sum(logits * w) / tokens (a token
    mean, as the policy loss is, keeps the gradients O(1) and the float32 rounding under 1e-5)."""
    model.zero_grad(set_to_none=True)
    ids = ids.to(device)
    logits = model(ids, torch.arange(ids.shape[1], device=device).expand_as(ids), None)
    ((logits * w.to(device)).sum() / ids.numel()).backward()
    return logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def model_errors(kind: str, parallel, runtime) -> dict:
    """build_model (SDPA attention) against transformers' log-probs, and its logits and weight gradients
    against the same model with megatron's attention."""
    from megatron.core import parallel_state

    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model, padded_vocab_size

    hf, cfg = hf_model(kind)
    spec = model_spec_from_hf(cfg)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    load_hf_weights(model, hf.state_dict().__getitem__, spec, parallel)
    seqs = sequences()
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                            max_tokens_per_micro_batch=130, device=runtime.device)
    ref = hf_response_logprobs(hf, seqs)
    logp_err = max((o[0].double().cpu() - r[0]).abs().max().item() for o, r in zip(out, ref))

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, spec.vocab_size, (2, 40), generator=g)
    cols = padded_vocab_size(spec.vocab_size, parallel.tensor_parallel) // parallel.tensor_parallel  # this rank's
    w = torch.randn(2, 40, cols * parallel.tensor_parallel, generator=g)
    rank = parallel_state.get_tensor_model_parallel_rank()
    w = w[..., rank * cols:(rank + 1) * cols]
    sdpa_logits, sdpa_grads = logits_and_grads(model, ids, w, runtime.device)
    use_megatron_attention(model)
    ref_logits, ref_grads = logits_and_grads(model, ids, w, runtime.device)
    assert sdpa_grads.keys() == ref_grads.keys() and sdpa_grads
    return {"logp_vs_transformers": logp_err, "logits": (sdpa_logits - ref_logits).abs().max().item(),
            "grad": max((sdpa_grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)}


def main(out_dir: str) -> None:
    from megatron.core import parallel_state

    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime

    tp = int(os.environ["WORLD_SIZE"])
    parallel = ParallelConfig(tensor_parallel=tp, device="cpu")
    runtime = init_runtime(parallel)
    rank = parallel_state.get_tensor_model_parallel_rank()
    results = {f"attention-tp{tp}-rank{rank}": attention_errors(runtime.device, tp, rank)}
    for kind in ("qwen2", "qwen3"):
        results[f"model-{kind}-tp{tp}-rank{rank}"] = model_errors(kind, parallel, runtime)
    with open(os.path.join(out_dir, f"rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1])
