"""torchrun worker: for each layout in turn, one optimizer step at that layout, then, for each weight-sync route
in turn, the running SGLang server is put back to the original weights and synced through that route; new
samples from the server are checked against the updated policy's log-probs. The layouts share one start of
the ranks (each is set up anew on the same torch.distributed group), which is most of a layout's CPU here.

argv: OUT_JSON MODEL_DIR SERVER_URL WORK_DIR LAYOUTS ROUTES BUCKET_MB, both lists comma-separated, a layout
named by its sizes: tp2, pp2, cp2, ep2 (a mixture of experts' experts over the data-parallel ranks), tp2pp2...
OUT_JSON: layout -> its record.
"""

import json
import re
import sys

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE

from megatron_dapo.checkpoint.hf_weights import load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, reset_parallel_layout, shutdown_runtime
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import post_json
from megatron_dapo.weight_sync import make_weight_syncer

PROMPTS = [[5, 17, 40, 33], [8, 9, 10], [60, 61, 62, 63, 64], [100, 7]]


def sample(url, n=4):
    """Rank 0 samples; every rank gets the same list of (prompt, output, logprobs, version)."""
    box = [None]
    if dist.get_rank() == 0:
        groups = SGLangEngine(url).generate(PROMPTS, n, SamplingParams(max_new_tokens=12))
        box[0] = [(PROMPTS[s.prompt_index], s.output_ids, s.logprobs, s.weight_version) for g in groups for s in g]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def parity(trainer, spec, runtime, samples):
    """Max |server log-prob - policy log-prob| over the samples (on the last stage; None elsewhere)."""
    seqs = [Sequence(torch.tensor(p + o), len(p)) for p, o, _, _ in samples]
    out = response_logprobs(trainer.module.eval(), seqs, vocab_size=spec.vocab_size,
                            max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=512,
                            device=runtime.device)
    trainer.module.train()
    if out is None:
        return None, seqs
    return max((o[0].double().cpu() - torch.tensor(lp, dtype=torch.float64)).abs().max().item()
               for o, (_, _, lp, _) in zip(out, samples)), seqs


def reset_server(url, model_dir):
    if dist.get_rank() == 0:
        reply = post_json(f"{url}/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"}, 300)
        assert reply["success"], reply
    dist.barrier()


def versions(samples):
    return sorted({v for *_, v in samples})


def parallel_config(layout: str) -> ParallelConfig:
    sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}
    parts = re.findall(r"(tp|pp|cp|ep)(\d+)", layout)
    assert parts and "".join(k + n for k, n in parts) == layout, f"layout {layout!r}: expected e.g. tp2 or tp2pp2"
    sizes.update({k: int(n) for k, n in parts})
    return ParallelConfig(tensor_parallel=sizes["tp"], pipeline_parallel=sizes["pp"], context_parallel=sizes["cp"],
                          expert_parallel=sizes["ep"], device="cpu", seed=3)


def run_layout(parallel, model_dir, url, work_dir, routes, bucket_mb):
    """This layout's record on the rank that reports it (the last stage's first TP, DP and CP rank), else None."""
    from megatron.core import parallel_state

    runtime = init_runtime(parallel)
    reset_server(url, model_dir)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=2e-2, warmup_steps=0), LossConfig(), 512,
                            params_dtype=PARITY_DTYPE)
    load_policy_weights(trainer, ckpt.get)
    before = sample(url)
    before_diff, seqs = parity(trainer, spec, runtime, before)
    adv = torch.tensor([1.0, -1.0] * (len(seqs) // 2))
    old = [torch.tensor(lp) for _, _, lp, _ in before]
    batch = [RolloutSample(s, o, adv[i].expand(s.response_len).clone(), torch.ones(s.response_len, dtype=torch.bool))
             for i, (s, o) in enumerate(zip(seqs, old))]
    trainer.step(batch)
    stale_diff, _ = parity(trainer, spec, runtime, before)  # the old samples against the new weights
    result = {"before": before_diff, "stale": stale_diff, "versions_before": versions(before), "routes": {}}
    for route in routes.split(","):
        reset_server(url, model_dir)
        reset = sample(url)
        reset_diff, _ = parity(trainer, spec, runtime, reset)
        syncer = make_weight_syncer(route, [url], spec, parallel, ckpt.config, bucket_mb=float(bucket_mb),
                                    work_dir=f"{work_dir}/{route}")
        metrics = syncer.sync(trainer.module, "1")
        after = sample(url)
        after_diff, _ = parity(trainer, spec, runtime, after)
        syncer.close()
        metrics = [metrics]
        dist.broadcast_object_list(metrics, src=0)
        result["routes"][route] = {
            "reset": reset_diff, "versions_reset": versions(reset), "after": after_diff,
            "versions_after": versions(after), "samples_after": len(after),
            "bytes": metrics[0].bytes, "seconds": metrics[0].seconds}
    reports = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
        and parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
    reset_parallel_layout()
    return result if reports else None


def main(out_json, model_dir, url, work_dir, layouts, routes, bucket_mb):
    records = {}
    for layout in layouts.split(","):
        record = run_layout(parallel_config(layout), model_dir, url, f"{work_dir}/{layout}", routes, bucket_mb)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, record)
        records[layout] = next(r for r in gathered if r is not None)
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump(records, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
