"""torchrun worker: the Megatron policy recomputes the log-probs of tokens SGLang sampled.

argv: OUT_JSON MODEL_DIR TP SAMPLES_JSON:TEMPERATURE...; each SAMPLES_JSON holds [{prompt, output, logprobs}, ...]
sampled at its TEMPERATURE (one start of the ranks for them all). Writes {TEMPERATURE: {"max_abs_diff",
"max_abs_diff_untempered", "tokens"}} from global rank 0 (a last-stage rank when PP = 1): the largest
|SGLang - policy| at TEMPERATURE (the old log-probs the trainer computes), and at temperature 1.
"""

import json
import sys

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model


def main(out_json, model_dir, tp, *sampled):
    parallel = ParallelConfig(tensor_parallel=int(tp), device="cpu")
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    load_hf_weights(model, ckpt.get, spec, parallel)

    def max_diff(samples: list[dict], t: float) -> float:
        seqs = [Sequence(torch.tensor(s["prompt"] + s["output"]), len(s["prompt"])) for s in samples]
        out = response_logprobs(model.eval(), seqs, vocab_size=spec.vocab_size,
                                max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=512,
                                device=runtime.device, temperature=t)
        return max((o[0].double().cpu() - torch.tensor(s["logprobs"], dtype=torch.float64)).abs().max().item()
                   for o, s in zip(out, samples))

    results = {}
    for entry in sampled:
        samples_json, temperature = entry.rsplit(":", 1)
        samples = json.loads(open(samples_json).read())
        results[temperature] = {"max_abs_diff": max_diff(samples, float(temperature)),
                                "max_abs_diff_untempered": max_diff(samples, 1.0),
                                "tokens": sum(len(s["output"]) for s in samples)}
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
