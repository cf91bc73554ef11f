"""torchrun worker: a rollout batch's responses -> training samples with the old policy's log-probs, the rollout
correction's weights, a KL reference and the mismatch metrics reduced over the world, at the layouts given; and the
in-process engine's refusal of the policy split at each of them.

argv: OUT_DIR LAYOUT [LAYOUT ...], a layout being tp,pp,cp,packed,max_tokens_per_micro_batch. Rank 0 writes
OUT_DIR/tp{tp}-pp{pp}-cp{cp}.json with the largest differences from a host recomputation over the transformers
reference.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.ops.rollout_correction_reference import correction_weights_reference
from megatron_dapo.parallel.rank_shares import PackedShare
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.mismatch import reduce_mismatch
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.rollout_samples import training_samples
from megatron_dapo.rollout.local_engine import LocalEngine
from megatron_dapo.samples import TrainItem

TIS_CAP = 1.05
TOKEN_TIS = {"level": "token", "action": "truncate", "lower": None, "upper": TIS_CAP}
# A band each responses' ratios straddle here (the engine's log-probs are 0.05-noisy per token): some leave the loss.
CORRECTIONS = {"token_truncate": TOKEN_TIS,
               "sequence_mask": {"level": "sequence", "action": "mask", "lower": 0.95, "upper": 1.05},
               "geometric_reject": {"level": "geometric", "action": "reject", "lower": 0.99, "upper": 1.01}}


def items_and_expected(hf):
    """Responses whose engine log-probs are the policy's plus noise; the metrics a host computes for them."""
    seqs = sequences(seed=3)
    g = torch.Generator().manual_seed(9)
    items, log_ratios, entropies = [], [], []
    for i, (s, (logp, entropy)) in enumerate(zip(seqs, hf_response_logprobs(hf, seqs))):
        rollout = logp + 0.05 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
        in_loss = i != 1  # one response left out of the loss (overlong filtering)
        items.append(TrainItem(s.tokens[:s.prompt_len].tolist(), s.tokens[s.prompt_len:].tolist(),
                               rollout.tolist(), advantage=float(i) - 2.0, in_loss=in_loss))
        if in_loss:
            log_ratios.append(logp - rollout)
            entropies.append(entropy)
    r = torch.cat(log_ratios)
    seq = torch.stack([x.sum() for x in log_ratios])
    expected = {"tokens": r.numel(), "entropy_sum": torch.cat(entropies).sum().item(),
                "mismatch_k3_sum": (torch.exp(r) - r - 1).sum().item(), "mismatch_abs_sum": r.abs().sum().item(),
                "token_ratio_sum": r.exp().sum().item(), "token_ratio_sq_sum": r.exp().square().sum().item(),
                "sequences": len(log_ratios), "seq_ratio_sum": seq.exp().sum().item(),
                "seq_log_ratio_sum": seq.sum().item(), "seq_log_ratio_sq_sum": seq.square().sum().item(),
                "weight_sum": r.exp().clamp(max=TIS_CAP).sum().item(), "masked_tokens": 0, "masked_sequences": 0,
                "abs_max": r.abs().max().item(), "token_ratio_max": r.exp().max().item(),
                "seq_ratio_max": seq.exp().max().item(),
                # With the engine's log-probs taken as pi_old (loss.old_logprobs "rollout"), the reference (the
                # policy's weights) is r away from them: k3 of log pi_ref - log pi_old.
                "rollout_reference_k3_sum": (torch.exp(r) - r - 1).sum().item()}
    return items, expected, [lp for lp, _ in hf_response_logprobs(hf, seqs)]


def local_engine_refusal(model, spec, device) -> str:
    try:
        LocalEngine(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings, eos_token_ids=[0],
                    device=device)
    except ConfigError as e:
        return str(e)
    raise AssertionError("LocalEngine accepted a split policy")


def reference_weights(items, reference) -> dict[str, list[list[float]]]:
    """Each correction's weights, per response, from the transformers reference's log-probs (float64)."""
    log_ratios = [(lp - torch.tensor(item.rollout_logp, dtype=torch.float64)).tolist()
                  for item, lp in zip(items, reference)]
    in_loss = [[item.in_loss] * len(r) for item, r in zip(items, log_ratios)]
    return {name: correction_weights_reference(log_ratios, in_loss, **rule) for name, rule in CORRECTIONS.items()}


def run_layout(out_dir, tp, pp, cp, packed, max_tokens, hf, spec):
    from megatron.core import parallel_state

    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, device="cpu")
    runtime = init_runtime(parallel)
    stages = []
    for _ in range(2):  # the policy and the frozen KL reference
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE)
        load_hf_weights(model, hf.state_dict().__getitem__, spec, parallel)
        stages.append(model.eval())
    items, expected, reference = items_and_expected(hf)
    share = PackedShare.pack([items])
    kwargs = dict(spec=spec, max_tokens_per_micro_batch=max_tokens, device=runtime.device, packed=bool(packed))
    samples, sums, maxima, _ = training_samples(stages[0], stages[1], share, correction=TOKEN_TIS, **kwargs)
    metrics = reduce_mismatch(sums, maxima)
    _, sums, maxima, _ = training_samples(stages[0], stages[1], share, old_logprobs="rollout", **kwargs)
    rollout_metrics = reduce_mismatch(sums, maxima)
    # Each correction's weights as the loss gets them, against the host's from the reference's log-probs: a
    # response's sequence-level weight is its whole own, however the layout splits it.
    want = reference_weights(items, reference)
    weight_err, masked = {}, {}
    for name, rule in CORRECTIONS.items():
        got = training_samples(stages[0], None, share, correction=rule, **kwargs)[0]
        weight_err[name] = max(abs(g - w) / max(w, 1e-9) for s, ws in zip(got, want[name])
                               for g, w in zip(s.loss_weight.tolist(), ws))
        masked[name] = sum(w == 0 for ws in want[name] for w in ws)
    old_err = max((s.old_logp.double().cpu() - r).abs().max().item() for s, r in zip(samples, reference))
    ref_err = max((s.ref_logp.double().cpu() - r).abs().max().item() for s, r in zip(samples, reference))
    on_device = all(t.is_cuda for s in samples
                    for t in (s.old_logp, s.advantages, s.loss_mask, s.loss_weight, s.ref_logp))
    refusal = local_engine_refusal(stages[0], spec, runtime.device)
    if dist.get_rank() == 0:
        record = {"old_logp_err": old_err, "ref_logp_err": ref_err, "on_device": on_device,
                  "dtypes": [str(samples[0].loss_mask.dtype), str(samples[0].loss_weight.dtype)],
                  "left_out_masked": not bool(samples[1].loss_mask.any()),
                  "metrics": metrics, "rollout_metrics": rollout_metrics, "expected": expected,
                  "local_engine_refusal": refusal, "weight_err": weight_err, "masked": masked}
        with open(os.path.join(out_dir, f"tp{tp}-pp{pp}-cp{cp}.json"), "w") as f:
            json.dump(record, f)
    reset_parallel_layout()


def main(out_dir, layouts):
    hf, cfg = hf_model("qwen2")
    spec = model_spec_from_hf(cfg)
    for layout in layouts:
        run_layout(out_dir, *map(int, layout.split(",")), hf, spec)
    shutdown_runtime()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
