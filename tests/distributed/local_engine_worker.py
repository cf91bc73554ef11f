"""torchrun worker (2 processes): the local engine refuses a policy split at TP=2.

argv: OUT_TXT; rank 0 writes the error message there.
"""

import sys

import torch.distributed as dist
from tiny_models import PARITY_DTYPE, hf_model

from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.rollout.local_engine import LocalEngine


def main(out_txt):
    parallel = ParallelConfig(tensor_parallel=2, device="cpu")
    runtime = init_runtime(parallel)
    spec = model_spec_from_hf(hf_model("qwen2")[1])
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    try:
        LocalEngine(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings, eos_token_ids=[0],
                    device=runtime.device)
    except ConfigError as e:
        message = str(e)
    else:
        raise AssertionError("LocalEngine accepted a TP=2 policy")
    if dist.get_rank() == 0:
        with open(out_txt, "w") as f:
            f.write(message)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
