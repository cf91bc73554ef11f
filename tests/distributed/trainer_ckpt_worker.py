"""torchrun worker: a training run checkpointed and resumed in another process.

argv: OUT_DIR MODE LAYOUT [LAYOUT ...], MODE "full" or "resume", a layout being tp,pp (DP = the rest) and
flags: nodist for megatron's non-distributed optimizer, bf16 for the GPU's precision (bf16 weights, an fp32
master copy in the optimizer), llama for the tiny Llama instead of the tiny Qwen2, moe for the tiny Qwen3-MoE with
its experts over 2 expert-parallel ranks (its weights read from transformers' own files, each rank's experts
written by that rank: OUT_DIR/{tag}-{mode}-rank{r}.pt), cp for context parallelism over 2 ranks.
full: 3 steps, a checkpoint after each (keep_last=2), then step 4. resume: a fresh trainer (other
seed, random weights, other RNG states) loads the latest checkpoint and runs step 4. Each step's data
depends on the python, numpy and torch RNGs, so step 4 matches only if they were restored too.
A resume layout tp,pp@TAG loads the checkpoint of layout TAG instead (resharded; the RNG states stay
behind, so the host RNGs are replayed to step 4's data by hand).
Per layout: OUT_DIR/{tag}-{mode}.json (step 4's loss and grad norm, the extra dict, every rank's RNG
draws after step 4 and digest of its optimizer's fp32 master weights) and OUT_DIR/{tag}-{mode}-stage{pp_rank}.pt (the weights after step 4, HF names).
"""

import dataclasses
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from tiny_models import hf_model
from train_worker import batch, gathered_hf_state

from megatron_dapo.checkpoint.hf_weights import load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.checkpoint.trainer_checkpoint import (
    latest_checkpoint,
    load_trainer_checkpoint,
    save_trainer_checkpoint,
)
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample

OPTIM = OptimConfig(lr=3e-3, warmup_steps=6, weight_decay=0.01, clip_grad=1.0)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_batch(samples):
    """This DP rank's share of a random subset with randomly scaled advantages: the step depends on every
    host RNG."""
    from megatron.core import parallel_state

    picks = sorted(random.sample(range(len(samples)), 6))
    scale = float(np.random.uniform(0.5, 1.5)) * (1.0 + torch.rand(()).item())
    mine = picks[parallel_state.get_data_parallel_rank()::parallel_state.get_data_parallel_world_size()]
    return [RolloutSample(samples[i].sequence, samples[i].old_logp, samples[i].advantages * scale,
                          samples[i].loss_mask) for i in mine]


def rng_draws():
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(2).tolist()
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(2).tolist(),
            "tracker": tracker}


def master_digest(trainer) -> str:
    """A digest of this rank's fp32 master weights (bf16 training), in the optimizer's order."""
    digest = hashlib.sha256()
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
        for group in groups:
            for master in group:
                digest.update(master.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_layout(out_dir, mode, layout):
    from megatron.core import parallel_state

    layout, _, source = layout.partition("@")
    tp, pp, *flags = layout.split(",")
    tp, pp, nodist, bf16, cp = int(tp), int(pp), "nodist" in flags, "bf16" in flags, 2 if "cp" in flags else 1
    kind = "llama" if "llama" in flags else "qwen3_moe" if "moe" in flags else "glm4_moe" if "glm" in flags else "qwen2"
    hf, cfg = hf_model(kind)
    spec = model_spec_from_hf(cfg)
    full = mode == "full"
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                              expert_parallel=2 if spec.is_moe else 1, device="cpu", seed=7 if full else 99)
    runtime = init_runtime(parallel)
    get = hf.state_dict().__getitem__
    if spec.is_moe:  # transformers fuses the experts in memory and writes them one by one (from global rank 0)
        folder = os.path.join(out_dir, f"hf-{kind}-{mode}")
        hf.save_pretrained(folder)
        dist.barrier()
        get = HFCheckpoint(folder).get
    tag = (f"tp{tp}-pp{pp}" + (f"-cp{cp}" if cp > 1 else "") + f"-dp{runtime.data_parallel}"
           + ("-nodist" if nodist else "") + ("-bf16" if bf16 else "")
           + ("-llama" if kind == "llama" else "") + ("-ep2-moe" if kind == "qwen3_moe" else "")
           + ("-ep2-glm" if kind == "glm4_moe" else ""))
    root = os.path.join(out_dir, f"ckpt-{source or tag}")
    if source:
        tag = f"{tag}-from-{source}"
    optim = dataclasses.replace(OPTIM, distributed_optimizer=not nodist)
    trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(), 200,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32)
    samples = batch(hf)
    if full:
        load_policy_weights(trainer, get)
        seed_all(11)
        for step in range(1, 4):
            trainer.step(step_batch(samples))
            save_trainer_checkpoint(root, step, trainer, {"sampler": {"epoch": 0, "position": 6 * step},
                                                          "metrics_step": step}, keep_last=2)
        extra = None
    else:
        seed_all(12345)
        extra = load_trainer_checkpoint(latest_checkpoint(root), trainer)
        if source:
            seed_all(11)
            for _ in range(3):
                step_batch(samples)
    step_count = trainer.step_count
    result = trainer.step(step_batch(samples))
    draws = [None] * dist.get_world_size()
    dist.all_gather_object(draws, rng_draws())
    masters = [None] * dist.get_world_size()
    dist.all_gather_object(masters, master_digest(trainer))
    weights = gathered_hf_state(trainer.module, spec, parallel)
    if spec.is_moe:  # each rank its own experts
        torch.save(weights, os.path.join(out_dir, f"{tag}-{mode}-rank{dist.get_rank()}.pt"))
    elif parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0 \
            and parallel_state.get_context_parallel_rank() == 0:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        torch.save(weights, os.path.join(out_dir, f"{tag}-{mode}-stage{stage}.pt"))
    if dist.get_rank() == 0:
        record = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, "step_count": step_count,
                  "extra": extra, "draws": draws, "masters": masters,
                  "dtypes": sorted({str(p.dtype) for p in trainer.module.parameters()})}
        with open(os.path.join(out_dir, f"{tag}-{mode}.json"), "w") as f:
            json.dump(record, f)
    del trainer
    reset_parallel_layout()


def main(out_dir, mode, layouts):
    for layout in layouts:
        run_layout(out_dir, mode, layout)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
