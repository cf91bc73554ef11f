"""torchrun worker: megatron-core's own dist_checkpointing.save of Hugging Face models, each at its own
TP x EP x PP, the references the streaming converter's files are compared with.

argv: HF_DIR=OUT_DIR@TP,EP,PP... (world size a multiple of TP x PP); every model in one process start."""

import sys

from megatron.core import parallel_state

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.checkpoint.mcore_checkpoint import save_model
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model


def main(*models):
    for model_arg in models:
        dirs, layout = model_arg.rsplit("@", 1)
        hf_dir, out_dir = dirs.split("=", 1)
        tp, ep, pp = map(int, layout.split(","))
        ckpt = HFCheckpoint(hf_dir)
        spec = model_spec_from_hf(ckpt.config)
        # A mixture of experts builds at TP > 1 only with sequence parallelism, which changes no stored tensor.
        parallel = ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp,
                                  sequence_parallel=spec.is_moe and tp > 1, device="cpu")
        init_runtime(parallel)
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(),
                            params_dtype=ckpt.get("model.embed_tokens.weight").dtype, initialize=False)
        load_hf_weights(model, ckpt.get, spec, parallel)
        save_model(model, out_dir)
        reset_parallel_layout()
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
