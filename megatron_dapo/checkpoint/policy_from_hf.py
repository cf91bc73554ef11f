"""The run's policy from its Hugging Face checkpoint (model.path): the trained policy, filled through
`load_policy_weights` (which refreshes a bf16 optimizer's fp32 master copy), and the frozen KL reference when
loss.kl_coef asks for one, both at model.dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.checkpoint.hf_weights import load_hf_weights, load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ModelConfig
from megatron_dapo.parallel.runtime import Runtime, builds_for_gpu
from megatron_dapo.policy.hf_config import ModelSpec, model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.train_step import PolicyTrainer
from megatron_dapo.run_config import DapoConfig


@dataclass
class Policy:
    trainer: PolicyTrainer
    reference: torch.nn.Module | None  # frozen, for the KL term; None without one
    spec: ModelSpec
    hf_config: dict

    @property
    def module(self) -> torch.nn.Module:
        return self.trainer.module


def open_hf_checkpoint(model: ModelConfig) -> tuple[HFCheckpoint, ModelSpec]:
    """model.path's checkpoint and the model it describes, checked against each other before anything is built."""
    hf = HFCheckpoint(model.path)
    spec = model_spec_from_hf(hf.config)
    hf.validate(spec)
    return hf, spec


def build_policy(cfg: DapoConfig, runtime: Runtime, hf: HFCheckpoint, spec: ModelSpec) -> Policy:
    """Every rank: its stage of the policy and of the reference, with the checkpoint's weights."""
    from megatron.core import parallel_state

    dtype = getattr(torch, cfg.model.training_dtype(builds_for_gpu(cfg.parallel)))
    trainer = PolicyTrainer(spec, cfg.parallel, runtime.device, cfg.optim, cfg.loss,
                            cfg.model.max_tokens_per_micro_batch, activation_recompute=cfg.model.activation_recompute,
                            updates_per_step=cfg.train.updates_per_step, temperature=cfg.rollout.temperature,
                            params_dtype=dtype)
    load_policy_weights(trainer, hf.get)
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = build_model(spec, cfg.parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage(), params_dtype=dtype)
        load_hf_weights(reference, hf.get, spec, cfg.parallel)
        reference = reference.eval().requires_grad_(False)
    return Policy(trainer, reference, spec, hf.config)
