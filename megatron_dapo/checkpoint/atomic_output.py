"""An output folder that appears whole or not at all: written as a hidden partial folder beside it and renamed into
place when complete. What a conversion or an export leaves when it fails is removed; what a killed one left (its
process gone) is swept by the next one into the same folder; a full disk is said as such, whatever the writer's own
error was (torch's is "unexpected pos")."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.errors import DapoError

log = logging.getLogger(__name__)

LOW_SPACE_BYTES = 64 * 2**20  # less than this left after a failed write: the disk filled up
_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?:(?P<host>.+)-)?(?P<pid>\d+)")


class OutputError(DapoError, OSError):
    """An output folder that could not be written; the message names it and the fix."""


def _host() -> str:
    return socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def sweep_stale_partials(folder: Path) -> list[Path]:
    """Delete the partial folders in `folder` left by writers on this host that are gone; returns them. A partial
    folder of another host (a shared filesystem) is left alone: its writer may be running."""
    swept = []
    for path in folder.iterdir() if folder.is_dir() else []:
        match = _PARTIAL.fullmatch(path.name)
        if not match or not path.is_dir() or match["host"] not in (None, _host()) or _alive(int(match["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, the partial output of a conversion that did not finish (pid %s)", path, match["pid"])
        swept.append(path)
    return swept


def _no_space(error: BaseException) -> bool:
    """Whether `error`, its causes or (torch's CheckpointException) its ranks' errors say the disk is full."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, CheckpointException):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


@contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """The partial folder to write into; renamed to `out` (absent or empty, as the caller checked) when the block
    ends, removed if it raises. Stale partial folders beside it are swept first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_partials(out.parent)
    tmp = out.parent / f".{out.name}.partial-{_host()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException as e:
        free = shutil.disk_usage(out.parent).free  # before the partial output's space is given back
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception | CheckpointException) and (_no_space(e) or free < LOW_SPACE_BYTES):
            raise OutputError(f"no space left in {out.parent} while writing {out.name} ({free / 2**20:.0f} MiB free "
                              "then; the partial output is removed): free space there, or write elsewhere") from e
        raise
