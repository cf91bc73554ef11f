"""Settings of the Python tool's sandbox, validated on construction (keys as tool.<name>)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config import _positive, _require, _whole


@dataclass(frozen=True)
class PythonToolConfig:
    timeout_s: float = 10.0  # wall-clock limit of a call; past it the call's processes are killed
    cpu_s: int = 10  # CPU seconds a call's program may use (RLIMIT_CPU)
    memory_mb: int = 1024  # address space of each of the call's processes (RLIMIT_AS)
    max_processes: int = 8  # processes the program may start (RLIMIT_NPROC, over the user's count at the start)
    max_file_mb: int = 64  # largest file the program may write (RLIMIT_FSIZE)
    max_output_chars: int = 4096  # output the model gets back; beyond it, its head and tail with the cut marked
    max_concurrent: int = 4  # calls run at once (each is a process tree of its own)
    scratch_root: str | None = None  # where each call's scratch directory is made; null: the system's temp dir

    def __post_init__(self):
        _positive(self.timeout_s, "tool.timeout_s")
        _whole(self.cpu_s, "tool.cpu_s", 1)
        _whole(self.memory_mb, "tool.memory_mb", 64)
        _whole(self.max_processes, "tool.max_processes", 1)
        _whole(self.max_file_mb, "tool.max_file_mb", 1)
        _whole(self.max_output_chars, "tool.max_output_chars", 64)
        _whole(self.max_concurrent, "tool.max_concurrent", 1)
        _require(self.scratch_root is None or isinstance(self.scratch_root, str), "tool.scratch_root",
                 f"must be a directory's path or null, got {self.scratch_root!r}")
