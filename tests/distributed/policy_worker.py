"""torchrun worker: the Megatron policy's log-probs at several TP x PP layouts against transformers.

Writes one JSON per rank into the folder given as argv[1]: {case: {max_abs_logp, max_abs_entropy}}
from the ranks that hold results (last pipeline stage).
"""

import dataclasses
import json
import os
import sys

import torch
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# kind -> the TP x PP layouts it is checked at: Llama 3.1 / 3.2's rotary scaling whole and at one split each
KIND_LAYOUTS = {**{kind: LAYOUTS for kind in ("qwen2", "qwen2_tied", "qwen3", "llama")},
                "llama31": [(1, 1), (2, 2)], "llama32": [(1, 1), (1, 2)]}


def logprob_errors(model, spec, runtime, seqs, ref) -> dict | None:
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                            max_tokens_per_micro_batch=130, device=runtime.device)
    if out is None:
        return None
    return {
        "max_abs_logp": max((o[0].double().cpu() - r[0]).abs().max().item() for o, r in zip(out, ref)),
        "max_abs_entropy": max((o[1].double().cpu() - r[1]).abs().max().item() for o, r in zip(out, ref)),
        "tokens": sum(o[0].numel() for o in out),
    }


def build_loaded(spec, parallel, get):
    """This rank's stage, filled from get(hf_name)."""
    from megatron.core import parallel_state

    runtime = init_runtime(parallel)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE)
    load_hf_weights(model, get, spec, parallel)
    return model.eval(), runtime


class TeNamed(torch.nn.Module):
    """A local-spec stage whose parameters answer to Transformer Engine's names, as a TE-built stage's do: the
    norms fused into the next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`)."""

    TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        object.__setattr__(self, "stage", model)  # not a submodule: its own names stay hidden

    def named_parameters(self, *args, **kwargs):
        for name, p in self.stage.named_parameters():
            head, _, tail = name.rpartition(".layers.")
            if head:
                layer, rest = tail.split(".", 1)
                name = f"{head}.layers.{layer}.{self.TE.get(rest, rest)}"
            yield name, p


def te_named_cases(model, spec, parallel, ckpt, out_dir, kind) -> dict:
    """Loading HF weights into TE-named parameters, then export and the weight sync's buckets from them, give the
    source checkpoint's bytes."""
    import torch.distributed as dist

    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.weight_sync.buckets import iter_hf_buckets

    from megatron_dapo.checkpoint.hf_weights import load_hf_weights

    te = TeNamed(model)
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in te.named_parameters())
    with torch.no_grad():  # HF -> TE-named parameters first, as a run starts; the export below checks what arrived
        for _, p in te.named_parameters():
            p.zero_()
    load_hf_weights(te, ckpt.get, spec, parallel)
    exported = os.path.join(out_dir, f"exported_te_{kind}")
    export_hf_checkpoint(te, spec, parallel, exported, hf_config=ckpt.config, max_shard_bytes=50_000)
    bucketed = {name: t.cpu().clone()
                for b in iter_hf_buckets(te, spec, parallel, 20_000) for name, t in b.named_tensors()}
    if dist.get_rank() != 0:
        return {}
    back = HFCheckpoint(exported)
    return {f"te-names-{kind}": {
        "export_bitwise": sorted(back.names()) == sorted(ckpt.names())
        and all(torch.equal(back.get(n), ckpt.get(n)) for n in ckpt.names()),
        "sync_bitwise": sorted(bucketed) == sorted(ckpt.names())
        and all(torch.equal(bucketed[n], ckpt.get(n)) for n in ckpt.names())}}


def folder_round_trip_cases(out_dir: str, seqs) -> dict:
    """HF folder -> the validating reader -> Megatron at TP=2 x PP=2 -> log-probs, and -> exported HF folder."""
    import torch.distributed as dist

    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint

    results = {}
    tp, pp = (2, 2) if dist.get_world_size() % 4 == 0 else (1, 1)
    for kind in ("qwen2_tied", "qwen2", "llama"):
        hf, _ = hf_model(kind, seed=4)
        src = os.path.join(out_dir, f"hf_{kind}")
        if dist.get_rank() == 0:
            hf.save_pretrained(src, max_shard_size="60KB")
        dist.barrier()
        ckpt = HFCheckpoint(src)
        spec = model_spec_from_hf(ckpt.config)
        ckpt.validate(spec)
        parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu")
        model, runtime = build_loaded(spec, parallel, ckpt.get)
        errors = logprob_errors(model, spec, runtime, seqs, hf_response_logprobs(hf, seqs))
        if errors is not None:
            results[f"folder-{kind}-tp{tp}-pp{pp}"] = errors
        exported = os.path.join(out_dir, f"exported_{kind}")
        export_hf_checkpoint(model, spec, parallel, exported, hf_config=ckpt.config, max_shard_bytes=50_000)
        if dist.get_rank() == 0:
            back = HFCheckpoint(exported)
            results[f"export-{kind}-tp{tp}-pp{pp}"] = {
                "same_names": sorted(back.names()) == sorted(ckpt.names()),
                "bitwise_equal": all(torch.equal(back.get(n), ckpt.get(n)) for n in ckpt.names()),
                "same_config": back.config == ckpt.config,
            }
        results.update(te_named_cases(model, spec, parallel, ckpt, out_dir, kind))
        reset_parallel_layout()
    return results


def vocab_parallel_gradient_case(world: int) -> dict:
    """Log-probs, entropies and log-prob gradients of softmax(x / T) with the vocabulary split over TP ranks equal
    the full-softmax ones (float64 log_softmax(x / T)), at temperature 1 and 0.7."""
    from megatron.core import parallel_state

    from megatron_dapo.policy.logprobs import vocab_parallel_logprobs

    tp = 2 if world % 2 == 0 else 1
    device = init_runtime(ParallelConfig(tensor_parallel=tp, device="cpu")).device
    g = torch.Generator().manual_seed(3)
    vocab, padded = 300, 384
    full = torch.randn(50, padded, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (50,), generator=g)
    weights = torch.randn(50, generator=g, dtype=torch.float64)
    rank = parallel_state.get_tensor_model_parallel_rank()
    cols = padded // tp
    results = {}
    for temperature, name in ((1.0, f"logprob-grad-tp{tp}-rank{rank}"), (0.7, f"logprob-grad-tp{tp}-t0.7-rank{rank}")):
        ref = full[:, :vocab].clone().requires_grad_()
        ref_all = torch.log_softmax(ref / temperature, -1)
        ref_logp = ref_all.gather(1, targets[:, None]).squeeze(1)
        (ref_logp * weights).sum().backward()
        local = full[:, rank * cols:(rank + 1) * cols].to(device).requires_grad_()
        logp, entropy = vocab_parallel_logprobs(local, targets.to(device), vocab_start=rank * cols, vocab_size=vocab,
                                                group=parallel_state.get_tensor_model_parallel_group(),
                                                temperature=temperature)
        (logp * weights.to(device)).sum().backward()
        expected = torch.cat([ref.grad, torch.zeros(50, padded - vocab, dtype=torch.float64)], 1)
        results[name] = {
            "max_abs_grad": (local.grad.cpu() - expected[:, rank * cols:(rank + 1) * cols]).abs().max().item(),
            "max_abs_logp": (logp.detach().cpu() - ref_logp.detach()).abs().max().item(),
            "max_abs_entropy": (entropy.cpu() + (ref_all.exp() * ref_all).sum(-1).detach()).abs().max().item(),
        }
    reset_parallel_layout()
    return results


def main(out_dir: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    seqs = sequences()
    for kind, layouts in KIND_LAYOUTS.items():
        hf, cfg = hf_model(kind)
        ref = hf_response_logprobs(hf, seqs)
        spec = model_spec_from_hf(cfg)
        state = hf.state_dict()
        cases = [(f"{kind}-tp{tp}-pp{pp}", spec, tp, pp) for tp, pp in layouts]
        if kind in ("llama31", "llama32"):  # the same weights without the rotary scaling: must not match
            cases.append((f"unscaled-{kind}-tp1-pp1", dataclasses.replace(spec, rope_scaling=None), 1, 1))
        for case, case_spec, tp, pp in cases:
            if world % (tp * pp):
                continue
            model, runtime = build_loaded(case_spec, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp,
                                                                    device="cpu"), state.__getitem__)
            errors = logprob_errors(model, case_spec, runtime, seqs, ref)
            if errors is not None:
                results[case] = errors
            reset_parallel_layout()
    results.update(vocab_parallel_gradient_case(world))
    results.update(folder_round_trip_cases(out_dir, seqs))
    with open(os.path.join(out_dir, f"rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1])
