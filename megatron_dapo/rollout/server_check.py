"""Servers given by rollout.server_urls answer, and as SGLang servers, checked on the driver before the policy is
built: a server that is down, a URL of something else, or an answer that is not an SGLang server's is an error
naming the URL (and an excerpt of what it answered) in seconds, not a JSONDecodeError or a KeyError after minutes of
loading. Their weights and log-probs are checked afterwards (logprob_check.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from megatron_dapo.rollout.server_key import SERVER_KEY_ENV, auth_headers
from megatron_dapo.rollout.sglang_server import ServerError

EXCERPT_CHARS = 200


def _excerpt(body: bytes) -> str:
    text = body[:EXCERPT_CHARS * 4].decode(errors="replace").strip().replace("\n", " ")
    return repr(text[:EXCERPT_CHARS] + ("..." if len(text) > EXCERPT_CHARS else ""))


def check_servers_answer(urls: list[str], timeout_s: float) -> None:
    """Each of `urls` (rollout.server_urls) answers /get_model_info as an SGLang server does, within `timeout_s`."""
    for i, url in enumerate(urls):
        key, info_url = f"rollout.server_urls[{i}]", f"{url.rstrip('/')}/get_model_info"
        try:
            with urllib.request.urlopen(urllib.request.Request(info_url, headers=auth_headers()),
                                        timeout=timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            hint = (f"the server wants the run's key: export {SERVER_KEY_ENV} as the server was started with"
                    if e.code in (401, 403) else "is it an SGLang server?")
            raise ServerError(f"{key}: {info_url} answered HTTP {e.code} {_excerpt(e.read())}; {hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise ServerError(f"{key}: {url} does not answer ({reason}) within {timeout_s:g} s; start the server, "
                              "or fix the URL") from None
        try:
            info = json.loads(body)
        except ValueError:
            info = None
        if not isinstance(info, dict) or "model_path" not in info:
            raise ServerError(f"{key}: {info_url} answered, but not as an SGLang server does: {_excerpt(body)}")
