"""Where a run's log records and Python warnings go: all of them to a log file in the run's folder, and
to the console only ours (the `megatron_dapo.*` loggers) and errors, unless `verbose`.

`setup_run_logging` is called once by an entry point (`megatron-dapo train`, `megatron-dapo demo`).
It replaces the root logger's handlers and routes the libraries that keep their own console handlers
(torch's registered loggers, transformers) through the root logger, so that megatron-core's parameter
listings and config dumps, library warnings and `warnings.warn` calls land in the file. Under
torchrun or srun each rank writes its own file (`train.log` on rank 0, `train.rank1.log` ...); only
rank 0 prints our INFO lines, the other ranks print warnings and errors.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

OURS = "megatron_dapo"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_MARK = "_megatron_dapo_run_logging"
# `extra=` of a record for the log file alone (a traceback whose one-line summary the console gets otherwise),
# unless the run is verbose.
FILE_ONLY = {"file_only": True}


def log_file_path(directory, command: str, rank: int = 0) -> Path:
    """`<directory>/<command>.log` on rank 0, `<directory>/<command>.rank<N>.log` on the others."""
    return Path(directory) / (f"{command}.log" if rank == 0 else f"{command}.rank{rank}.log")


def _is_ours(record: logging.LogRecord) -> bool:
    return record.name == OURS or record.name.startswith(OURS + ".")


class _ConsoleFilter(logging.Filter):
    """Ours from `ours_level` on, anything else from `others_level` on; FILE_ONLY records only when `verbose`."""

    def __init__(self, ours_level: int, others_level: int, verbose: bool):
        super().__init__()
        self.ours_level, self.others_level, self.verbose = ours_level, others_level, verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False) and not self.verbose:
            return False
        return record.levelno >= (self.ours_level if _is_ours(record) else self.others_level)


class _ConsoleFormatter(logging.Formatter):
    """`12:17:41 message` for our INFO lines, with the level and logger name for the rest; `[rank N] `
    first on the ranks other than 0."""

    def __init__(self, rank: int):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        self.short = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self.prefix = f"[rank {rank}] " if rank else ""

    def format(self, record: logging.LogRecord) -> str:
        short = record.levelno == logging.INFO and _is_ours(record)
        return self.prefix + (self.short.format(record) if short else super().format(record))


def _route_library_handlers(verbose: bool) -> None:
    """Send the records of libraries with their own stderr handlers to the root logger instead, and turn
    transformers' progress bars off unless `verbose`."""
    import torch  # noqa: F401  (its import installs the handlers on its loggers; undone below)

    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "torch" or name.startswith("torch.")):
            continue
        own = [h for h in logger.handlers if getattr(h, "_torch_logging_internal_handler", False)]
        if own:  # torch's registered loggers: a stderr handler each and propagate=False
            for handler in own:
                logger.removeHandler(handler)
            logger.propagate = True
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if not verbose:
        hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards": a file has no use for them


def setup_run_logging(directory, command: str, *, verbose: bool = False, rank: int = 0, append: bool = True,
                      stream=None) -> Path:
    """Route every log record (all loggers at INFO and above, Python warnings included) to
    `<directory>/<command>.log` (per rank, see `log_file_path`) and the ones a person wants to the
    console (`stream`, default stderr): ours at INFO and above on rank 0 (WARNING on the others), other
    loggers' at ERROR and above; everything with `verbose` (WARNING and above on ranks other than 0).
    `append`: keep an earlier run's lines (a resumed training run), else start the file afresh.
    Returns the log file's path. Calling it again replaces the earlier setup."""
    path = log_file_path(directory, command, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):  # basicConfig's, or an earlier call's (as basicConfig(force=True))
        root.removeHandler(handler)
        if getattr(handler, _HANDLER_MARK, False):
            handler.close()
    root.setLevel(logging.INFO)

    file_handler = logging.FileHandler(path, mode="a" if append else "w", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    console = logging.StreamHandler(sys.stderr if stream is None else stream)
    console.setFormatter(_ConsoleFormatter(rank))
    if rank != 0:
        console.addFilter(_ConsoleFilter(logging.WARNING, logging.WARNING if verbose else logging.ERROR, verbose))
    else:
        console.addFilter(_ConsoleFilter(logging.INFO, logging.INFO if verbose else logging.ERROR, verbose))
    for handler in (file_handler, console):
        setattr(handler, _HANDLER_MARK, True)
        root.addHandler(handler)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger, at WARNING
    _route_library_handlers(verbose)
    file_handler.stream.write(f"==== megatron-dapo {command}, rank {rank}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
                              f"{' (verbose)' if verbose else ''} ====\n")
    file_handler.flush()
    return path
