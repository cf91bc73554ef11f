"""The Python tool: each call runs the model's program in a fresh, confined process tree, and the model gets its
output back (bounded) or a message saying what stopped it.

Model-written code is untrusted. Each call gets a scratch directory of its own (deleted after) and an environment
of a few fixed variables (nothing of the trainer's: no tokens, no keys), and runs under tool/sandbox_child.py's
confinement: resource limits (CPU seconds, memory, file size, processes; a root trainer's calls in a pids
cgroup each, without capabilities), and where the kernel has Landlock (Linux 5.13+; TCP 6.7+; signals 6.12+)
writes only beneath the scratch directory, reads only of the interpreter's and the system's files, no TCP, no
signal to a process outside it.
Where `unshare` may make namespaces (root, or unprivileged user namespaces allowed), the tree also runs in network
and PID namespaces of its own: no network at all, and nothing it starts outlives the call. The pool enforces the
wall-clock limit from outside and kills the call's whole tree; the output is drained whatever its size and cut to
its head and tail. What is enforced on this node is said once when the tool starts (`PythonSandbox.isolation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.errors import DapoError
from megatron_dapo.tool.config import PythonToolConfig
from megatron_dapo.tool.interface import ToolResult
from megatron_dapo.tool.sandbox_child import landlock_abi

logger = logging.getLogger(__name__)
CHILD = Path(__file__).with_name("sandbox_child.py")
SCRATCH_PREFIX = "megatron-dapo-tool-"
# The program's whole environment: one thread per math library, no bytecode files, its scratch directory as home.
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Where a call may read: the interpreter's files and the system's (libraries, certificates, locales, devices).
SYSTEM_READABLE = ["/usr", "/lib", "/lib64", "/bin", "/etc", "/dev/null", "/dev/urandom", "/dev/zero", "/proc",
                   "/sys/devices/system/cpu"]
CUT_MESSAGE = "\n[... {cut} bytes of output cut ...]\n"


class ToolSetupError(DapoError, RuntimeError):
    """The sandbox cannot run a program on this node at all (found when the tool starts)."""


class PythonSandbox:
    """`await call(source)`: runs `source` as a Python program; at most tool.max_concurrent at once."""

    name = "python"

    def __init__(self, config: PythonToolConfig):
        self.config = config
        self._root = config.scratch_root or tempfile.gettempdir()
        if not os.path.isdir(self._root):
            raise ConfigError(f"tool.scratch_root: {self._root} is not a directory; make it, or set null (the "
                              "system's temp directory)")
        self._cgroups = _pids_cgroup_root() if os.geteuid() == 0 else None
        self._unshare = _namespace_prefix()
        self._slots: asyncio.Semaphore | None = None  # made in the loop that calls
        self.isolation = self._describe()
        logger.info("python tool: %s", self.isolation)
        probe = asyncio.run(self.call("print('ready')"))
        self._slots = None  # made again in the loop of the calls
        if probe.text.strip() != "ready":
            raise ToolSetupError(f"the Python tool's sandbox cannot run a program on this node: {probe.text.strip()} "
                                 f"({self.isolation})")

    def _describe(self) -> str:
        abi = landlock_abi(ctypes.CDLL(None, use_errno=True))
        config = self.config
        parts = [f"limits: {config.cpu_s} CPU s, {config.memory_mb} MB, {config.max_file_mb} MB files, "
                 f"{config.max_processes} processes, {config.timeout_s:g} s wall"]
        if os.geteuid() == 0:
            parts.append("as root without capabilities; " + (
                f"processes counted by a pids cgroup under {self._cgroups}" if self._cgroups else
                "PROCESS LIMIT NOT ENFORCED (root, and no writable pids cgroup)"))
        parts.append("network and PID namespaces" if self._unshare else
                     "no namespaces (unshare refused): processes are ended by process group only")
        if abi:
            parts.append(f"Landlock ABI {abi}: writes only in its scratch directory, reads only system files"
                         + (", no TCP" if abi >= 4 else ", TCP NOT blocked (ABI < 4)")
                         + (", no signals out" if abi >= 6 else ", signals NOT scoped (ABI < 6)"))
        else:
            parts.append("NO LANDLOCK: it may read and write whatever its user may")
        if not self._unshare and abi < 4:
            parts.append("NETWORK NOT BLOCKED")
        return "; ".join(parts)

    async def call(self, request: str) -> ToolResult:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrent)
        async with self._slots:
            scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=self._root))
            cgroup = None
            if self._cgroups:
                cgroup = Path(self._cgroups) / scratch.name
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(str(self.config.max_processes + 1))  # + the first process
            try:
                return await self._run(request, scratch, cgroup)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
                if cgroup is not None:
                    _remove_cgroup(cgroup)

    def close(self) -> None:
        """Nothing runs between calls: each call's processes end with it."""

    async def _run(self, source: str, scratch: Path, cgroup: Path | None) -> ToolResult:
        (scratch / "main.py").write_text(source)
        limits = {"cpu_s": self.config.cpu_s, "memory_mb": self.config.memory_mb,
                  "max_file_mb": self.config.max_file_mb, "max_processes": self.config.max_processes,
                  "cgroup": str(cgroup) if cgroup else None,
                  "readable": SYSTEM_READABLE + sorted({sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                        sysconfig.get_paths()["stdlib"],
                                                        os.path.realpath(sys.executable)})}
        env = {**BASE_ENV, "HOME": str(scratch), "TMPDIR": str(scratch)}
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self._unshare, sys.executable, "-I", str(CHILD), json.dumps(limits), cwd=scratch, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        output = _BoundedOutput(self.config.max_output_chars)
        reader = asyncio.ensure_future(output.drain(proc.stdout))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), self.config.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole tree (a PID namespace ends with its first process)
            await proc.wait()
        try:  # a process that left the group may still hold the pipe: do not wait on it
            await asyncio.wait_for(reader, 1.0)
        except asyncio.TimeoutError:
            reader.cancel()
        seconds = time.monotonic() - start
        error, note = _what_ended(proc.returncode, timed_out, self.config)
        text = output.text() + (f"\n[{note}]" if note else "")
        return ToolResult(text, error, seconds, output.total)


class _BoundedOutput:
    """Reads a stream to its end, keeping its first and last `limit // 2` bytes."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            room = self.half - len(self.head)
            self.head += chunk[:room]
            self.tail += chunk[max(room, 0):]
            if len(self.tail) > self.half:
                del self.tail[:len(self.tail) - self.half]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        middle = CUT_MESSAGE.format(cut=cut) if cut > 0 else ""
        return (bytes(self.head) + middle.encode() + bytes(self.tail)).decode(errors="replace")


def _what_ended(code: int, timed_out: bool, config: PythonToolConfig) -> tuple[str | None, str | None]:
    """(error, the message the model reads) from the sandbox's exit code (128 + a signal for a killed program)."""
    if timed_out:
        return "timeout", f"stopped: the program ran past its {config.timeout_s:g} s time limit"
    if code == 0:
        return None, None
    if code == 128 + signal.SIGXCPU:
        return "cpu_time", f"stopped: the program used its {config.cpu_s} s of CPU time"
    if code > 128:
        name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else str(code - 128)
        return "killed", f"stopped: the program was killed by {name} (its memory limit is {config.memory_mb} MB)"
    return "exit", f"the program exited with code {code}"


def _pids_cgroup_root() -> str | None:
    """A folder in which a root trainer may make a pids cgroup per call (cgroup v1's pids hierarchy, or v2 where
    this process's cgroup delegates pids), beside this process's own cgroup; None where there is none."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        base = Path("/sys/fs/cgroup/pids") if "pids" in controllers.split(",") else \
            Path("/sys/fs/cgroup") if controllers == "" else None
        if base is None or (controllers == "" and "pids" not in
                            _read(base / path.lstrip("/") / "cgroup.subtree_control").split()):
            continue
        parent = base / path.lstrip("/")
        probe = parent / f"{SCRATCH_PREFIX}probe-{os.getpid()}"
        try:
            probe.mkdir()
            (probe / "pids.max").write_text("1")
            probe.rmdir()
            return str(parent)
        except OSError:
            with contextlib.suppress(OSError):
                probe.rmdir()
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove_cgroup(cgroup: Path) -> None:
    """rmdir once its processes are gone (they were killed; the kernel may take a moment to reap them)."""
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    logger.warning("python tool: could not remove the cgroup %s (processes still in it)", cgroup)


def _namespace_prefix() -> list[str]:
    """`unshare` with network and PID namespaces where this node lets this user make them, else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    prefix = [unshare, "--net", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-current-user"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else []
