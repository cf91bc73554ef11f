"""torchrun worker (4 processes): a tiny Qwen3-MoE policy at (TP, EP, PP) layouts against transformers, and one
training step at several splits; a tiny GLM-4.5-style MoE (sigmoid routing with an expert bias, grouped top-k, a
shared expert, a dense first layer, partial rotary) at three layouts against transformers.

Writes into the folder argv[1]:
- parity.json from global rank 0: {layout: [{max_abs_logp, max_abs_entropy, tokens}]} gathered from the ranks
  that hold results, and {export-layout: {export_names, export_bitwise, sync_names, sync_bitwise}}: the HF
  checkpoint exported from that layout and the weight sync's buckets against the source checkpoint;
- per training layout, {tag}-rank{r}.pt (the weight change of one Adam step at lr = eps, i.e. minus the
  gradient, under the HF names of the tensors this rank holds, tensor-parallel shards gathered) and {tag}.json (the
  step's loss, grad norm and load-balancing loss), without a load-balancing loss and, at one layout ("-aux"), with
  one.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from policy_worker import logprob_errors
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences
from train_worker import batch, gathered_hf_state

from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
from megatron_dapo.checkpoint.hf_mapping import hf_tensors, tp_dim
from megatron_dapo.checkpoint.hf_weights import expert_offset, global_name, layer_offset, load_hf_weights, \
    load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer
from megatron_dapo.weight_sync.buckets import iter_hf_buckets

# (tensor, expert, pipeline) parallel, sequence parallel
PARITY = [(1, 1, 1, False), (1, 2, 1, False), (2, 2, 1, True), (1, 2, 2, False)]
# GLM-4.5-style routing (tiny_models' glm4_moe): whole, at TP2 + SP x EP2, and over two pipeline stages
GLM_PARITY = [(1, 1, 1, False), (2, 2, 1, True), (1, 2, 2, False)]
# ... and the micro-batch token budget, full activation recompute
TRAINING = [(1, 1, 1, False, 100000, False), (1, 2, 1, False, 62, False), (1, 2, 1, False, 62, True),
            (2, 2, 1, True, 200, False), (1, 2, 2, False, 200, False), (1, 2, 2, False, 200, True)]


def layout_tag(tp, ep, pp, sp, *more) -> str:
    tag = f"tp{tp}-ep{ep}-pp{pp}" + ("-sp" if sp else "")
    if more:
        mb, recompute = more
        tag += f"-mb{mb}" + ("-r" if recompute else "")
    return tag


def parallel_config(tp, ep, pp, sp, cp=1) -> ParallelConfig:
    return ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, sequence_parallel=sp,
                          context_parallel=cp, device="cpu", seed=7)


def parity_case(spec, ckpt, seqs, ref, layout, out_dir, tag: str) -> tuple[dict | None, dict]:
    """This rank's log-prob errors at `layout`, and on global rank 0 whether the HF checkpoint exported from it and
    the weight sync's buckets are the source checkpoint, bitwise."""
    from megatron.core import parallel_state

    parallel = parallel_config(*layout)
    runtime = init_runtime(parallel)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE)
    load_hf_weights(model, ckpt.get, spec, parallel)
    errors = logprob_errors(model.eval(), spec, runtime, seqs, ref)
    exported = os.path.join(out_dir, f"exported_{tag}")
    export_hf_checkpoint(model, spec, parallel, exported, hf_config=ckpt.config, max_shard_bytes=50_000)
    bucketed = {name: t.cpu().clone()
                for b in iter_hf_buckets(model, spec, parallel, 20_000) for name, t in b.named_tensors()}
    same = {}
    if dist.get_rank() == 0:
        back = HFCheckpoint(exported)
        same = {"export_names": sorted(back.names()) == sorted(ckpt.names()),
                "export_bitwise": all(torch.equal(back.get(n), ckpt.get(n)) for n in ckpt.names()),
                "sync_names": sorted(bucketed) == sorted(ckpt.names()),
                "sync_bitwise": all(torch.equal(bucketed[n], ckpt.get(n)) for n in ckpt.names())}
    reset_parallel_layout()
    return errors, same


def training_case(out_dir, spec, get, hf, layout, aux_loss_coef: float = 0.0, plain_optimizer: bool = False,
                  packed: bool = False) -> None:
    """`aux_loss_coef`: the load-balancing loss's; 0 (the split invariance: it is computed per micro-batch).
    `plain_optimizer`: megatron-core's optimizer without sharding its state (optim.distributed_optimizer false);
    `packed`: packed micro-batches (model.packing)."""
    from megatron.core import parallel_state

    tp, ep, pp, sp, mb_tokens, recompute = layout
    parallel = parallel_config(tp, ep, pp, sp)
    runtime = init_runtime(parallel)
    # First Adam step with eps >> |g|: the change is lr * g / (|g| + eps), i.e. minus the gradient for lr = eps.
    optim = OptimConfig(lr=1e3, adam_eps=1e3, warmup_steps=0, weight_decay=0.0, clip_grad=0.0,
                        distributed_optimizer=not plain_optimizer)
    trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(dual_clip_c=3.0), mb_tokens,
                            activation_recompute="full" if recompute else "none", params_dtype=PARITY_DTYPE,
                            moe_aux_loss_coef=aux_loss_coef, packed=packed)
    load_policy_weights(trainer, get)
    dp, dp_rank = runtime.data_parallel, parallel_state.get_data_parallel_rank()
    mine = batch(hf)[dp_rank::dp]
    before = gathered_hf_state(trainer.module, spec, parallel)
    result = trainer.step(mine)
    after = gathered_hf_state(trainer.module, spec, parallel)
    tag = layout_tag(*layout) + ("-aux" if aux_loss_coef else "") + ("-plain" if plain_optimizer else "") \
        + ("-p" if packed else "")
    torch.save({k: after[k] - before[k] for k in after}, os.path.join(out_dir, f"{tag}-rank{dist.get_rank()}.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
            json.dump({"loss": result.loss, "grad_norm": result.grad_norm, "num_tokens": result.stats["num_tokens"],
                       "load_balancing_loss": result.load_balancing_loss}, f)
    del trainer
    reset_parallel_layout()


def checkpoint_of(kind: str, out_dir: str):
    """(transformers' model, its checkpoint saved in transformers' own file format, the spec)."""
    hf, _ = hf_model(kind)
    folder = os.path.join(out_dir, f"hf_{kind}_rank{os.environ['RANK']}")
    hf.save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    return hf, ckpt, spec


def main(out_dir: str) -> None:
    # saved before torch.distributed starts: transformers then saves from global rank 0 only
    models = {kind: checkpoint_of(kind, out_dir) for kind in ("qwen3_moe", "glm4_moe")}
    parity = {}
    for kind, layouts in (("qwen3_moe", PARITY), ("glm4_moe", GLM_PARITY)):
        hf, ckpt, spec = models[kind]
        seqs = sequences()
        ref = hf_response_logprobs(hf, seqs)
        for layout in layouts:
            tag = layout_tag(*layout) if kind == "qwen3_moe" else f"{kind}-{layout_tag(*layout)}"
            errors, same = parity_case(spec, ckpt, seqs, ref, layout, out_dir, tag)
            found = [None] * int(os.environ["WORLD_SIZE"])
            dist.all_gather_object(found, errors)
            parity[tag] = [e for e in found if e is not None]
            parity[f"export-{tag}"] = same
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "parity.json"), "w") as f:
            json.dump(parity, f)
    hf, ckpt, spec = models["qwen3_moe"]
    for layout in TRAINING:
        training_case(out_dir, spec, ckpt.get, hf, layout)
    training_case(out_dir, spec, ckpt.get, hf, TRAINING[-2], aux_loss_coef=0.01)
    training_case(out_dir, spec, ckpt.get, hf, TRAINING[3], aux_loss_coef=0.01)  # the same micro-batches, SP-split
    training_case(out_dir, spec, ckpt.get, hf, TRAINING[-1], aux_loss_coef=0.01)  # ... PP2 with recompute
    training_case(out_dir, spec, ckpt.get, hf, TRAINING[1], plain_optimizer=True)
    training_case(out_dir, spec, ckpt.get, hf, TRAINING[3], packed=True)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1])
