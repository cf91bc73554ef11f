"""torchrun worker: a rollout batch's responses -> training samples with the old policy's log-probs, truncated
IS weights, a KL reference and the mismatch metrics reduced over the world, at the layouts given; and the
in-process engine's refusal of the policy split at each of them.

argv: OUT_DIR LAYOUT [LAYOUT ...], a layout being tp,pp. Rank 0 writes OUT_DIR/tp{tp}-pp{pp}.json with the
largest differences from a host recomputation over the transformers reference.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE, hf_model, hf_response_logprobs, sequences

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.config import ConfigError, ParallelConfig
from megatron_dapo.parallel.rank_shares import PackedShare
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.mismatch import reduce_mismatch
from megatron_dapo.policy.model import build_model
from megatron_dapo.policy.rollout_samples import training_samples
from megatron_dapo.rollout.local_engine import LocalEngine
from megatron_dapo.samples import TrainItem

TIS_CAP = 1.05


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
    expected = {"tokens": r.numel(), "entropy_sum": torch.cat(entropies).sum().item(),
                "mismatch_k3_sum": (torch.exp(-r) + r - 1).sum().item(), "mismatch_abs_sum": r.abs().sum().item(),
                "tis_weight_sum": r.exp().clamp(max=TIS_CAP).sum().item(),
                "tis_capped": (r.exp() > TIS_CAP).sum().item(), "abs_max": r.abs().max().item(),
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


def run_layout(out_dir, tp, pp, hf, spec):
    from megatron.core import parallel_state

    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, device="cpu")
    runtime = init_runtime(parallel)
    stages = []
    for _ in range(2):  # the policy and the frozen KL reference
        model = build_model(spec, parallel, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(), params_dtype=PARITY_DTYPE)
        load_hf_weights(model, hf.state_dict().__getitem__, spec, parallel)
        stages.append(model.eval())
    items, expected, reference = items_and_expected(hf)
    samples, sums, abs_max, _ = training_samples(stages[0], stages[1], PackedShare.pack([items]), spec=spec,
                                                 max_tokens_per_micro_batch=100, device=runtime.device,
                                                 tis_cap=TIS_CAP)
    metrics = reduce_mismatch(sums, abs_max)
    _, sums, abs_max, _ = training_samples(stages[0], stages[1], PackedShare.pack([items]), spec=spec,
                                           max_tokens_per_micro_batch=100, device=runtime.device, tis_cap=None,
                                           old_logprobs="rollout")
    rollout_metrics = reduce_mismatch(sums, abs_max)
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
                  "local_engine_refusal": refusal}
        with open(os.path.join(out_dir, f"tp{tp}-pp{pp}.json"), "w") as f:
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
