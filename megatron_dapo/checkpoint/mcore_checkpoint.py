"""Megatron-core distributed checkpoints (dist_checkpointing) of the policy's weights.

A checkpoint saved at one TP x EP x PP layout loads at any other: dist_checkpointing reshards on load.
Beside the tensors it keeps `megatron_dapo.json` (the layout it was saved at, the weights' dtype)
and `hf/` (the source config.json and tokenizer files), so it converts back to Hugging Face alone.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch

from megatron_dapo.checkpoint.safetensors_io import CheckpointError
from megatron_dapo.user_files import read_json

META = "megatron_dapo.json"
HF_SUBDIR = "hf"


def _exit_with_parent(parent_pid: int) -> None:
    """The writer helper's initializer: it ends once the process that started it is gone (killed, or exited without
    running its finalizers), so a stopped run leaves no process behind."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_writer_helper: threading.Thread | None = None  # this process's, once started


def start_writer_helper() -> threading.Thread:
    """Start, in the background, the helper process megatron-core's checkpoint writer (torch_dist) hands its
    results through; join the thread before the first save. Otherwise the writer spawns it at its first save,
    and the helper imports torch when it unpickles the first results: seconds on the step that checkpoints; and
    nothing ends it when the trainer is killed. One per process, kept for the rest of it: a trainer built after
    another in the same process (the ablation's arms, in-process test runs) finds it started."""
    global _writer_helper
    if _writer_helper is not None:
        return _writer_helper
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    def start() -> None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # what megatron-core's own would be
        manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
        queue = manager.Queue()
        # A result like the writer's: the helper imports what unpickling them takes (torch's checkpoint modules).
        queue.put(WriteResult(MetadataIndex("warm-up"), 0, _StorageInfo("warm-up", 0, 0)))
        queue.get()
        filesystem_async._results_queue = queue  # the writer's, found in place at its first save

    _writer_helper = threading.Thread(target=start, name="checkpoint-writer-helper", daemon=True)
    _writer_helper.start()
    return _writer_helper


def save_model(model: torch.nn.Module, directory) -> None:
    """Collective: every rank writes its shards of `model` into the (existing, empty) directory."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), str(directory))


def load_model(model: torch.nn.Module, directory) -> None:
    """Collective: fill `model`, at whatever layout it was built, from the checkpoint."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    model.load_state_dict(state)


def write_meta(directory, *, tensor_parallel: int, expert_parallel: int, pipeline_parallel: int,
               dtype: torch.dtype) -> None:
    meta = {"tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel,
            "pipeline_parallel": pipeline_parallel, "dtype": str(dtype).removeprefix("torch.")}
    (Path(directory) / META).write_text(json.dumps(meta, indent=2))


def read_meta(directory) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a megatron-dapo distributed checkpoint (no {META})")
    meta = read_json(path, error=CheckpointError)
    dtype = getattr(torch, str(meta.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}: 'dtype' {meta.get('dtype')!r} is no torch dtype")
    meta["dtype"] = dtype
    return meta
