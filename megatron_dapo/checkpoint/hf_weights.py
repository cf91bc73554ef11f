"""Copy Hugging Face tensors into a Megatron model stage, through the mapping in hf_mapping; into a policy being
trained, with its optimizer's master copy (load_policy_weights)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megatron_dapo.checkpoint.hf_mapping import MappingError, megatron_shard, renumber_expert
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.policy.model import named_weights, padded_vocab_size
from megatron_dapo.policy.train_step import PolicyTrainer

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A stage's parameter name with its layer index counted over the whole pipeline, and an expert's index over
    all expert-parallel ranks."""
    name = _LOCAL_LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)
    return renumber_expert(name, expert_offset)


def layer_offset(spec: ModelSpec, parallel: ParallelConfig, pp_rank: int) -> int:
    return pp_rank * (spec.num_layers // parallel.pipeline_parallel)


def expert_offset(spec: ModelSpec, parallel: ParallelConfig, ep_rank: int) -> int:
    """The global index of expert-parallel rank `ep_rank`'s first expert (megatron-core deals them in order)."""
    return ep_rank * (spec.num_experts // parallel.expert_parallel)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, get: Callable[[str], torch.Tensor], spec: ModelSpec,
                    parallel: ParallelConfig) -> None:
    """Fill every weight of this rank's model stage (policy.model.named_weights) from `get(hf_name)`."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    offset = layer_offset(spec, parallel, parallel_state.get_pipeline_model_parallel_rank())
    experts = expert_offset(spec, parallel, parallel_state.get_expert_model_parallel_rank())
    vocab = padded_vocab_size(spec.vocab_size, parallel.tensor_parallel)
    for name, param in named_weights(model):
        mname = global_name(name, offset, experts)
        shard = megatron_shard(mname, get, spec, tp_rank=tp_rank, tp_size=parallel.tensor_parallel,
                               padded_vocab_size=vocab)
        if shard.shape != param.shape:
            raise MappingError(f"{mname}: shard shape {tuple(shard.shape)} does not fit the model's {tuple(param.shape)}")
        param.copy_(shard)


def load_policy_weights(policy: PolicyTrainer, get: Callable[[str], torch.Tensor]) -> None:
    """The one way to put Hugging Face weights into a policy being trained: into its model stage, then into its
    optimizer's fp32 master copy. A bf16 optimizer copied the parameters when it was built (the random
    initialisation), and its first step would write that copy back over the loaded weights; an fp32 optimizer's
    masters are the parameters themselves. Call it before a resume, which restores the masters from the checkpoint
    (refreshing them from the bf16 parameters after that would round them)."""
    load_hf_weights(policy.module, get, policy.spec, policy.parallel)
    policy.optimizer.reload_model_params()
