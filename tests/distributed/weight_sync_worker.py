"""torchrun worker: one optimizer step at TP x PP, weights synced into a running SGLang server through
disk, then new samples from the server checked against the updated policy's log-probs.

argv: OUT_JSON MODEL_DIR SERVER_URL WORK_DIR TP PP
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.hf_weights import load_hf_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.runtime import init_runtime, shutdown_runtime
from megatron_dapo.weight_sync.disk import sync_weights_via_disk

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
    seqs = [Sequence(torch.tensor(p + o), len(p)) for p, o, _, _ in samples]
    out = response_logprobs(trainer.module.eval(), seqs, vocab_size=spec.vocab_size,
                            max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=512,
                            device=runtime.device)
    trainer.module.train()
    if out is None:
        return None, seqs
    return max((o[0].double() - torch.tensor(lp, dtype=torch.float64)).abs().max().item()
               for o, (_, _, lp, _) in zip(out, samples)), seqs


def main(out_json, model_dir, url, work_dir, tp, pp):
    from megatron.core import parallel_state

    parallel = ParallelConfig(tensor_parallel=int(tp), pipeline_parallel=int(pp), device="cpu", seed=3)
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=2e-2, warmup_steps=0), LossConfig(), 512)
    load_hf_weights(trainer.module, ckpt.get, spec, parallel)
    before = sample(url)
    before_diff, seqs = parity(trainer, spec, runtime, before)
    adv = torch.tensor([1.0, -1.0] * (len(seqs) // 2))
    old = [torch.tensor(lp) for _, _, lp, _ in before]
    batch = [RolloutSample(s, o, adv[i].expand(s.response_len).clone(), torch.ones(s.response_len, dtype=torch.bool))
             for i, (s, o) in enumerate(zip(seqs, old))]
    trainer.step(batch)
    metrics = sync_weights_via_disk(trainer.module, spec, parallel, server_urls=[url], directory=work_dir,
                                    version="1", hf_config=ckpt.config)
    after = sample(url)
    after_diff, _ = parity(trainer, spec, runtime, after)
    stale_diff, _ = parity(trainer, spec, runtime, before)  # the old samples against the new weights
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        result = {"before": before_diff, "after": after_diff, "stale": stale_diff,
                  "versions_before": sorted({v for *_, v in before}), "versions_after": sorted({v for *_, v in after}),
                  "samples_after": len(after)}
        if metrics is not None:
            result.update(bytes=metrics.bytes, seconds=metrics.seconds)
        with open(out_json, "w") as f:
            json.dump(result, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
