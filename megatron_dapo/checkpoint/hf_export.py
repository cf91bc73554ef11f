"""Gather a TP x PP (x EP) sharded Megatron model back into Hugging Face tensors, one tensor at a time.

Every rank walks the model's tensors in the same order. The data-parallel replica 0 of the stage
that holds a tensor all-gathers its tensor-parallel shards, turns them into HF tensors through the
mapping, and sends them to global rank 0 (or to each of a list of receiving ranks), which yields them.
An expert is whole on each rank of its expert-parallel rank's expert-data-parallel group: the first of
them sends it. Peak extra memory on a receiver is one full tensor. Used to export a Hugging Face
checkpoint from a live (or just loaded) model, and by the weight sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.hf_mapping import (
    expert_of,
    hf_names,
    hf_shape,
    hf_tensors,
    kept_dtype,
    megatron_names,
    renumber_expert,
    tp_dim,
    uses_te_names,
)
from megatron_dapo.checkpoint.hf_weights import expert_offset, layer_offset
from megatron_dapo.checkpoint.safetensors_io import CheckpointError, write_hf_checkpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.finite_weights import nonfinite_on_any_rank
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.policy.model import named_weights

_LAYER_PREFIX = "decoder.layers."


def _owner_stage(mname: str, spec: ModelSpec, parallel: ParallelConfig) -> int:
    if mname.startswith("embedding."):
        return 0
    if mname.startswith(_LAYER_PREFIX):
        layer = int(mname[len(_LAYER_PREFIX):].split(".", 1)[0])
        return layer // layer_offset(spec, parallel, 1)  # layers per stage
    return parallel.pipeline_parallel - 1  # final norm, output layer


def _owner(mname: str, spec: ModelSpec, parallel: ParallelConfig) -> tuple[int, int | None]:
    """(pipeline stage, expert-parallel rank) that holds `mname`; the second None for a tensor that is not an
    expert's."""
    expert = expert_of(mname)
    ep = None if expert is None else expert[0] // (spec.num_experts // parallel.expert_parallel)
    return _owner_stage(mname, spec, parallel), ep


def _local_name(mname: str, spec: ModelSpec, parallel: ParallelConfig, stage: int, ep: int | None) -> str:
    if ep is not None:
        mname = renumber_expert(mname, -expert_offset(spec, parallel, ep))
    if not mname.startswith(_LAYER_PREFIX):
        return mname
    layer, rest = mname[len(_LAYER_PREFIX):].split(".", 1)
    return f"{_LAYER_PREFIX}{int(layer) - layer_offset(spec, parallel, stage)}.{rest}"


def iter_hf_tensors(model: torch.nn.Module, spec: ModelSpec, parallel: ParallelConfig,
                    receivers: Sequence[int] = (0,)) -> Iterator[tuple[str, torch.Tensor]]:
    """On each global rank in `receivers`: (hf_name, full tensor in the model's params_dtype) for every
    tensor of the model. On other ranks: nothing, but every rank must iterate to the end (the gathers
    are collective)."""
    from megatron.core import parallel_state

    params = dict(named_weights(model))
    # Megatron keeps some tensors (norms) in fp32 whatever the model's dtype: export in the model's dtype (the
    # expert bias in fp32, as Hugging Face checkpoints keep it: kept_dtype).
    dtype = model.config.params_dtype
    device = next(iter(params.values())).device
    stage = parallel_state.get_pipeline_model_parallel_rank()
    first_dp = parallel_state.get_data_parallel_rank() == 0
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    first_expert_dp = parallel_state.get_expert_data_parallel_rank() == 0
    tp_group = parallel_state.get_tensor_model_parallel_group()
    me = dist.get_rank()
    mine = {(stage, None)} if first_dp and parallel_state.get_tensor_model_parallel_rank() == 0 else set()
    if spec.is_moe and first_expert_dp:
        mine.add((stage, ep_rank))
    sender = _senders(mine)
    for mname in megatron_names(spec, te_names=uses_te_names(params)):  # TE models fuse the norms' names
        owner = _owner(mname, spec, parallel)
        holds = stage == owner[0] and (first_dp if owner[1] is None else ep_rank == owner[1] and first_expert_dp)
        if holds:
            local = params[_local_name(mname, spec, parallel, *owner)].detach().to(kept_dtype(mname, dtype))
            if tp_dim(mname) is None or parallel.tensor_parallel == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(parallel.tensor_parallel)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            tensors = hf_tensors(mname, shards, spec)
        else:
            tensors = None
        for name in hf_names(mname, spec):
            if me == sender[owner]:
                for dst in receivers:
                    if dst != me:
                        dist.send(tensors[name].contiguous(), dst=dst)
                if me in receivers:
                    yield name, tensors[name]
            elif me in receivers:
                buf = torch.empty(hf_shape(name, spec), dtype=kept_dtype(mname, dtype), device=device)
                dist.recv(buf, src=sender[owner])
                yield name, buf


def _senders(mine: set) -> dict[tuple[int, int | None], int]:
    """(pipeline stage, expert-parallel rank or None) -> the global rank that sends those tensors: for a stage's
    other tensors, its data-parallel replica 0's tensor-parallel rank 0; for an expert-parallel rank's experts, its
    expert-data-parallel replica 0. Collective: every rank says which it sends (`mine`)."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, sorted(mine, key=str))
    return {key: rank for rank, keys in enumerate(found) for key in keys}


def export_hf_checkpoint(model, spec: ModelSpec, parallel: ParallelConfig, out_dir, *, hf_config: dict,
                         side_files_from=None, max_shard_bytes: int = 5 * 2**30):
    """Write the model as a Hugging Face checkpoint from global rank 0; collective over all ranks. Weights that are
    not finite are refused on every rank before anything is gathered."""
    broken = nonfinite_on_any_rank(model, next(model.parameters()).device)
    if broken is not None:
        raise CheckpointError(f"{out_dir}: not written: the weights are not finite (NaN or inf) in {broken}")
    tensors = iter_hf_tensors(model, spec, parallel)
    if dist.get_rank() == 0:
        write_hf_checkpoint(out_dir, tensors, config=hf_config, side_files_from=side_files_from,
                            max_shard_bytes=max_shard_bytes)
    else:
        for _ in tensors:
            pass
    dist.barrier()
