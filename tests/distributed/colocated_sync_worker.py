"""torchrun worker (2 processes, PP=2): a colocated step against a real SGLang server.

The two ranks pose as two nodes, "a" (rank 0) and "b" (rank 1), and the server as b's: the tensor route must
then feed it from rank 1, which receives every full tensor (stage 0's from rank 0). First both ranks receive
the full tensors at once (`iter_hf_tensors` with two receivers) and compare them with the checkpoint. Then
one optimizer step, and the colocated order of the trainer: release the server's memory, resume its
weights, sync, resume its caches; the server's new samples must match the updated policy.

argv: OUT_JSON MODEL_DIR SERVER_URL BUCKET_MB
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from tiny_models import PARITY_DTYPE

from megatron_dapo.checkpoint.hf_export import iter_hf_tensors
from megatron_dapo.checkpoint.hf_weights import load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample
from megatron_dapo.rollout.server_memory import ServerMemory
from megatron_dapo.weight_sync import make_weight_syncer
from weight_sync_worker import parity, reset_server, sample, versions


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main(out_json, model_dir, url, bucket_mb):
    from megatron.core import parallel_state

    parallel = ParallelConfig(tensor_parallel=1, pipeline_parallel=2, device="cpu", seed=3)
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=2e-2, warmup_steps=0), LossConfig(), 512,
                            params_dtype=PARITY_DTYPE)
    load_policy_weights(trainer, ckpt.get)

    full = [(name, (t.cpu() - ckpt.get(name)).abs().max().item()) for name, t in
            iter_hf_tensors(trainer.module, spec, parallel, receivers=[0, 1])]
    received = gathered(full)

    reset_server(url, model_dir)
    before = sample(url)
    seqs = parity(trainer, spec, runtime, before)[1]
    adv = torch.tensor([1.0, -1.0] * (len(seqs) // 2))
    batch = [RolloutSample(s, torch.tensor(lp), adv[i].expand(s.response_len).clone(),
                           torch.ones(s.response_len, dtype=torch.bool))
             for i, (s, (_, _, lp, _)) in enumerate(zip(seqs, before))]
    trainer.step(batch)
    stale_diff, _ = parity(trainer, spec, runtime, before)  # the old samples against the new weights

    node = "a" if dist.get_rank() == 0 else "b"
    syncer = make_weight_syncer("tensor", [url], spec, parallel, ckpt.config, bucket_mb=float(bucket_mb),
                                server_nodes=["b"], node=node)
    memory = ServerMemory([url], runtime.device)
    seconds, results = {}, {}
    for what, call in [("release", memory.release), ("resume_weights", memory.resume_weights),
                       ("sync", lambda: syncer.sync(trainer.module, "1")), ("resume_caches", memory.resume_caches)]:
        start = time.perf_counter()
        results[what] = call()
        seconds[what] = time.perf_counter() - start
    # the sync's metrics come back on the ranks that pushed
    pushed = gathered(None if results["sync"] is None else results["sync"].bytes)
    after = sample(url)
    after_diff, _ = parity(trainer, spec, runtime, after)
    syncer.close()
    if parallel_state.is_pipeline_last_stage():
        with open(out_json, "w") as f:
            json.dump({"received": received, "pushers": syncer.pushers, "pushed": pushed, "seconds": seconds,
                       "stale": stale_diff, "after": after_diff,
                       "versions_after": versions(after), "samples_after": len(after)}, f)
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
