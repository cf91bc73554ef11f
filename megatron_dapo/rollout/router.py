"""sglang-router (`python -m sglang_router.launch_router`) in front of several SGLang servers.

The router spreads /generate calls over its workers (by default preferring the one that holds the
prompt's prefix). It checks their health every few seconds, so a server restarted on its old address
is taken back. It runs as a child process in its own process group, bound to 127.0.0.1 unless told.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from megatron_dapo.rollout.server_key import keyed_command
from megatron_dapo.rollout.sglang_server import ServerProcess


class SGLangRouter(ServerProcess):
    name = "sglang-router"

    def __init__(self, worker_urls: list[str], log_path, *, host: str = "127.0.0.1", port: int | None = None,
                 policy: str = "cache_aware", health_check_interval_s: int = 5, startup_timeout_s: float = 120.0):
        if not worker_urls:
            raise ValueError("SGLangRouter(worker_urls=[]): give the URL of at least one running SGLang server")
        super().__init__(host, port, log_path, startup_timeout_s)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s

    def command(self) -> list[str]:
        # With the run's key (its --api-key), for the workers, which require it.
        return keyed_command(sys.executable, "sglang_router.launch_router", [
            "--host", self.host, "--port", str(self.port), "--worker-urls", *self.worker_urls, "--policy", self.policy,
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--worker-startup-timeout-secs", str(int(self.startup_timeout_s))])

    def healthy(self, timeout: float = 5.0) -> bool:
        """Ready: up, with its workers registered and healthy (its /health answers before it has any)."""
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False
