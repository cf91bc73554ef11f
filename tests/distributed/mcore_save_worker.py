"""torchrun worker: megatron-core's own dist_checkpointing.save of Hugging Face models at TP x PP, the
references the streaming converter's files are compared with.

argv: TP PP HF_DIR=OUT_DIR... (world size TP x PP); every model in one process start."""

import sys

from megatron.core import parallel_state

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.checkpoint.mcore_checkpoint import save_model
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model


def main(tp, pp, *pairs):
    parallel = ParallelConfig(tensor_parallel=int(tp), pipeline_parallel=int(pp), device="cpu")
    init_runtime(parallel)
    for hf_dir, out_dir in (p.split("=", 1) for p in pairs):
        ckpt = HFCheckpoint(hf_dir)
        spec = model_spec_from_hf(ckpt.config)
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(),
                            params_dtype=ckpt.get("model.embed_tokens.weight").dtype, initialize=False)
        load_hf_weights(model, ckpt.get, spec, parallel)
        save_model(model, out_dir)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
