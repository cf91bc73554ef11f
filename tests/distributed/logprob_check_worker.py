"""torchrun worker: the start-up check of servers given by URL (rollout/logprob_check.py) at TP x PP.

argv: OUT_JSON MODEL_DIR TP PP CASE...; each CASE is URL@TEMPERATURE. Global rank 0 holds the engine, every rank
recomputes. Writes from global rank 0 {CASE: {"accepted", "message", "diff_tempered", "diff_untempered", "tokens",
"same_on_every_rank"}}.
"""

import json
import sys

import torch.distributed as dist
from tiny_models import PARITY_DTYPE

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.forward import logprob_recomputer
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.rollout.logprob_check import check_engine_logprobs
from megatron_dapo.rollout.sglang_engine import SGLangEngine


def main(out_json, model_dir, tp, pp, *cases):
    from megatron.core import parallel_state

    parallel = ParallelConfig(tensor_parallel=int(tp), pipeline_parallel=int(pp), device="cpu")
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE)
    load_hf_weights(model, ckpt.get, spec, parallel)
    model.train()
    recompute = logprob_recomputer(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                                   max_tokens_per_micro_batch=512, device=runtime.device)
    results = {}
    for case in cases:
        url, temperature = case.rsplit("@", 1)
        engine = SGLangEngine(url, max_server_restarts=0) if dist.get_rank() == 0 else None
        try:
            a = check_engine_logprobs(engine, recompute, temperature=float(temperature))
            result = {"accepted": True, "message": None, "diff_tempered": a.diff_tempered,
                      "diff_untempered": a.diff_untempered, "tokens": a.tokens}
        except ConfigError as e:
            result = {"accepted": False, "message": str(e)}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, result)
        result["same_on_every_rank"] = all(r == every[0] for r in every)
        result["model_left_training"] = model.training
        results[case] = result
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
