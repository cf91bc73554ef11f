"""torchrun worker: one training step at the layouts a world size allows, and a few Adam steps.

argv: OUT_DIR LAYOUT [LAYOUT ...], a layout being tp,pp,micro_batch_tokens[,r][,s][,p][,sp][,cp] (r: full
activation recompute, model.activation_recompute "full"; s: loss.aggregation "sample", whose record also holds the
loss by its float64 definition over transformers' log-probs; p: packed micro-batches, model.packing; sp: sequence
parallelism; cp: context parallelism over 2 ranks). Per layout the weight change of one Adam step, gathered to
HF names, goes to OUT_DIR/{tag}-stage{pp_rank}.pt from the ranks with tp_rank = dp_rank = cp_rank = 0; the step's
loss and grad norm to OUT_DIR/{tag}.json, with how many layer checkpoints megatron-core made on each rank, and
(PP = 1) the log-probs and entropies of the whole batch before the step.
Layout "adam" runs 6 Adam steps at TP=2 and records the loss, "adam-cp-bf16" the same at CP=2 in bf16 (fp32
master weights); "nan" poisons one micro-batch (nan.json); "bf16"
takes one update of a bf16 model under each bf16 optimizer (bf16.json).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.hf_mapping import hf_tensors, tp_dim
from megatron_dapo.checkpoint.hf_weights import expert_offset, global_name, layer_offset, load_policy_weights
from megatron_dapo.config import ParallelConfig
from megatron_dapo.ops.dapo_loss_reference import sample_level_loss_reference
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.batch import layout_multiples, micro_batches
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import named_weights
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample

LENGTHS = ((5, 20), (3, 41), (9, 4), (2, 60), (7, 13), (4, 30), (6, 9), (3, 25))
ADAM = {"adam": "2,1,200", "adam-cp-bf16": "1,1,200,cp"}  # the Adam layouts' tp,pp,micro_batch_tokens[,cp]


def batch(hf):
    """The same 8 samples everywhere: old log-probs a perturbation of the policy's, group advantages."""
    seqs = sequences(seed=2, lengths=LENGTHS)
    g = torch.Generator().manual_seed(5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])
    samples = []
    for i, (s, (logp, _)) in enumerate(zip(seqs, hf_response_logprobs(hf, seqs))):
        r = s.response_len
        old = logp.float() + 0.1 * torch.randn(r, generator=g)
        mask = torch.rand(r, generator=g) > 0.15
        samples.append(RolloutSample(s, old, adv[i].expand(r).clone(), mask))
    return samples


@torch.no_grad()
def gathered_hf_state(model, spec, parallel):
    """The HF tensors this rank holds (tensor-parallel shards gathered; of a mixture of experts, its experts only;
    GLM-4.5's expert bias, a buffer, too)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    offset = layer_offset(spec, parallel, parallel_state.get_pipeline_model_parallel_rank())
    experts = expert_offset(spec, parallel, parallel_state.get_expert_model_parallel_rank())
    out = {}
    for name, p in named_weights(model):
        mname = global_name(name, offset, experts)
        if tp_dim(mname) is None:
            shards = [p.detach().clone()]
        else:
            shards = [torch.empty_like(p) for _ in range(parallel.tensor_parallel)]
            dist.all_gather(shards, p.detach().contiguous(), group=tp_group)
        out.update(hf_tensors(mname, shards, spec))
    return out


class CheckpointCounter:
    """Counts megatron-core's activation checkpoints (one per layer per micro-batch under full recompute)."""

    def __init__(self):
        from megatron.core import tensor_parallel

        self.module, self.original, self.calls = tensor_parallel, tensor_parallel.checkpoint, 0

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        tensor_parallel.checkpoint = counting

    def restore(self):
        self.module.checkpoint = self.original


def tis_normaliser_case(out_dir, spec, hf):
    """Truncated-IS weights of 0 on the second half of every response, against those tokens left out of the
    loss: same summed loss, but the weighted tokens still count in the normaliser, so the gradient is the
    left-out one's times (tokens in the first halves / all tokens)."""
    parallel = ParallelConfig(device="cpu", seed=7)
    runtime = init_runtime(parallel)
    optim = OptimConfig(lr=1e3, adam_eps=1e3, warmup_steps=0, weight_decay=0.0, clip_grad=0.0)
    norms, counts = {}, {}
    for case in ("weighted", "left_out"):
        trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(), 100000, params_dtype=PARITY_DTYPE)
        load_policy_weights(trainer, hf.state_dict().__getitem__)
        samples = []
        for s in batch(hf):
            n = s.sequence.response_len
            first = torch.arange(n) < (n + 1) // 2
            if case == "weighted":
                s = RolloutSample(s.sequence, s.old_logp, s.advantages, torch.ones(n, dtype=torch.bool),
                                  loss_weight=first.float())
            else:
                s = RolloutSample(s.sequence, s.old_logp, s.advantages, first)
            samples.append(s)
        norms[case] = trainer.step(samples).grad_norm
        counts[case] = int(sum(s.loss_mask.sum() for s in samples))
        del trainer
    with open(os.path.join(out_dir, "tis.json"), "w") as f:
        json.dump({"grad_norms": norms, "loss_tokens": counts}, f)
    reset_parallel_layout()


def bf16_case(out_dir, spec, hf):
    """The GPU's precision on the CPU: a bf16 model under megatron-core's bf16 optimizers (plain and distributed),
    whose fp32 master copy the update is applied to. After one update at a learning rate far below bf16's
    resolution the weights are still the loaded ones (a master copy of anything else would replace them)."""
    parallel = ParallelConfig(device="cpu", seed=7)
    runtime = init_runtime(parallel)
    record = {}
    for name, distributed in (("plain", False), ("distributed", True)):
        optim = OptimConfig(lr=1e-7, warmup_steps=0, weight_decay=0.0, distributed_optimizer=distributed)
        trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(), 100000,
                                params_dtype=torch.bfloat16)
        load_policy_weights(trainer, hf.state_dict().__getitem__)
        loaded = gathered_hf_state(trainer.module, spec, parallel)
        result = trainer.step(batch(hf))
        after = gathered_hf_state(trainer.module, spec, parallel)
        record[name] = {"dtypes": sorted({str(p.dtype) for p in trainer.module.parameters()}),
                        "applied": result.applied, "loss": result.loss,
                        "max_change": max((after[k].float() - loaded[k].float()).abs().max().item() for k in loaded),
                        "max_weight": max(v.float().abs().max().item() for v in loaded.values())}
        del trainer
    with open(os.path.join(out_dir, "bf16.json"), "w") as f:
        json.dump(record, f)
    reset_parallel_layout()


def nan_case(out_dir, spec, hf):
    """A NaN in the old log-probs of one micro-batch at TP=2: the update is skipped on every rank and the weights
    stay bitwise; the next, clean update is applied."""
    parallel = ParallelConfig(tensor_parallel=2, device="cpu", seed=7)
    runtime = init_runtime(parallel)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=1e-2, warmup_steps=0), LossConfig(), 200)
    load_policy_weights(trainer, hf.state_dict().__getitem__)
    clean = batch(hf)
    poisoned = list(clean)
    s = poisoned[3]  # its own micro-batch at 200 tokens
    old = s.old_logp.clone()
    old[1] = float("nan")
    poisoned[3] = RolloutSample(s.sequence, old, s.advantages, torch.ones_like(s.loss_mask))
    before = [p.detach().clone() for p in trainer.module.parameters()]
    bad = trainer.step(poisoned)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.module.parameters()))
    good = trainer.step(clean)
    moved = not all(torch.equal(a, p) for a, p in zip(before, trainer.module.parameters()))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, [bad.applied, good.applied])
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "nan.json"), "w") as f:
            json.dump({"applied": flags, "bad_loss": str(bad.loss), "bad_grad_norm": str(bad.grad_norm),
                       "good_grad_norm": good.grad_norm, "unchanged": unchanged, "moved": moved,
                       "step_count": trainer.step_count}, f)
    del trainer
    reset_parallel_layout()


def sample_level_reference(hf, samples, loss):
    """The step's loss by GRPO's sample-level definition, in float64 over transformers' log-probs."""
    seqs = [s.sequence for s in samples]
    logp = torch.cat([lp for lp, _ in hf_response_logprobs(hf, seqs)]).double()
    cat = {name: torch.cat([getattr(s, name) for s in samples]) for name in ("old_logp", "advantages", "loss_mask")}
    return sample_level_loss_reference(logp, cat["old_logp"].double(), cat["advantages"].double(), cat["loss_mask"],
                                       [s.sequence.response_len for s in samples], eps_low=loss.eps_low,
                                       eps_high=loss.eps_high, dual_clip_c=loss.dual_clip_c).item()


def run_layout(out_dir, layout, spec, hf):
    from megatron.core import parallel_state

    adam = layout in ADAM
    fields = ADAM[layout].split(",") if adam else layout.split(",")
    recompute, sample_level, packed = "r" in fields[3:], "s" in fields[3:], "p" in fields[3:]
    if len(fields) < 3 or not set(fields[3:]) <= {"r", "s", "p", "sp", "cp"}:
        raise SystemExit(f"bad layout {layout!r}: expected tp,pp,micro_batch_tokens[,r][,s][,p][,sp][,cp]")
    tp, pp, mb_tokens = map(int, fields[:3])
    cp = 2 if "cp" in fields[3:] else 1
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                              sequence_parallel="sp" in fields[3:], device="cpu", seed=7)
    runtime = init_runtime(parallel)
    # First Adam step with eps >> |g|: the change is lr * g / (|g| + eps), i.e. minus the gradient for lr = eps.
    optim = (OptimConfig(lr=3e-3, warmup_steps=0, weight_decay=0.0, clip_grad=1.0) if adam else
             OptimConfig(lr=1e3, adam_eps=1e3, warmup_steps=0, weight_decay=0.0, clip_grad=0.0))
    loss = LossConfig(dual_clip_c=3.0, aggregation="sample" if sample_level else "token")
    trainer = PolicyTrainer(spec, parallel, runtime.device, optim, loss, mb_tokens,
                            activation_recompute="full" if recompute else "none",
                            params_dtype=torch.bfloat16 if layout.endswith("bf16") else PARITY_DTYPE, packed=packed)
    load_policy_weights(trainer, hf.state_dict().__getitem__)
    dp, dp_rank = runtime.data_parallel, parallel_state.get_data_parallel_rank()
    samples = batch(hf)
    mine = samples[dp_rank::dp]
    tag = layout if adam else f"tp{tp}-pp{pp}-dp{dp}-mb{mb_tokens}" + "".join(f"-{f}" for f in fields[3:])
    counts = [None] * dist.get_world_size()
    multiple, per_sequence = layout_multiples(trainer.module.config)
    dist.all_gather_object(counts, len(micro_batches([s.sequence for s in mine], mb_tokens, multiple, packed=packed,
                                                     sequence_multiple=per_sequence)))
    record = {"micro_batches_per_rank": counts}
    if pp == 1 and dp == 1 and not adam:
        out = response_logprobs(trainer.module, [s.sequence for s in samples], vocab_size=spec.vocab_size,
                                max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=mb_tokens,
                                device=runtime.device, packed=packed)
        record["logprobs"] = [[lp.tolist(), en.tolist()] for lp, en in out]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, record["logprobs"])
        record["logprobs_on_every_rank"] = all(e == record["logprobs"] for e in every)
    if adam:
        losses = []
        for _ in range(6):
            result = trainer.step(mine)
            losses.append(result.loss)
        record["losses"] = losses
    else:
        before = gathered_hf_state(trainer.module, spec, parallel)
        counter = CheckpointCounter()
        try:
            result = trainer.step(mine)
        finally:
            counter.restore()
        after = gathered_hf_state(trainer.module, spec, parallel)
        checkpoints = [None] * dist.get_world_size()
        dist.all_gather_object(checkpoints, counter.calls)
        record.update(loss=result.loss, grad_norm=result.grad_norm, stats=result.stats,
                      layers_per_stage=spec.num_layers // pp, checkpoints_per_rank=checkpoints)
        if sample_level:
            record["reference_loss"] = sample_level_reference(hf, samples, loss)
        if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0 and \
                parallel_state.get_context_parallel_rank() == 0:
            stage = parallel_state.get_pipeline_model_parallel_rank()
            torch.save({k: after[k] - before[k] for k in after}, os.path.join(out_dir, f"{tag}-stage{stage}.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
            json.dump(record, f)
    del trainer
    reset_parallel_layout()


def main(out_dir, layouts):
    hf, cfg = hf_model("qwen2")
    spec = model_spec_from_hf(cfg)
    for layout in layouts:
        if layout == "tis":
            tis_normaliser_case(out_dir, spec, hf)
        elif layout == "nan":
            nan_case(out_dir, spec, hf)
        elif layout == "bf16":
            bf16_case(out_dir, spec, hf)
        else:
            run_layout(out_dir, layout, spec, hf)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
