"""torchrun worker: the Megatron policy recomputes the log-probs of tokens SGLang sampled.

argv: OUT_JSON MODEL_DIR SAMPLES_JSON TP [TEMPERATURE]; SAMPLES_JSON holds [{prompt, output, logprobs}, ...] sampled
at TEMPERATURE (default 1). Writes {"max_abs_diff", "max_abs_diff_untempered", "tokens"} from global rank 0 (a
last-stage rank when PP = 1): the largest |SGLang - policy| at TEMPERATURE (the old log-probs the trainer computes),
and at temperature 1.
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


def main(out_json, model_dir, samples_json, tp, temperature="1.0"):
    parallel = ParallelConfig(tensor_parallel=int(tp), device="cpu")
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    load_hf_weights(model, ckpt.get, spec, parallel)
    samples = json.loads(open(samples_json).read())
    seqs = [Sequence(torch.tensor(s["prompt"] + s["output"]), len(s["prompt"])) for s in samples]

    def max_diff(t: float) -> float:
        out = response_logprobs(model.eval(), seqs, vocab_size=spec.vocab_size,
                                max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=512,
                                device=runtime.device, temperature=t)
        return max((o[0].double().cpu() - torch.tensor(s["logprobs"], dtype=torch.float64)).abs().max().item()
                   for o, s in zip(out, samples))

    diff = max_diff(float(temperature))
    untempered = max_diff(1.0)
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump({"max_abs_diff": diff, "max_abs_diff_untempered": untempered,
                       "tokens": sum(len(s["output"]) for s in samples)}, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
