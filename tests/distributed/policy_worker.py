"""torchrun worker: the Megatron policy's log-probs at several TP x PP layouts against transformers.

Writes one JSON per rank into the folder given as argv[1]: {case: {max_abs_logp, max_abs_entropy}}
from the ranks that hold results (last pipeline stage).
"""

import json
import os
import sys

import torch
from tiny_models import hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.runtime import init_runtime, reset_parallel_layout, shutdown_runtime

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def logprob_errors(model, spec, runtime, seqs, ref) -> dict | None:
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                            max_tokens_per_micro_batch=130, device=runtime.device)
    if out is None:
        return None
    return {
        "max_abs_logp": max((o[0].double() - r[0]).abs().max().item() for o, r in zip(out, ref)),
        "max_abs_entropy": max((o[1].double() - r[1]).abs().max().item() for o, r in zip(out, ref)),
        "tokens": sum(o[0].numel() for o in out),
    }


def build_loaded(spec, parallel, get):
    """This rank's stage, filled from get(hf_name)."""
    from megatron.core import parallel_state

    runtime = init_runtime(parallel)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    load_hf_weights(model, get, spec, parallel)
    return model.eval(), runtime


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
        reset_parallel_layout()
    return results


def vocab_parallel_gradient_case(world: int) -> dict:
    """Log-prob gradients with the vocabulary split over TP ranks equal the full-softmax gradients."""
    from megatron.core import parallel_state

    from megatron_dapo.policy.logprobs import vocab_parallel_logprobs

    tp = 2 if world % 2 == 0 else 1
    init_runtime(ParallelConfig(tensor_parallel=tp, device="cpu"))
    g = torch.Generator().manual_seed(3)
    vocab, padded = 300, 384
    full = torch.randn(50, padded, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (50,), generator=g)
    weights = torch.randn(50, generator=g, dtype=torch.float64)
    ref = full[:, :vocab].clone().requires_grad_()
    (torch.log_softmax(ref, -1).gather(1, targets[:, None]).squeeze(1) * weights).sum().backward()
    rank = parallel_state.get_tensor_model_parallel_rank()
    cols = padded // tp
    local = full[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()
    logp, _ = vocab_parallel_logprobs(local, targets, vocab_start=rank * cols, vocab_size=vocab,
                                      group=parallel_state.get_tensor_model_parallel_group())
    (logp * weights).sum().backward()
    expected = torch.cat([ref.grad, torch.zeros(50, padded - vocab, dtype=torch.float64)], 1)
    err = (local.grad - expected[:, rank * cols:(rank + 1) * cols]).abs().max().item()
    reset_parallel_layout()
    return {f"logprob-grad-tp{tp}-rank{rank}": {"max_abs_grad": err}}


def main(out_dir: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    seqs = sequences()
    for kind in ("qwen2", "qwen2_tied", "qwen3", "llama"):
        hf, cfg = hf_model(kind)
        ref = hf_response_logprobs(hf, seqs)
        spec = model_spec_from_hf(cfg)
        state = hf.state_dict()
        for tp, pp in LAYOUTS:
            if world % (tp * pp):
                continue
            model, runtime = build_loaded(spec, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu"),
                                          state.__getitem__)
            errors = logprob_errors(model, spec, runtime, seqs, ref)
            if errors is not None:
                results[f"{kind}-tp{tp}-pp{pp}"] = errors
            reset_parallel_layout()
    results.update(vocab_parallel_gradient_case(world))
    results.update(folder_round_trip_cases(out_dir, seqs))
    with open(os.path.join(out_dir, f"rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1])
