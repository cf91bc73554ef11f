"""torchrun worker (4 processes): routing replay on a tiny Qwen3-MoE at (TP, EP, PP) layouts, and one with context
and sequence parallelism over packed micro-batches.

Every sequence carries random routes (experts its router would not choose). Writes into the folder argv[1]:
- replay.json from global rank 0: per layout and rank, the log-prob error against transformers'
  Qwen3MoeForCausalLM with its routers forced to the same routes (on the ranks that hold results), how many router
  calls of a training step took other experts than their routes (of how many, and how many were recomputed
  forwards), and the step's loss; "missing": the error a sequence without routes raises; "forced_vs_own": how far
  the forced routes move transformers' log-probs from its own routing's;
- {tag}-rank{r}.pt: the weight change of one step with replay (as moe_worker.py writes it).
"""

import json
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from moe_worker import layout_tag, parallel_config
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences
from train_worker import batch, gathered_hf_state

from megatron_dapo.checkpoint.hf_weights import load_hf_weights, load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.routing_replay import RoutesMissing, routers_of
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample

# (TP, EP, PP, SP, micro-batch tokens, full recompute, CP, packed)
LAYOUTS = [(1, 1, 1, False, 100000, False, 1, False), (1, 2, 1, False, 62, False, 1, False),
           (2, 2, 1, True, 200, False, 1, False), (1, 2, 2, False, 200, True, 1, False),
           (2, 2, 1, True, 130, False, 2, True)]

# GLM-4.5-style routing (tiny_models' glm4_moe), forward only: (TP, EP, PP, SP)
GLM_LAYOUTS = [(1, 2, 1, False), (2, 2, 1, True)]


def tag_of(layout) -> str:
    tp, ep, pp, sp, mb, recompute, cp, packed = layout
    return layout_tag(tp, ep, pp, sp, mb, recompute) + (f"-cp{cp}" if cp > 1 else "") + ("-p" if packed else "")


def random_routes(n: int, spec, seed: int) -> torch.Tensor:
    """[n, MoE layers, k] distinct experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    layers = sum(spec.moe_layers)
    return torch.rand(n, layers, spec.num_experts, generator=g).argsort(-1)[..., : spec.moe_topk].to(torch.int16)


def routed(seqs, spec):
    return [Sequence(s.tokens, s.prompt_len, random_routes(s.tokens.numel(), spec, 100 + i)) for i, s in enumerate(seqs)]


@contextmanager
def hf_forced_routes(hf, routes):
    """transformers' routers take `routes` ([tokens, MoE layers, k] of the one sequence in the batch) instead of
    their top k; the probabilities are their scores at those experts as each router makes them: Qwen3-MoE's softmax,
    renormalised as norm_topk_prob says; GLM-4.5's sigmoid (no expert bias: it only chooses), renormalised and
    times routed_scaling_factor."""
    moe = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    saved = [g.forward for g in moe]

    def forced(gate, index):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            chosen = routes[: hidden.shape[0], index].long()
            if hasattr(gate, "e_score_correction_bias"):
                logits = torch.nn.functional.linear(hidden.float(), gate.weight.float())
                top = logits.sigmoid().gather(1, chosen)
                top = top / (top.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else top
                return logits, top * gate.routed_scaling_factor, chosen
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen
        return forward

    for i, g in enumerate(moe):
        g.forward = forced(g, i)
    try:
        yield
    finally:
        for g, f in zip(moe, saved):
            g.forward = f


@torch.no_grad()
def hf_forced_logprobs(hf, seqs):
    out = []
    for s in seqs:
        with hf_forced_routes(hf, s.routes):
            logits = hf(s.tokens[None]).logits[0].double()
        logp_all = torch.log_softmax(logits, -1)
        pos = torch.arange(s.prompt_len - 1, s.tokens.numel() - 1)
        out.append(logp_all[pos].gather(1, s.tokens[s.prompt_len:, None]).squeeze(1))
    return out


class RouteCheck:
    """Forward hooks on the routers: counts the calls whose routing map is not exactly the routes they were given,
    recomputed forwards (in the backward, from the routers' queues) included."""

    def __init__(self, model):
        self.calls = self.wrong = self.recomputed = 0
        self.queues = {}
        self.handles = []
        for r in routers_of(model):
            self.queues[r] = []
            self.handles.append(r.register_forward_hook(self._hook))
            setter = r.router_replay.set_target_indices

            def recording(indices, r=r, setter=setter):
                self.queues[r].append(indices)
                setter(indices)

            r.router_replay.set_target_indices = recording

    def _hook(self, router, args, output):
        _, routing_map = output
        replay = router.router_replay
        if replay.router_replay_action.value == "replay_forward":
            target = replay.target_topk_idx
        else:  # a recompute: the routes of the oldest forward not yet recomputed
            target = self.queues[router].pop(0)
            self.recomputed += 1
        expected = torch.zeros_like(routing_map).scatter_(1, target.to(routing_map.device).long(), True)
        self.calls += 1
        self.wrong += int(not torch.equal(routing_map, expected))

    def close(self):
        for h in self.handles:
            h.remove()


def replaying_model(spec, ckpt, parallel):
    """(this rank's stage built for replay, filled from `ckpt`, in eval mode; the runtime) at `parallel`."""
    from megatron.core import parallel_state

    runtime = init_runtime(parallel)
    model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE,
                        routing_replay=True)
    load_hf_weights(model, ckpt.get, spec, parallel)
    return model.eval(), runtime


def layout_case(out_dir, spec, ckpt, hf, layout, seqs, ref) -> dict:
    from megatron.core import parallel_state

    tp, ep, pp, sp, mb_tokens, recompute, cp, packed = layout
    parallel = parallel_config(tp, ep, pp, sp, cp)
    model, runtime = replaying_model(spec, ckpt, parallel)
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=96,
                            max_tokens_per_micro_batch=130, device=runtime.device, packed=packed)
    record = {}
    if out is not None:
        record["max_abs_logp"] = max((o[0].double().cpu() - r).abs().max().item() for o, r in zip(out, ref))
    missing = None
    if layout == LAYOUTS[0]:
        try:
            response_logprobs(model, [seqs[0], Sequence(seqs[1].tokens, seqs[1].prompt_len)], vocab_size=spec.vocab_size,
                              max_positions=96, max_tokens_per_micro_batch=130, device=runtime.device)
        except RoutesMissing as e:
            missing = str(e)
    del model
    optim = OptimConfig(lr=1e3, adam_eps=1e3, warmup_steps=0, weight_decay=0.0, clip_grad=0.0)
    trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(dual_clip_c=3.0), mb_tokens,
                            activation_recompute="full" if recompute else "none", params_dtype=PARITY_DTYPE,
                            moe_aux_loss_coef=0.0, routing_replay=True, packed=packed)
    load_policy_weights(trainer, ckpt.get)
    dp, dp_rank = runtime.data_parallel, parallel_state.get_data_parallel_rank()
    samples = [RolloutSample(s, r.old_logp, r.advantages, r.loss_mask) for s, r in
               zip(routed([r.sequence for r in batch(hf)], spec), batch(hf))][dp_rank::dp]
    check = RouteCheck(trainer.module)
    before = gathered_hf_state(trainer.module, spec, parallel)
    result = trainer.step(samples, measure_routing=True)
    after = gathered_hf_state(trainer.module, spec, parallel)
    check.close()
    tag = "replay-" + tag_of(layout)
    torch.save({k: after[k] - before[k] for k in after}, os.path.join(out_dir, f"{tag}-rank{dist.get_rank()}.pt"))
    record.update(router_calls=check.calls, wrong_calls=check.wrong, recomputed_calls=check.recomputed,
                  loss=result.loss, routing_agreement=result.routing_agreement)
    del trainer
    reset_parallel_layout()
    return record, missing


def glm_case(out_dir, layout) -> tuple[float | None, float]:
    """GLM-4.5-style routing replayed at `layout`: this rank's log-prob error against transformers forced to the
    same routes (None where it holds no results), and how far the forced routes are from its own routing's."""
    hf, _ = hf_model("glm4_moe")
    ckpt = HFCheckpoint(os.path.join(out_dir, f"hf_glm4_moe_rank{os.environ['RANK']}"))  # main() saved it
    spec = model_spec_from_hf(ckpt.config)
    seqs = routed(sequences(), spec)
    ref = hf_forced_logprobs(hf, seqs)
    own = max((r - o[0]).abs().max().item() for r, o in zip(ref, hf_response_logprobs(hf, seqs)))
    model, runtime = replaying_model(spec, ckpt, parallel_config(*layout))
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=96,
                            max_tokens_per_micro_batch=130, device=runtime.device)
    del model
    reset_parallel_layout()
    error = None if out is None else max((o[0].double().cpu() - r).abs().max().item() for o, r in zip(out, ref))
    return error, own


def main(out_dir: str) -> None:
    # saved before torch.distributed starts: transformers then saves from global rank 0 only
    hf_model("glm4_moe")[0].save_pretrained(os.path.join(out_dir, f"hf_glm4_moe_rank{os.environ['RANK']}"))
    hf, _ = hf_model("qwen3_moe")
    folder = os.path.join(out_dir, f"hf_qwen3_moe_rank{os.environ['RANK']}")
    hf.save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    spec = model_spec_from_hf(ckpt.config)
    seqs = routed(sequences(), spec)
    ref = hf_forced_logprobs(hf, seqs)
    own = hf_response_logprobs(hf, seqs)  # the routers' own choices
    results = {"forced_vs_own": max((r - o[0]).abs().max().item() for r, o in zip(ref, own))}
    for layout in LAYOUTS:
        record, missing = layout_case(out_dir, spec, ckpt, hf, layout, seqs, ref)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, record)
        results[tag_of(layout)] = found
        if missing is not None:
            results["missing"] = missing
    for layout in GLM_LAYOUTS:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, glm_case(out_dir, layout))
        results["glm4_moe-" + layout_tag(*layout)] = found
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "replay.json"), "w") as f:
            json.dump(results, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1])
