"""The run's policy from its Hugging Face checkpoint (model.path): the trained policy, filled through
`load_policy_weights` (which refreshes a bf16 optimizer's fp32 master copy), and the KL reference when
loss.kl_coef asks for one, both at model.dtype. The reference is the initial policy, frozen, or, with
loss.kl_ref_refresh_steps N, the policy as it was after the last step that is a multiple of N."""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


@dataclass
class Policy:
    trainer: PolicyTrainer
    reference: torch.nn.Module | None  # for the KL term, never trained; None without one
    spec: ModelSpec
    hf_config: dict
    reference_refresh_steps: int = 0  # loss.kl_ref_refresh_steps

    @property
    def module(self) -> torch.nn.Module:
        return self.trainer.module

    def reference_after(self, steps_done: int) -> None:
        """After `steps_done` rollout steps: the reference becomes the policy at every reference_refresh_steps-th."""
        if self.reference is not None and self.reference_refresh_steps and steps_done % self.reference_refresh_steps == 0:
            self._reference_from_policy()

    def resumed_at(self, steps_done: int) -> None:
        """A resumed run's reference. The checkpoints of such runs fall on refresh steps (the config requires
        train.checkpoint_every to be a multiple of loss.kl_ref_refresh_steps) except the last one of a finished
        run: one resumed from there (train.steps raised) anchors on the policy it resumes, earlier than planned."""
        n = self.reference_refresh_steps
        if self.reference is None or not n:
            return
        if steps_done % n:
            log.warning("resumed at step %d, between the KL reference's refreshes (loss.kl_ref_refresh_steps %d): "
                        "the reference of step %d was not saved, so the resumed policy becomes the reference now",
                        steps_done, n, steps_done - steps_done % n)
        self._reference_from_policy()

    def _reference_from_policy(self) -> None:
        self.reference.load_state_dict(self.module.state_dict())


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
                            params_dtype=dtype, moe_aux_loss_coef=cfg.model.moe_aux_loss_coef,
                            routing_replay=cfg.rollout.routing_replay, packed=cfg.model.packing)
    load_policy_weights(trainer, hf.get)
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = build_model(spec, cfg.parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage(), params_dtype=dtype)
        load_hf_weights(reference, hf.get, spec, cfg.parallel)
        reference = reference.eval().requires_grad_(False)
    return Policy(trainer, reference, spec, hf.config, cfg.loss.kl_ref_refresh_steps)
