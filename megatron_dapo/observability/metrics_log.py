"""Per-step training metrics: one JSON line per step in DIR/metrics.jsonl, tensorboard scalars, and (with
metrics.wandb.project set) a wandb run.

Only rank 0 writes; on the other ranks the logger does nothing, so every rank can call it. A resumed
run passes the step it resumed from: lines (and tensorboard events) of later steps, written after
that checkpoint by the run that died, are dropped, so the file has each step once. wandb cannot drop
points: a resumed run goes on in the same wandb run (its id kept in DIR/wandb/run_id), and the steps
logged again after the checkpoint show twice there, each at its step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.config import WandbConfig

log = logging.getLogger(__name__)

JSONL = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED = ("step", "time")


def _parse_lines(path: Path) -> tuple[list[dict], bool]:
    """The records of a metrics file, and whether its last line was torn (a crash mid-write: left out)."""
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                log.warning("%s: last line is incomplete (a run stopped mid-write); ignored", path)
                return records, True
            raise ValueError(f"{path}:{i}: not a JSON line ({e}); the metrics file is corrupt") from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{i}: expected an object with an integer 'step', got {line[:80]!r}")
        records.append(record)
    return records, False


def read_metrics(path) -> list[dict]:
    """The per-step records of a metrics.jsonl file, in file order; a clear error if there are none."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file; pass the run's {JSONL} (written by MetricsLogger)")
    records, _ = _parse_lines(path)
    if not records:
        raise ValueError(f"{path}: holds no metrics yet (empty file); let the run log at least one step")
    return records


class MetricsLogger:
    """log(step, {name: number}) -> DIR/metrics.jsonl and DIR/tensorboard/, on rank 0.

    `resume_step`: the step of the checkpoint the run resumed from (None for a new run, which starts
    the file afresh). Names with a '/' (e.g. "time/rollout") group as tensorboard sections and as one
    panel in tools/plot_metrics.py.
    """

    def __init__(self, directory, tensorboard: bool = True, resume_step: int | None = None,
                 wandb: WandbConfig | None = None, run_config: dict | None = None):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = Path(directory) / JSONL
        self.last_step = resume_step
        self._file = None
        self._writer = None
        self._wandb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the earlier run's events from resume_step + 1 on (all of them for a new run).
            purge = 0 if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.path.parent / TENSORBOARD_DIR), purge_step=purge)
        if wandb is not None and wandb.project is not None:
            self._wandb = _wandb_run(wandb, self.path.parent, run_config or {}, resumed=resume_step is not None)

    @classmethod
    def for_run(cls, cfg, resume_step: int | None) -> MetricsLogger:
        """The run's (`cfg`: a run_config.DapoConfig): in train.output_dir, with its tensorboard and wandb
        settings; `resume_step`: the checkpoint's step a resumed run goes on from."""
        return cls(cfg.train.output_dir, tensorboard=cfg.train.tensorboard, resume_step=resume_step,
                   wandb=cfg.metrics.wandb, run_config=cfg.to_dict())

    def _truncate_after(self, resume_step: int | None) -> None:
        if not self.path.is_file():
            return
        records, torn = _parse_lines(self.path)
        kept = [r for r in records if resume_step is not None and r["step"] <= resume_step]
        if len(kept) == len(records) and not torn:
            return
        if len(kept) < len(records):
            log.warning("%s: dropping %d line(s) of steps after %s (logged by an earlier run after its last "
                        "checkpoint)", self.path, len(records) - len(kept),
                        "the start" if resume_step is None else f"step {resume_step}")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict) -> None:
        """Append one step's metrics (each value a number; the step strictly after the last one logged)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step: must be an int, got {step!r}")
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step: {step} is not after the last logged step {self.last_step}; each step is "
                             "logged once, in order")
        values = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or key in RESERVED:
                raise ValueError(f"metrics[{key!r}]: names must be strings other than {RESERVED}")
            try:
                values[key] = float(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"metrics[{key!r}]: must be a number, got {type(value).__name__} {value!r}") from e
        self.last_step = step
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({"step": step, **values})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() may return before wandb's service has written the run out (a resumed offline run's file
            # was read without its history once, on a loaded machine); teardown waits for all of it.
            wandb.teardown()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wandb_run(cfg: WandbConfig, directory: Path, run_config: dict, resumed: bool):
    """A wandb run under DIR/wandb; a resumed run goes on in the run its first start made."""
    import wandb

    id_file = directory / "wandb" / "run_id"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    id_file.parent.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or directory.resolve().name,
                     mode=cfg.mode, dir=str(directory), config=run_config, id=run_id,
                     resume="allow" if run_id else None)
    id_file.write_text(run.id)
    # Our step is the x axis: wandb's own counter would shift every point of a resumed run.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run
