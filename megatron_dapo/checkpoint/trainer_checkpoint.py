"""Checkpoints of a training run, for an exact resume.

A checkpoint is one folder, ROOT/step_000123/, holding
  model/               the policy's weights (megatron-core dist_checkpointing, loads at any TP x PP;
                       tools/convert_checkpoint.py mcore-to-hf --hf-config MODEL_DIR converts it)
  optimizer/           the optimizer's state (the distributed optimizer's in megatron-core's fully
                       reshardable format: it too loads at another TP x PP x DP)
  rng/rank_00000.pt    each rank's RNG states: python, numpy, torch (CPU, and CUDA on GPUs), megatron's tracker
  trainer_state.json   the step, the model's shape, the layout, and the caller's `extra`
  driver/NAME.pt       the caller's rank-0 state too large for JSON (the batch sampled for the next step)
  COMPLETE             written last
It is written as step_000123.tmp/ and renamed when complete, so a crash leaves the earlier
checkpoints and a leftover that `latest_checkpoint` ignores (the next save deletes it); older checkpoints
are pruned only after the rename. Save and load are collective over all trainer ranks; rank 0 alone writes
the shared files and renames. A write that fails on any rank (disk full, an I/O error) is agreed on by every
rank before the next collective step: each raises CheckpointWriteError, the leftover is deleted, and the
previous complete checkpoint stays the latest. (The files megatron-core's coordinator writes alone are the
exception, _save_sharded: that rank raises at once, and the launcher stops the others.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.checkpoint.mcore_checkpoint import load_model, save_model, write_meta
from megatron_dapo.checkpoint.safetensors_io import CheckpointError
from megatron_dapo.config import ConfigError
from megatron_dapo.policy.finite_weights import nonfinite_on_any_rank
from megatron_dapo.policy.hf_config import spec_differences
from megatron_dapo.user_files import read_json

log = logging.getLogger(__name__)

FORMAT = 1
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
MODEL_DIR, OPTIMIZER_DIR, RNG_DIR, DRIVER_DIR = "model", "optimizer", "rng", "driver"
_NAME = re.compile(r"step_(\d+)")
# Gathers the optimizer state into model-shaped tensors: a checkpoint loads at another TP x PP x DP.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, an I/O error); the previous complete one is still the latest."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def complete_checkpoints(root) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (.tmp leftovers and unmarked folders left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and path.is_dir() and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; returns the deleted folders."""
    old = complete_checkpoints(root)[:-keep_last]
    for path in old:
        shutil.rmtree(path)
    return old


def _layout() -> dict:
    from megatron.core import parallel_state

    return {"tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel": parallel_state.get_data_parallel_world_size(),
            "world_size": dist.get_world_size()}


def _optimizers(trainer) -> list:
    """The trainer's megatron optimizers, as get_megatron_optimizer chains them: one for a dense model; for a
    mixture of experts a second one for the experts' parameters, which are split over other data-parallel ranks."""
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def _allocate_torch_adam_state(opt) -> None:
    """megatron-core's distributed optimizer reads torch Adam's per-parameter `step` whenever it builds
    a sharded state dict, so an optimizer that has not stepped yet needs its state allocated first."""
    inner = opt.optimizer
    if not isinstance(inner, torch.optim.Adam):
        return  # TE / apex FusedAdam keep the step in the param groups
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state[p]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def _optimizer_sharded_state(trainer, is_loading: bool):
    """The optimizers' sharded state: a dense model's one as it is; several keyed by their index, each one's tensors
    prefixed with it, as megatron-core's ChainedOptimizer saves them."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    opts = _optimizers(trainer)
    model_state = trainer.module.sharded_state_dict()
    states = {}
    for i, opt in enumerate(opts):
        if _is_distributed(opt):
            _allocate_torch_adam_state(opt)
        states[i] = opt.sharded_state_dict(model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT)
        if len(opts) > 1:
            add_prefix_for_sharding(states[i], f"chained_{i}.")
    return states[0] if len(opts) == 1 else states


def _load_optimizer(trainer, state: dict) -> None:
    opts = _optimizers(trainer)
    for opt, own in zip(opts, [state] if len(opts) == 1 else [state[i] for i in range(len(opts))]):
        _load_one_optimizer(opt, own)


def _load_one_optimizer(opt, state: dict) -> None:
    """load_state_dict, but for the distributed optimizer with torch Adam's `step` handled: megatron-core
    0.16 expects a `step` among the loaded per-parameter tensors (it is not there: it lives in the param
    groups) and gives every parameter one shared step tensor, which Adam would then advance once per
    parameter. So: common state and step first, tensors without `step`, then a step per parameter."""
    if not _is_distributed(opt):
        opt.load_state_dict(state)
        return
    state = dict(state)
    param_state = state.pop("param_state")
    state.pop("param_state_sharding_type")
    opt.load_state_dict(state)
    inner = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    try:
        with torch.no_grad():
            opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step.clone()


def _rng_state(on_gpu: bool) -> dict:
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached),
             "torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, on_gpu: bool) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if on_gpu:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rank0_then_share(fn, *args):
    """Run `fn` on rank 0; every rank returns its result, or raises its error (no rank is left waiting)."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[1] = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return box[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(root: Path, tmp: Path, step: int, errors: list[str]) -> CheckpointWriteError:
    latest = latest_checkpoint(root)
    still = (f"the latest complete checkpoint is still {latest} (a rerun resumes from it)" if latest is not None
             else "there is no complete checkpoint yet (a rerun starts from the beginning)")
    return CheckpointWriteError(f"{tmp}: the checkpoint of step {step} could not be written: {'; '.join(errors)}; "
                                f"{still}. Free space in {root} (or fix the error above) and rerun")


def _agree(root: Path, tmp: Path, step: int, error: str | None) -> None:
    """Collective: every rank says how its part of a write step went (`error`, None if it went well); if any
    failed, every rank raises the same CheckpointWriteError, rather than wait in the next collective step for
    a rank that stopped. `error` "": failed, with the details in another rank's error."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if all(e is None for e in errors):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # every rank is done with it: the space the partial write took is freed
    raise _write_error(root, tmp, step, list(dict.fromkeys(e for e in errors if e)))


def _attempt(fn, *args) -> str | None:
    """This rank's part of a write step (for _agree): None if `fn` went well, else its error, naming the rank."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - agreed on and raised on every rank by _agree
        return f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    return None


def _save_sharded(save, root: Path, tmp: Path, step: int) -> None:
    """Collective: megatron-core's dist_checkpointing `save`, its failure raised on every rank (_agree)."""
    try:
        save()
    except CheckpointException as e:  # a rank's shard write failed: every rank has one, the coordinator the details
        _agree(root, tmp, step, "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                                          for rank, (exc, _) in e.failures.items()))
    except Exception as e:
        # Outside megatron-core's collective error path (the files the coordinator writes alone: common.pt,
        # metadata.json, .metadata): the other ranks wait for this one inside the save, so no collective can
        # tell them. This rank stops now; the launcher (torchrun, srun --kill-on-bad-exit) stops the others.
        raise _write_error(root, tmp, step, [f"rank {dist.get_rank()}: {type(e).__name__}: {e}"]) from e
    else:
        _agree(root, tmp, step, None)


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob("step_*.tmp"):  # an interrupted or failed save's; only this run writes here
        shutil.rmtree(leftover)
    tmp.mkdir()
    for sub in (MODEL_DIR, OPTIMIZER_DIR, RNG_DIR, DRIVER_DIR):
        (tmp / sub).mkdir()


def _write_rank_files(tmp: Path, on_gpu: bool, driver_state: dict[str, dict] | None) -> None:
    torch.save(_rng_state(on_gpu), tmp / RNG_DIR / f"rank_{dist.get_rank():05d}.pt")
    if dist.get_rank() == 0:
        for name, state in (driver_state or {}).items():
            torch.save(state, tmp / DRIVER_DIR / f"{name}.pt")


def _finish(root: Path, tmp: Path, step: int, state: dict, meta: dict) -> None:
    write_meta(tmp / MODEL_DIR, **meta)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    with open(tmp / MARKER, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    final = root / checkpoint_name(step)
    if final.exists():  # a folder without a marker: never a checkpoint
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)


def save_trainer_checkpoint(root, step: int, trainer, extra: dict, keep_last: int | None = None,
                            driver_state: dict[str, dict] | None = None) -> Path:
    """Collective: checkpoint `trainer` (model, optimizer, step counter, every rank's RNG) and `extra`
    (JSON-serialisable: data position, config snapshot, ...) as ROOT/step_000123/; then delete all but
    the newest `keep_last` complete checkpoints (None keeps all). `driver_state` (rank 0's; name -> dict of
    tensors, lists and numbers) is written as driver/NAME.pt (read_driver_state). Returns the folder.
    A write that fails on any rank raises CheckpointWriteError on every rank, the earlier checkpoints intact."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last: must be a whole number >= 1 (or None to keep every checkpoint), "
                          f"got {keep_last!r}")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra: must be JSON-serialisable (plain dicts, lists, numbers, strings): {e}") from e
    root = Path(root)
    final, tmp = root / checkpoint_name(step), root / f"{checkpoint_name(step)}.tmp"
    if (final / MARKER).is_file():  # every rank sees the shared folder: each raises
        raise CheckpointError(f"{final}: a complete checkpoint of step {step} already exists; resume from it "
                              "or save into another folder")
    broken = nonfinite_on_any_rank(trainer.module, trainer.device)
    if broken is not None:  # a checkpoint of NaN weights would be resumed from, or exported, without a word
        raise CheckpointWriteError(f"{final}: not written: the weights are not finite (NaN or inf) in {broken}; "
                                   f"the latest complete checkpoint is still {latest_checkpoint(root)}")
    rank0 = dist.get_rank() == 0
    _agree(root, tmp, step, _attempt(_prepare, root, tmp) if rank0 else None)
    _agree(root, tmp, step, _attempt(_write_rank_files, tmp, trainer.parallel.device == "cuda", driver_state))
    from megatron.core import dist_checkpointing

    _save_sharded(lambda: save_model(trainer.module, tmp / MODEL_DIR), root, tmp, step)
    _save_sharded(lambda: dist_checkpointing.save(_optimizer_sharded_state(trainer, is_loading=False),
                                                  str(tmp / OPTIMIZER_DIR)), root, tmp, step)
    layout = _layout()
    state = {"format": FORMAT, "step": step, "trainer_step_count": trainer.step_count,
             "model": dataclasses.asdict(trainer.spec), "layout": layout,
             "optimizer": {"distributed": trainer.optim.distributed_optimizer}, "extra": extra_json}
    meta = {"tensor_parallel": layout["tensor_parallel"], "expert_parallel": trainer.parallel.expert_parallel,
            "pipeline_parallel": layout["pipeline_parallel"], "dtype": next(trainer.module.parameters()).dtype}
    # Every rank's files are in place (agreed above) before the marker.
    _agree(root, tmp, step, _attempt(_finish, root, tmp, step, state, meta) if rank0 else None)
    if keep_last:  # only now: the new checkpoint is complete
        _rank0_then_share(prune_checkpoints, root, keep_last)
    return final


def read_trainer_state(path) -> dict:
    """The checkpoint's trainer_state.json, after checking the checkpoint is complete."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: not a complete trainer checkpoint (no {MARKER} marker); use "
                              "latest_checkpoint(root) to find the newest complete one")
    state = read_json(path / STATE_FILE, error=CheckpointError)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this code reads {FORMAT}")
    return state


def check_model_shape(state: dict, spec, path) -> None:
    """Refuse a checkpoint of another model, naming every field that differs."""
    diffs = spec_differences(state["model"], spec, "this model")
    if diffs:
        raise CheckpointError(f"{path}: checkpoint of a different model shape: {', '.join(diffs)}; resume with the "
                              "model the run was started with, or start a new run in another folder")


def check_optimizer_layout(state: dict, optim, path) -> None:
    """The distributed optimizer's state and the plain one's are laid out under other keys: refuse to resume one
    as the other, naming the setting. (A checkpoint that predates the record is not checked.)"""
    saved = state.get("optimizer", {}).get("distributed")
    if saved is not None and saved != optim.distributed_optimizer:
        raise CheckpointError(f"{path}: saved with optim.distributed_optimizer = {str(saved).lower()}, resumed with "
                              f"{str(optim.distributed_optimizer).lower()}: the optimizer's state is laid out "
                              f"otherwise; set optim.distributed_optimizer: {str(saved).lower()} to resume it (the "
                              "setting can change only in a new run, in another train.output_dir)")


def _load_failed(path: Path, error: BaseException) -> CheckpointError:
    """A checkpoint marked complete that does not load (a shard cut or damaged after it was written): named, with
    the complete checkpoints before it and how to resume from the newest of them."""
    step = int(_NAME.fullmatch(path.name).group(1)) if _NAME.fullmatch(path.name) else None
    before = [p for p in complete_checkpoints(path.parent)
              if step is not None and int(_NAME.fullmatch(p.name).group(1)) < step]
    if isinstance(error, CheckpointException) and error.failures:  # each failed rank's own error: the first's
        error = next(iter(error.failures.values()))[0]
    what = type(error).__name__ + (f": {str(error).splitlines()[0]}" if str(error).strip() else "")
    if isinstance(error, EOFError):
        what += ": a file of it ends early (cut short?)"
    if before:
        how = (f"the complete checkpoints before it: {', '.join(p.name for p in reversed(before))}; to resume from "
               f"{before[-1].name}, move {path.name} aside (mv {path} {path}.damaged) and rerun")
    else:
        how = f"there is no complete checkpoint before it: move {path.name} aside to start the run afresh"
    return CheckpointError(f"{path}: could not be loaded on rank {dist.get_rank()} ({what}); {how}")


def load_trainer_checkpoint(path, trainer) -> dict:
    """Collective: restore `trainer`'s model, optimizer, step counter and this rank's RNG states from the
    checkpoint at `path`; returns the `extra` dict it was saved with. RNG states come back only at the
    layout they were saved at (at another one the run goes on, with a warning, but not bitwise alike).
    A checkpoint that does not load is a CheckpointError naming it and the complete ones before it."""
    path = Path(path)
    state = read_trainer_state(path)
    check_model_shape(state, trainer.spec, path)
    check_optimizer_layout(state, trainer.optim, path)
    from megatron.core import dist_checkpointing

    try:
        load_model(trainer.module, path / MODEL_DIR)
        loaded = dist_checkpointing.load(_optimizer_sharded_state(trainer, is_loading=True),
                                         str(path / OPTIMIZER_DIR))
        _load_optimizer(trainer, loaded)
        rng = (torch.load(path / RNG_DIR / f"rank_{dist.get_rank():05d}.pt", weights_only=True)
               if state["layout"] == _layout() else None)
    except (Exception, CheckpointException) as e:  # EOFError, megatron-core's CheckpointingException, torch's
        raise _load_failed(path, e) from e  # CheckpointException (a BaseException) with each rank's error, ...
    trainer.step_count = state["trainer_step_count"]
    if rng is not None:
        _set_rng_state(rng, trainer.parallel.device == "cuda")
    elif dist.get_rank() == 0:
        log.warning("%s: saved at layout %s, resumed at %s: weights and optimizer resharded, RNG states not "
                    "restored (the run continues, not bitwise as it would have)", path, state["layout"], _layout())
    dist.barrier()
    return state["extra"]


def read_driver_state(path, name: str) -> dict | None:
    """Rank 0's `name` state saved with the checkpoint at `path` (save_trainer_checkpoint's driver_state),
    or None if it was saved without one."""
    file = Path(path) / DRIVER_DIR / f"{name}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None
