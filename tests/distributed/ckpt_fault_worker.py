"""torchrun worker (2 ranks, TP=2): a checkpoint write that fails on one rank.

argv: OUT_DIR FAULT [FAULT ...], each FAULT being WHAT@RANK: the write that raises OSError(ENOSPC) on that rank
while the checkpoint of step 2 is written into OUT_DIR/FAULT/checkpoints (the one of step 1 was written whole):
  rng     this rank's RNG file (torch.save, ours)
  shard   a model shard (megatron-core's shard writer, in the process it forks)
  state   trainer_state.json (rank 0 alone writes it, right before the COMPLETE marker)
  common  megatron-core's common.pt (its coordinator alone writes it, outside its collective error path: the
          other rank waits in the save, and the launcher stops it)
The faults come one after the other in one run (one start of the ranks, not one each), each undone after its
save. The injected fault writes time.time() to OUT_DIR/FAULT/fault_time. Each rank that gets a
CheckpointWriteError writes OUT_DIR/FAULT/rank{r}.json (the error, the latest checkpoint it sees, when it was
raised); the last error is re-raised at the end, as the trainer raises it: the run exits non-zero.
"""

import errno
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import hf_model
from train_worker import batch

from megatron_dapo.checkpoint.hf_weights import load_policy_weights
from megatron_dapo.checkpoint.trainer_checkpoint import (
    STATE_FILE,
    CheckpointWriteError,
    latest_checkpoint,
    save_trainer_checkpoint,
)
from megatron_dapo.config import ParallelConfig
from megatron_dapo.parallel.runtime import init_runtime, shutdown_runtime
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer


def disk_full(out_dir: str, path) -> OSError:
    Path(out_dir, "fault_time").write_text(repr(time.time()))
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def inject(out_dir: Path, what: str) -> Callable[[], None]:
    """Make this rank's `what` write of the step-2 checkpoint fail; returns what undoes it."""
    if what in ("rng", "common"):
        save = torch.save
        name = {"rng": f"rank_{dist.get_rank():05d}.pt", "common": "common.pt"}[what]

        def failing_save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and Path(f).name == name:  # not into a buffer
                raise disk_full(out_dir, f)
            return save(obj, f, *args, **kwargs)

        torch.save = failing_save
        return lambda: setattr(torch, "save", save)
    if what == "shard":
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        write_item = filesystem_async._write_item

        def failing_write(*args, **kwargs):
            raise disk_full(out_dir, "a model shard")

        filesystem_async._write_item = failing_write  # the forked writer processes inherit it
        return lambda: setattr(filesystem_async, "_write_item", write_item)
    if what == "state":
        write_text = Path.write_text

        def failing_write_text(self, *args, **kwargs):
            if self.name == STATE_FILE:
                raise disk_full(out_dir, self)
            return write_text(self, *args, **kwargs)

        Path.write_text = failing_write_text
        return lambda: setattr(Path, "write_text", write_text)
    raise ValueError(what)


def main(out_dir: str, *faults: str) -> None:
    hf, cfg = hf_model("qwen2")
    spec = model_spec_from_hf(cfg)
    parallel = ParallelConfig(tensor_parallel=2, device="cpu", seed=7)
    runtime = init_runtime(parallel)
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=1e-3), LossConfig(), 200)
    load_policy_weights(trainer, hf.state_dict().__getitem__)
    samples = batch(hf)
    error = None
    for fault in faults:
        what, rank = fault.split("@")
        case = Path(out_dir, fault)
        case.mkdir(exist_ok=True)
        root = case / "checkpoints"
        trainer.step(samples)
        save_trainer_checkpoint(root, 1, trainer, {}, keep_last=1)
        trainer.step(samples)
        undo = inject(case, what) if dist.get_rank() == int(rank) else lambda: None
        try:
            save_trainer_checkpoint(root, 2, trainer, {}, keep_last=1)
        except CheckpointWriteError as e:
            record = {"error": str(e), "latest": str(latest_checkpoint(root)), "raised_at": time.time()}
            (case / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
            error = e
        finally:
            undo()
    if error is not None:
        raise error
    shutdown_runtime()


if __name__ == "__main__":
    main(*sys.argv[1:])
