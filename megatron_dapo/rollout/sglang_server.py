"""Start, watch, restart and stop a real SGLang server process (`python -m sglang.launch_server`).

On the CPU it gets the flags SGLang's CPU path needs and the sgl_kernel stand-in on its PYTHONPATH;
on GPUs it runs stock. It binds to 127.0.0.1 unless told otherwise, writes its log to a file, and
runs in its own process group so stopping it stops everything it started. It requires the run's API key
(server_key.py) on every call but /health.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.errors import DapoError
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.server_key import auth_headers, keyed_command
from megatron_dapo.rollout.server_weight_loader import LOADER

CPU_SHIM = Path(__file__).parent / "cpu_shim"
# --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning, which took a whole core (measured:
# 1.01 cores idle, 0.02 with it) from the trainer and the other servers sharing the machine's CPUs.
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-overlap-schedule", "--grammar-backend", "none", "--sleep-on-idle"]


# While a server starts: a refused connection or a 503 costs next to nothing, and every start (and restart after a
# failure) waits half this on average past the moment the server is ready.
HEALTH_POLL_S = 0.25


class ServerError(DapoError, RuntimeError):
    """The server did not start, or died; the message carries the tail of its log."""


@dataclass
class SGLangServerConfig:
    model_path: str
    device: str = "cuda"  # "cuda" or "cpu"
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free one
    tensor_parallel: int = 1
    base_gpu_id: int = 0  # its first GPU (it takes tensor_parallel of them from there)
    dtype: str = "auto"
    max_total_tokens: int | None = None
    startup_timeout_s: float = 300.0
    extra_args: list[str] = field(default_factory=list)


def health_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_until(check: Callable[[], bool], timeout_s: float, poll_s: float = 1.0) -> bool:
    """Poll `check()` until it is True (True), or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_s)
    return False


def post_json(url: str, payload: dict, timeout: float) -> dict | list | str | None:
    """POST `payload` as JSON; the JSON answer, None when the answer is empty (e.g. /abort_request), its text when
    it is plain text (/flush_cache)."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **auth_headers()})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError:  # /flush_cache answers in plain text, without a content type
        return body.decode(errors="replace")


class ServerProcess:
    """An HTTP server run as a child process in its own process group, with its log in a file."""

    name = "server"

    def __init__(self, host: str, port: int | None, log_path, startup_timeout_s: float):
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The log may show the server's settings, its key among them: the run's user alone reads it.
        log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def healthy(self, timeout: float = 5.0) -> bool:
        return health_ok(self.url, timeout)

    def wait_healthy(self):
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode} while starting; log "
                                  f"{self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise ServerError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s; log "
                          f"{self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self):
        """Stop whatever is left of it, then start it again on the same host and port."""
        self.stop()
        return self.start().wait_healthy()

    def stops_gracefully(self) -> bool:
        """Whether stop() asks the server to exit before it kills what is left."""
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        group = self.proc.pid  # its own session: the group holds every process it started
        try:
            if self.stops_gracefully():
                # SIGTERM to the main process alone: it shuts its children down itself. Signalled too, a child
                # exits first, which SGLang takes for a crash and waits 5 s for diagnostics before it exits.
                os.kill(self.proc.pid, signal.SIGTERM)
                os.killpg(group, signal.SIGCONT)  # a stopped (stuck) server takes its SIGTERM once it runs again
                self.proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(group, signal.SIGKILL)  # whatever outlived the main process
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self.start().wait_healthy()

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangServer(ServerProcess):
    name = "SGLang server"

    def __init__(self, config: SGLangServerConfig, log_path):
        super().__init__(config.host, config.port, log_path, config.startup_timeout_s)
        self.config = config

    def stops_gracefully(self) -> bool:
        # SGLang's graceful exit is for its schedulers to release GPU memory (killed, they may leave it held); it
        # looks for a SIGTERM every 5 s and then drains. A CPU server holds none: its group is killed at once,
        # which spares each stop 3.5 s on average (measured over 26 stops).
        return self.config.device != "cpu"

    def command(self) -> list[str]:
        c = self.config
        args = ["--model-path", c.model_path, "--host", self.host, "--port", str(self.port), "--tp-size",
                str(c.tensor_parallel), "--dtype", c.dtype]
        if c.max_total_tokens:
            args += ["--max-total-tokens", str(c.max_total_tokens)]
        args += CPU_FLAGS if c.device == "cpu" else ["--base-gpu-id", str(c.base_gpu_id)]
        args += ["--custom-weight-loader", LOADER]  # the tensor route's: its answer means the bucket was read
        return keyed_command(sys.executable, "sglang.launch_server", args + list(c.extra_args))

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # SGLang's default log-probs, which the policy recomputes at rollout.temperature (and the local engine
        # returns): in SGLang 0.5.23 (srt/layers/sampler.py, Sampler.forward) a sampled token's log-prob is
        # log(softmax(logits / temperature)), taken from the probabilities before the top_p / top_k / min_p cut
        # and without renormalising over what survives it (with --enable-deterministic-inference:
        # log_softmax(logits / temperature), the same quantity); greedy requests (temperature < 1e-6, turned into
        # top_k = 1) get log_softmax(logits). SGLANG_RETURN_ORIGINAL_LOGPROB=1 would return log_softmax(logits)
        # whatever the temperature: dropped from the environment here, so a caller's setting cannot leak in.
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        if self.config.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it SGLang does not take its CPU path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM), env.get("PYTHONPATH")) if p)
        return env
