"""torchrun worker (1 process): the distributed route keeps working across a server restart.

Sync changed weights as version 1, signal the test (SYNCED file) and wait while it stops the server
(STOPPED); sync with the server left out (skip: it is down), which leaves the weight-update group, and say
so (SKIPPED); wait while the test starts it again (RESTARTED); change the weights again and sync version 2,
which has to form the group anew; then check the server's new samples against the policy.

argv: OUT_JSON MODEL_DIR SERVER_URL FLAG_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch
from tiny_models import PARITY_DTYPE
from weight_sync_worker import parity, sample, versions

from megatron_dapo.checkpoint.hf_weights import load_policy_weights
from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer
from megatron_dapo.weight_sync import make_weight_syncer


def perturb(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))


def wait_for(flag: Path) -> None:
    deadline = time.monotonic() + 600
    while not flag.exists():
        assert time.monotonic() < deadline, f"the test did not write {flag.name}"
        time.sleep(0.5)


def policy(model_dir, parallel: ParallelConfig):
    """The runtime up, and a policy holding the model's weights: (trainer, spec, its HF config, the runtime)."""
    runtime = init_runtime(parallel)
    ckpt = HFCheckpoint(model_dir)
    spec = model_spec_from_hf(ckpt.config)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(warmup_steps=0), LossConfig(), 512,
                            params_dtype=PARITY_DTYPE)
    load_policy_weights(trainer, ckpt.get)
    return trainer, spec, ckpt.config, runtime


def main(out_json, model_dir, url, flag_dir):
    parallel = ParallelConfig(device="cpu", seed=3)
    trainer, spec, hf_config, runtime = policy(model_dir, parallel)
    syncer = make_weight_syncer("distributed", [url], spec, parallel, hf_config, bucket_mb=0.05)
    perturb(trainer.module, 1)
    syncer.sync(trainer.module, "1")
    first = sample(url)
    (Path(flag_dir) / "SYNCED").touch()
    wait_for(Path(flag_dir) / "STOPPED")
    skipped = syncer.sync(trainer.module, "1", skip=[url])  # the trainer's side only: no server to push to
    members_while_down = syncer.members if skipped is None else "metrics: pushed somewhere"
    (Path(flag_dir) / "SKIPPED").touch()
    wait_for(Path(flag_dir) / "RESTARTED")
    restarted = sample(url)
    perturb(trainer.module, 2)
    syncer.sync(trainer.module, "2")
    after = sample(url)
    syncer.close()
    result = {"skipped_members": members_while_down,
              "first": parity(trainer, spec, runtime, first)[0], "versions_first": versions(first),
              "restarted": parity(trainer, spec, runtime, restarted)[0], "versions_restarted": versions(restarted),
              "after": parity(trainer, spec, runtime, after)[0], "versions_after": versions(after)}
    Path(out_json).write_text(json.dumps(result))
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
