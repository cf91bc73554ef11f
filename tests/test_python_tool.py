"""The Python tool's sandbox (megatron_dapo/tool/): model-written programs that try to hurt the machine or the
trainer are stopped, each with a message the policy can read, and the tool (the trainer's process: this test's)
goes on answering. What this node enforces is said by PythonSandbox.isolation; each case checks the guard that
stops it here."""

import asyncio
import dataclasses
import os
import signal
import socket
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.tool.config import PythonToolConfig
from megatron_dapo.tool.python_sandbox import SCRATCH_PREFIX, PythonSandbox

# The wall-clock limit is a hang guard here, far past the CPU limit: on a loaded machine (the suite's other lane)
# a spinning program gets its 2 CPU seconds only over several wall seconds.
CONFIG = PythonToolConfig(timeout_s=60.0, cpu_s=2, memory_mb=1024, max_processes=8, max_file_mb=16,
                          max_output_chars=1000)


@pytest.fixture(scope="module")
def sandbox():
    tool = PythonSandbox(CONFIG)
    yield tool
    tool.close()


def call(tool, source: str):
    return asyncio.run(tool.call(source))


def still_answers(tool) -> None:
    """The tool is unharmed: the next call runs."""
    result = call(tool, "print(6 * 7)")
    assert (result.text, result.error) == ("42\n", None), result


def leftovers() -> list[psutil.Process]:
    """Processes of a call still running: programs (`python -I -`) or sandboxes."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:] == ["-I", "-"] or any("sandbox_child.py" in c for c in cmd):
            found.append(p)
    return found


def test_a_program_gets_its_output_and_nothing_of_the_trainers_environment(sandbox, monkeypatch):
    secret = f"sekrit-{uuid.uuid4()}"
    monkeypatch.setenv("MEGATRON_DAPO_SERVER_KEY", secret)
    source = ("import os, sys\nprint(sorted(os.environ))\n"
              f"for pid in (os.getppid(), {os.getpid()}):\n"
              "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
              "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    result = call(sandbox, source)
    assert result.error is None, result
    assert secret not in result.text and "MEGATRON_DAPO" not in result.text, result.text
    assert "'HOME'" in result.text and "refused" in result.text
    still_answers(sandbox)


def test_an_infinite_loop_is_stopped_at_its_cpu_limit_and_a_sleeping_one_at_its_wall_clock_limit(sandbox):
    spin = call(sandbox, "while True:\n    pass\n")
    assert spin.error == "cpu_time" and "used its 2 s of CPU time" in spin.text, spin
    short = PythonSandbox(dataclasses.replace(CONFIG, timeout_s=3.0))
    sleep = call(short, "import time\nwhile True:\n    time.sleep(1)\n")
    assert sleep.error == "timeout" and "ran past its 3 s time limit" in sleep.text, sleep
    assert not leftovers()
    still_answers(sandbox)


def test_a_fork_bomb_gets_its_process_limit_and_leaves_nothing_behind(sandbox):
    if "PROCESS LIMIT NOT ENFORCED" in sandbox.isolation:  # never set one off unbounded on a shared machine
        pytest.skip(f"no process limit on this node: {sandbox.isolation}")
    result = call(sandbox, "import os\nwhile True:\n    os.fork()\n")
    assert result.error in ("exit", "killed") and "Resource temporarily unavailable" in result.text, result
    assert not leftovers()
    still_answers(sandbox)


def test_ten_gigabytes_of_memory_are_refused(sandbox):
    result = call(sandbox, "block = bytearray(10 * 2**30)\n")
    assert result.error == "exit" and "MemoryError" in result.text, result
    still_answers(sandbox)


def test_a_ten_gigabyte_file_stops_at_the_file_size_limit_and_is_removed(sandbox):
    result = call(sandbox, "chunk = b'0' * 2**20\nwith open('big', 'wb') as f:\n"
                           "    for _ in range(10 * 1024):\n        f.write(chunk)\n")
    # CPython ignores SIGXFSZ: the write past the limit fails with EFBIG, which the program sees
    assert result.error == "exit" and "OSError: [Errno 27] File too large" in result.text, result
    assert not list(Path(sandbox._root).glob(f"{SCRATCH_PREFIX}*/big"))
    still_answers(sandbox)


def test_writing_outside_its_directory_is_refused(sandbox, tmp_path):
    if "Landlock" not in sandbox.isolation:
        pytest.skip(f"no Landlock on this node: {sandbox.isolation}")
    targets = [Path("/tmp") / f"outside-{uuid.uuid4()}", Path(__file__).with_name(f"planted-{uuid.uuid4()}.py")]
    source = "".join(f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote')\n"
                     "except OSError as e:\n    print('refused', type(e).__name__)\n" for t in targets)
    result = call(sandbox, source + "open('inside', 'w').write('x')\nprint(open('inside').read())\n")
    assert result.error is None and "wrote" not in result.text and result.text.count("refused") == 2, result
    assert result.text.endswith("x\n") and not any(t.exists() for t in targets)
    still_answers(sandbox)


def test_reading_the_trainers_files_is_refused(sandbox):
    if "Landlock" not in sandbox.isolation:
        pytest.skip(f"no Landlock on this node: {sandbox.isolation}")
    readme = Path(__file__).resolve().parents[1] / "README.md"  # the repository is none of the system's files
    result = call(sandbox, f"try:\n    print(open({str(readme)!r}).read()[:20])\n"
                           "except OSError as e:\n    print('refused', type(e).__name__)\n")
    assert result.text == "refused PermissionError\n", result
    still_answers(sandbox)


def test_no_socket_reaches_a_listener_on_this_machine(sandbox):
    if "NETWORK NOT BLOCKED" in sandbox.isolation:
        pytest.skip(f"no network guard on this node: {sandbox.isolation}")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = call(sandbox, "import socket\ntry:\n"
                               f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
                               "except OSError as e:\n    print('refused', type(e).__name__)\n")
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "connected" not in result.text and "refused" in result.text, result
    still_answers(sandbox)


def test_signals_to_its_parent_or_the_trainer_do_not_arrive(sandbox):
    if "no signals out" not in sandbox.isolation and "PID namespaces" not in sandbox.isolation:
        pytest.skip(f"no signal guard on this node: {sandbox.isolation}")
    caught = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: caught.append(True))
    try:
        result = call(sandbox, "import os, signal\n"
                               f"for pid in (os.getppid(), {os.getpid()}):\n"
                               "    try:\n        os.kill(pid, signal.SIGUSR1)\n        print('sent')\n"
                               "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not caught and result.text.count("refused") == 2, result
    still_answers(sandbox)


def test_a_hundred_megabytes_of_output_come_back_as_their_head_and_tail(sandbox):
    result = call(sandbox, "print('a' * 50_000_000 + 'b' * 50_000_000)\n")
    assert result.error is None and result.output_bytes == 100_000_001, result.output_bytes
    assert result.text.startswith("a" * 500) and result.text.endswith("b" * 499 + "\n")
    assert "[... 99999001 bytes of output cut ...]" in result.text and len(result.text) < 1100
    still_answers(sandbox)


def test_a_program_reads_what_it_wrote_and_imports_the_scientific_stack(sandbox):
    result = call(sandbox, "import sympy\nopen('n.txt', 'w').write(str(sympy.factorint(2**16 + 1)))\n"
                           "print(open('n.txt').read())\n")
    assert (result.text, result.error) == ("{65537: 1}\n", None), result


def test_a_traceback_names_no_scratch_path():
    """The same program gets the same text back on every run (a run that repeats needs it)."""
    tool = PythonSandbox(CONFIG)
    first, second = (call(tool, "1 / 0\n") for _ in range(2))
    assert first.text == second.text and 'File "<stdin>", line 1' in first.text and SCRATCH_PREFIX not in first.text


@pytest.mark.parametrize(("key", "value", "message"), [
    ("timeout_s", 0, "tool.timeout_s: must be a number > 0"),
    ("cpu_s", 1.5, "tool.cpu_s: must be a whole number >= 1"),
    ("memory_mb", 8, "tool.memory_mb: must be a whole number >= 64"),
    ("max_processes", 0, "tool.max_processes: must be a whole number >= 1"),
    ("max_output_chars", 10, "tool.max_output_chars: must be a whole number >= 64"),
])
def test_bad_settings_are_refused_by_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        PythonToolConfig(**{key: value})


def test_a_missing_scratch_root_is_refused_by_key(tmp_path):
    with pytest.raises(ConfigError, match="tool.scratch_root: .* is not a directory"):
        PythonSandbox(PythonToolConfig(scratch_root=str(tmp_path / "nope")))
