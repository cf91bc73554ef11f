"""Test-only `megatron-dapo train` with one fault injected (torchrun fault_launcher.py train CONFIG ...).

The fault is chosen by the environment; the production code has no hook for it:
  DAPO_FAULT=ckpt_enospc  on rank DAPO_FAULT_RANK, every torch.save into the checkpoint of step DAPO_FAULT_STEP
                          raises OSError(ENOSPC)
  DAPO_FAULT=ckpt_stall   rank 0 writes that checkpoint's trainer_state.json (its last file before the COMPLETE
                          marker) and then sleeps for an hour: the test kills the run there
  DAPO_FAULT=nan_logprobs from rollout step DAPO_FAULT_STEP on, the old log-probs of the first micro-batch of
                          rank DAPO_FAULT_RANK's share are NaN
  DAPO_FAULT=inf_lr       from rollout step DAPO_FAULT_STEP on, the optimizer's learning rate is inf (as optim.lr: .inf
                          was, before the config refused it): the gradients are finite, the update is not
Each fault writes time.time() to DAPO_FAULT_SIGNAL when it fires (the ckpt_stall one once the file is written).
With nan_logprobs the driver also appends to DAPO_FAULT_SIGNAL.batches one JSON line per step: the step, the
weight version its batch was sampled by and its prompts (dataset rows).
"""

import errno
import json
import os
import sys
import time
from pathlib import Path

# torch is imported by the faults that need it, not here: multiprocessing's spawned children of the run (its reward
# workers, rollout service, checkpoint helper) import this module again as their __main__.


def fired(note: str = "") -> None:
    with open(os.environ["DAPO_FAULT_SIGNAL"], "w") as f:
        f.write(f"{time.time()!r}\n{note}")


def checkpoint_folder() -> str:
    return f"step_{int(os.environ['DAPO_FAULT_STEP']):06d}.tmp"


def inject_ckpt_enospc() -> None:
    import torch
    import torch.distributed as dist

    save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if (isinstance(f, (str, os.PathLike)) and checkpoint_folder() in Path(f).parts  # not into a buffer
                and dist.get_rank() == int(os.environ["DAPO_FAULT_RANK"])):
            fired(str(f))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return save(obj, f, *args, **kwargs)

    torch.save = failing_save


def inject_ckpt_stall() -> None:
    write_text = Path.write_text

    def stalling_write_text(self, *args, **kwargs):
        written = write_text(self, *args, **kwargs)
        if self.name == "trainer_state.json" and self.parent.name == checkpoint_folder():
            fired(str(self))
            time.sleep(3600)
        return written

    Path.write_text = stalling_write_text


def inject_nan_logprobs() -> None:
    import torch
    import torch.distributed as dist

    from megatron_dapo.policy import rollout_samples
    from megatron_dapo.policy.batch import micro_batches
    from megatron_dapo.loop.batch_feed import BatchFeed

    recompute, share = rollout_samples.response_logprobs, BatchFeed.next_share
    calls = [0]  # old log-prob passes: one per rollout step (no reference model)

    def poisoned(model, seqs, **kwargs):
        out = recompute(model, seqs, **kwargs)
        calls[0] += 1
        if (calls[0] >= int(os.environ["DAPO_FAULT_STEP"]) and out is not None
                and dist.get_rank() == int(os.environ["DAPO_FAULT_RANK"])):
            for i in micro_batches(seqs, kwargs["max_tokens_per_micro_batch"])[0].sample_index:
                out[i] = (torch.full_like(out[i][0], float("nan")), out[i][1])
            fired(f"step {calls[0]}")
        return out

    def recorded_share(self, step):
        result = share(self, step)
        if self.driver:
            record = {"step": step + 1, "weight_version": result[1].get("weight_version"),
                      "prompts": self.batch_prompts}
            with open(os.environ["DAPO_FAULT_SIGNAL"] + ".batches", "a") as f:
                f.write(json.dumps(record) + "\n")
        return result

    rollout_samples.response_logprobs = poisoned
    BatchFeed.next_share = recorded_share


def inject_inf_lr() -> None:
    from megatron_dapo.config import OptimConfig

    lr_at = OptimConfig.lr_at

    def infinite_from_the_step(self, update, updates_per_step=1):
        if update // updates_per_step + 1 >= int(os.environ["DAPO_FAULT_STEP"]):
            fired(f"update {update}")
            return float("inf")
        return lr_at(self, update, updates_per_step)

    OptimConfig.lr_at = infinite_from_the_step


if __name__ == "__main__":
    from megatron_dapo import cli

    {"ckpt_enospc": inject_ckpt_enospc, "ckpt_stall": inject_ckpt_stall,
     "nan_logprobs": inject_nan_logprobs, "inf_lr": inject_inf_lr}[os.environ["DAPO_FAULT"]]()
    sys.exit(cli.main(sys.argv[1:]))
