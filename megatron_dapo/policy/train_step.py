"""One optimizer step of the policy on a batch of rollout samples with the fused DAPO loss.

The model stage is wrapped in megatron-core's DistributedDataParallel and optimizer (AdamW, the
distributed optimizer by default, gradient clipping), with a linear-warmup-then-constant learning
rate. Normalisation is over the whole step: every micro-batch contributes its summed loss and its
count (loss tokens; responses with loss.aggregation "sample", whose tokens are weighted by 1 / their
response's loss tokens), and megatron-core's per-token loss mode divides the gradients summed over
micro-batches and data- (and context-) parallel ranks by the total count. So the gradient does not depend on how
the step is split. A mixture of experts' load-balancing loss is scaled to be independent of that count
(policy/load_balancing.py).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megatron_dapo.config import LossConfig, OptimConfig, ParallelConfig
from megatron_dapo.ops.dapo_loss import dapo_loss
from megatron_dapo.ops.dapo_loss_checks import STAT_NAMES
from megatron_dapo.ops.host_sync import no_host_sync
from megatron_dapo.ops.loss_aggregation import aggregation_weights, loss_units
from megatron_dapo.policy.batch import MicroBatch, Sequence, check_sequences
from megatron_dapo.policy.expert_load import ExpertLoad
from megatron_dapo.policy.finite_weights import NonFiniteTraining, nonfinite_on_any_rank
from megatron_dapo.policy.forward import (
    is_last_stage,
    micro_batch_logprobs,
    model_forward,
    model_micro_batches,
    route_replayer,
)
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.policy.load_balancing import LoadBalancing, aux_coefficient
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.routing_agreement import RoutingAgreement


@dataclass(frozen=True)
class RolloutSample:
    """One response and what the loss needs for each of its tokens."""

    sequence: Sequence
    old_logp: torch.Tensor  # [response_len]
    advantages: torch.Tensor  # [response_len]
    loss_mask: torch.Tensor  # [response_len] bool: the tokens in the loss (and in its token-level normaliser)
    ref_logp: torch.Tensor | None = None  # [response_len], for the optional KL penalty
    # [response_len] fp32 weights of the loss tokens' terms (the rollout correction); a weight of 0 keeps its token in the
    # normaliser: the token was sampled and belongs to the step, however little it counts.
    loss_weight: torch.Tensor | None = None

    def __post_init__(self):
        n = self.sequence.response_len
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"RolloutSample.loss_mask: must be bool, got {self.loss_mask.dtype} (per-token weights "
                             "go in loss_weight)")
        optional = tuple(name for name in ("ref_logp", "loss_weight") if getattr(self, name) is not None)
        for name in ("old_logp", "advantages", "loss_mask") + optional:
            if getattr(self, name).shape != (n,):
                raise ValueError(f"RolloutSample.{name}: shape {tuple(getattr(self, name).shape)}, expected ({n},) "
                                 "(one entry per response token)")


@dataclass
class StepResult:
    loss: float  # the step's loss (all micro-batches, all DP ranks), aggregated as loss.aggregation says
    grad_norm: float  # NaN when not applied
    lr: float
    stats: dict[str, float] = field(default_factory=dict)  # summed over the step; ratio_max is the max
    # What `loss` is the mean over: the step's loss tokens, or its responses with a loss token ("sample").
    units: float = 0.0
    entropy_mean: float = 0.0
    applied: bool = True  # False: the loss or a gradient was not finite and the update was skipped
    # A mixture of experts with a load-balancing loss (model.moe_aux_loss_coef > 0): its value before the
    # coefficient, the mean over the MoE layers and the micro-batches with samples (policy/load_balancing.py).
    load_balancing_loss: float | None = None
    # A mixture of experts: per MoE layer, its busiest expert's tokens over the mean expert's (policy/expert_load.py)
    expert_load: list[float] | None = None
    # With routing replay, where step(measure_routing=True): per MoE layer, the share of response tokens whose own
    # top-k is the replayed one (policy/routing_agreement.py)
    routing_agreement: list[float] | None = None


class PolicyTrainer:
    """This rank's model stage, wrapped for training, and the step that updates it."""

    def __init__(self, spec: ModelSpec, parallel: ParallelConfig, device: torch.device, optim: OptimConfig,
                 loss: LossConfig, max_tokens_per_micro_batch: int, activation_recompute: str = "none",
                 updates_per_step: int = 1, temperature: float = 1.0, params_dtype: torch.dtype | None = None,
                 moe_aux_loss_coef: float | None = None, routing_replay: bool = False, packed: bool = False):
        """`activation_recompute`: model.activation_recompute ("full": each layer keeps only its input and
        recomputes the rest in the backward). Forward-only passes are unaffected: megatron-core recomputes only in
        training mode, and under no_grad its checkpoint keeps nothing for a backward either.
        `updates_per_step`: train.updates_per_step, the optimizer updates of one rollout step (the LR warmup
        counts rollout steps).
        `temperature`: rollout.temperature; the loss's log-probs are those of softmax(logits / temperature), the
        distribution the rollout sampled from (old log-probs must be recomputed at the same temperature).
        `params_dtype`: the model's (model.training_dtype; default bf16 on GPUs, fp32 on the CPU); with bf16 the
        optimizer keeps an fp32 master copy of the weights (load them with load_policy_weights).
        `moe_aux_loss_coef`: model.moe_aux_loss_coef, a mixture of experts' load-balancing loss coefficient (None:
        the model's config.json's).
        `routing_replay`: every router takes the experts the samples' sequences carry (policy/routing_replay.py).
        `packed`: model.packing, micro-batches of whole sequences end to end (policy/batch.py)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.spec, self.parallel, self.device = spec, parallel, device
        self.optim, self.loss_cfg = optim, loss
        self.max_tokens, self.packed = max_tokens_per_micro_batch, packed
        self.step_count = 0  # the LR schedule's position, in optimizer updates
        self.updates_per_step = updates_per_step
        self.temperature = temperature
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(), params_dtype=params_dtype,
                            activation_recompute=activation_recompute, moe_aux_loss_coef=moe_aux_loss_coef,
                            routing_replay=routing_replay)
        self.recompute = activation_recompute == "full"
        self.aux_coef = aux_coefficient(spec, moe_aux_loss_coef) if spec.is_moe else 0.0
        config = model.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=optim.distributed_optimizer,
                                                   check_for_nan_in_grad=False)  # step() skips such updates
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                            clip_grad=optim.clip_grad, bf16=config.params_dtype == torch.bfloat16,
                            params_dtype=config.params_dtype, use_distributed_optimizer=optim.distributed_optimizer),
            [self.model],
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        config.grad_scale_func = self.optimizer.scale_loss

    def begin_rollout_step(self, index: int) -> None:
        """Put the LR schedule at rollout step `index` (from 0): it advances by updates_per_step per rollout step
        even when a step makes fewer updates (a batch with fewer responses than updates)."""
        self.step_count = index * self.updates_per_step

    @property
    def module(self):
        """The bare GPTModel stage (for forward-only passes; weights go in through
        checkpoint.hf_weights.load_policy_weights, which refreshes the optimizer's master copy too)."""
        return self.model.module

    def _loss_func(self, mb: MicroBatch, old_logp, advantages, mask, weight, ref_logp, units, logits):
        """`weight`: the loss tokens' weights (truncated IS, loss.aggregation), None for all 1; `units`: what this
        micro-batch adds to the step's normaliser (loss tokens, or responses with "sample" aggregation)."""
        with no_host_sync("the loss function"):  # once per micro-batch: a host read would stall the GPU each time
            logp, entropy = micro_batch_logprobs(logits, mb, self.spec.vocab_size, inplace_backward=True,
                                                 temperature=self.temperature)
            c = self.loss_cfg
            # One weighted mask for both terms: the rollout correction moves the KL term's token mean as it does
            # the policy gradient's (why: LossConfig.correction).
            loss, stats = dapo_loss(logp, old_logp, advantages,
                                    mask if weight is None else torch.where(mask, weight, 0.0),
                                    eps_low=c.eps_low, eps_high=c.eps_high, normalizer=1.0, dual_clip_c=c.dual_clip_c,
                                    log_ratio_clamp=c.log_ratio_clamp, ref_logp=ref_logp,
                                    kl_coef=c.kl_coef if ref_logp is not None else 0.0, kl_type=c.kl_type)
            reduced = {"stats": torch.stack(stats), "loss_sum": loss.detach().double(), "units": units.double(),
                       "entropy_sum": torch.where(mask, entropy, 0.0).sum().double()}
            return loss, units, reduced

    def _filler_loss(self, logits):
        """A filler micro-batch's: a zero loss that still runs the backward (its expert dispatch is collective)."""
        zero = logits.new_zeros((), dtype=torch.float64)
        reduced = {"stats": torch.zeros(len(STAT_NAMES), device=logits.device), "loss_sum": zero, "units": zero,
                   "entropy_sum": zero}
        return logits.sum() * 0.0, zero.to(torch.int), reduced

    def step(self, samples: list[RolloutSample], measure_routing: bool = False) -> StepResult:
        """One optimizer step on this data-parallel rank's share of the batch. `measure_routing`: with routing
        replay, count the routing agreement in this update's forwards (the step's first update, where no old-log-prob
        pass did: its weights are still the old policy's)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        check_sequences([s.sequence for s in samples], self.spec.max_position_embeddings)
        replayer = route_replayer(self.module)
        if replayer is not None:
            replayer.check([s.sequence for s in samples])
        mbs = model_micro_batches(self.module.config, [s.sequence for s in samples], self.max_tokens, self.device,
                                  self.packed)
        dev = self.device
        with_ref = self.loss_cfg.kl_coef > 0
        if with_ref and any(s.ref_logp is None for s in samples):
            raise ValueError("loss.kl_coef > 0 needs every RolloutSample's ref_logp (the reference policy's log-probs)")
        weighted = samples[0].loss_weight is not None
        if any((s.loss_weight is not None) != weighted for s in samples):
            raise ValueError("RolloutSample.loss_weight: give it for every sample of a step or for none")
        cp_rank = parallel_state.get_context_parallel_rank()

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            on_output = replayer.before_forward(mb, self.recompute) if replayer is not None else (lambda out: out)
            balance.micro_batch(mb)
            if agreement is not None:
                agreement.micro_batch(mb)
            if not mb.sample_index:  # a filler (expert parallelism): its forward and backward, and nothing else
                return on_output(model_forward(model, mb, dev)), self._filler_loss
            rows = [samples[i] for i in mb.sample_index]
            old = torch.cat([r.old_logp for r in rows]).to(dev, torch.float32)
            adv = torch.cat([r.advantages for r in rows]).to(dev, torch.float32)
            mask = torch.cat([r.loss_mask for r in rows]).to(dev)
            weight = torch.cat([r.loss_weight for r in rows]).to(dev, torch.float32) if weighted else None
            aggregate, units = aggregation_weights(mask, [r.sequence.response_len for r in rows],
                                                   self.loss_cfg.aggregation)  # a token of weight 0 still counts
            if aggregate is not None:
                weight = aggregate if weight is None else weight * aggregate
            ref = torch.cat([r.ref_logp for r in rows]).to(dev, torch.float32) if with_ref else None
            if mb.response_order is not None:
                # context parallelism: this CP rank's share of the tokens; the micro-batch's normaliser counts once
                order = mb.response_order.to(dev)
                old, adv, mask, weight, ref = (t if t is None else t[order] for t in (old, adv, mask, weight, ref))
                if cp_rank:
                    units = torch.zeros_like(units)
            return on_output(model_forward(model, mb, dev)), partial(self._loss_func, mb, old, adv, mask, weight, ref,
                                                                     units)

        lr = self.optim.lr_at(self.step_count, self.updates_per_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        units = loss_units([s.loss_mask for s in samples], self.loss_cfg.aggregation)
        load = ExpertLoad(self.module)
        balance = LoadBalancing(self.module, self.aux_coef, units, mbs, self.recompute)
        agreement = RoutingAgreement(self.module, self.recompute) if measure_routing and replayer is not None else None
        try:
            with balance, load, agreement if agreement is not None else nullcontext():
                outputs = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
                    num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
                    micro_batch_size=1, forward_only=False,
                )
        finally:
            if replayer is not None:
                replayer.end()
        result = self._reduce_metrics(outputs, lr, parallel_state)
        result.load_balancing_loss = balance.value()
        result.expert_load = load.max_over_mean()
        result.routing_agreement = agreement.shares() if agreement is not None else None
        self.step_count += 1
        if not self._finite(result.loss):  # every rank agrees: nothing is applied
            return dataclasses.replace(result, applied=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped: non-finite gradients")
        self._check_weights(lr)
        return dataclasses.replace(result, grad_norm=float(grad_norm))

    def _check_weights(self, lr: float) -> None:
        """Collective: every rank stops when the update just applied left any rank's weights non-finite (finite
        gradients at a learning rate or an epsilon that blows them up): nothing is checkpointed or sent to the
        servers from them."""
        where = nonfinite_on_any_rank(self.module, self.device)
        if where is None:
            return
        raise NonFiniteTraining(
            f"rollout step {(self.step_count - 1) // self.updates_per_step + 1}, update {self.step_count}: the "
            f"optimizer's update (lr {lr:g}) made the weights non-finite (NaN or inf) in {where}; the run stops "
            "before anything is checkpointed or sent to the servers from them (the latest checkpoint holds the last "
            "good weights). Lower optim.lr, check optim.adam_eps, and resume")

    def _finite(self, loss: float) -> bool:
        """The step's loss (the same on every rank) and every rank's gradients are finite."""
        bad = torch.tensor([0.0 if math.isfinite(loss) else 1.0], device=self.device)
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            bad += (~torch.isfinite(buffer.grad_data)).any()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0

    def _reduce_metrics(self, outputs, lr, parallel_state) -> StepResult:
        # Sums over this rank's micro-batches, then over data- and context-parallel ranks, then to every pipeline
        # stage.
        n = len(STAT_NAMES)
        totals = torch.zeros(n + 3, dtype=torch.float64, device=self.device)
        ratio_max = torch.zeros(1, dtype=torch.float64, device=self.device)
        if is_last_stage():
            for out in outputs:
                totals[:n] += out["stats"]
                totals[n] += out["loss_sum"]
                totals[n + 1] += out["entropy_sum"]
                totals[n + 2] += out["units"]
                ratio_max = torch.maximum(ratio_max, out["stats"][STAT_NAMES.index("ratio_max")].reshape(1))
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(totals, group=dp)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX, group=dp)
        pp = parallel_state.get_pipeline_model_parallel_group()
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(totals, src=last, group=pp)
        dist.broadcast(ratio_max, src=last, group=pp)
        stats = dict(zip(STAT_NAMES, totals[:n].tolist()))
        stats["ratio_max"] = ratio_max.item()
        tokens, units = max(stats["num_tokens"], 1.0), totals[n + 2].item()
        return StepResult(loss=totals[n].item() / max(units, 1.0), grad_norm=math.nan, lr=lr, stats=stats,
                          units=units, entropy_mean=totals[n + 1].item() / tokens)

