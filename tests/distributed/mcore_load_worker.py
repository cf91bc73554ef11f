"""torchrun worker: converted distributed checkpoints loaded at several layouts, log-probs vs transformers.

argv: OUT_DIR KIND=MCORE_DIR...; writes OUT_DIR/rank{r}.json with {kind: {layout: {max_abs_logp, tokens}}}.
Every checkpoint in one process start: the layouts are set up anew per model, the processes are not.
"""

import json
import os
import sys

from tiny_models import hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.mcore_checkpoint import load_model, read_meta
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model

# (TP, EP, PP) each model is loaded at: everything whole, and a dense model at the TP2 x PP2 it was converted at, a
# mixture of experts (converted at TP2 x EP2 x PP2) with each expert alone on its rank.
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 2)]
MOE_LAYOUTS = [(1, 1, 1), (1, 4, 1)]


def check(kind: str, mcore_dir: str) -> dict:
    from megatron.core import parallel_state

    hf, cfg = hf_model(kind)
    spec = model_spec_from_hf(cfg)
    seqs = sequences()
    ref = hf_response_logprobs(hf, seqs)
    meta = read_meta(mcore_dir)
    results = {}
    for tp, ep, pp in MOE_LAYOUTS if spec.is_moe else DENSE_LAYOUTS:
        parallel = ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, device="cpu")
        runtime = init_runtime(parallel)
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(), params_dtype=meta["dtype"])
        load_model(model, mcore_dir)
        out = response_logprobs(model.eval(), seqs, vocab_size=spec.vocab_size, max_positions=96,
                                max_tokens_per_micro_batch=130, device=runtime.device)
        if out is not None:
            results[f"tp{tp}-ep{ep}-pp{pp}"] = {
                "max_abs_logp": max((o[0].double().cpu() - r[0]).abs().max().item() for o, r in zip(out, ref)),
                "tokens": sum(o[0].numel() for o in out),
            }
        reset_parallel_layout()
    return results


def main(out_dir, *checkpoints):
    results = {kind: check(kind, mcore_dir) for kind, mcore_dir in (c.split("=", 1) for c in checkpoints)}
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
