"""rollout.server_urls are checked before the policy is built (issue 49): a server that is down, answers with an
HTTP error, or answers but not as an SGLang server is named with its URL and an excerpt of the answer, in seconds.
Real HTTP servers on this machine's loopback stand for each."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.server_check import check_servers_answer
from megatron_dapo.rollout.sglang_server import ServerError


def serving(status: int, body: bytes):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers():
    started = []

    def start(status: int, body: bytes) -> str:
        server, url = serving(status, body)
        started.append(server)
        return url

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_an_sglang_server_passes(servers):
    check_servers_answer([servers(200, json.dumps({"model_path": "/m", "is_generation": True}).encode())], 5)


def test_a_server_that_is_down_is_named(servers):
    good, down = servers(200, b'{"model_path": "/m"}'), f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=rf"rollout.server_urls\[1\]: {down} does not answer \(.*refused.*\) "
                                          "within 5 s; start the server, or fix the URL"):
        check_servers_answer([good, down], 5)


def test_something_else_at_the_url_is_named_with_an_excerpt_of_its_answer(servers):
    url = servers(200, b"<html><body>Grafana</body></html>\n" + b"x" * 1000)
    with pytest.raises(ServerError) as error:
        check_servers_answer([url], 5)
    said = str(error.value)
    assert said.startswith(f"rollout.server_urls[0]: {url}/get_model_info answered, but not as an SGLang server "
                           "does: '<html><body>Grafana</body></html> xxx"), said
    assert said.endswith("...'") and len(said) < 400


@pytest.mark.parametrize("status,says", [
    (404, "is it an SGLang server?"),
    (401, "the server wants the run's key: export MEGATRON_DAPO_SERVER_KEY as the server was started with")])
def test_an_http_error_is_named_with_what_to_do(servers, status, says):
    url = servers(status, b'{"detail": "no"}')
    with pytest.raises(ServerError, match=rf"{url}/get_model_info answered HTTP {status} '\{{\"detail\": \"no\"}}'; "
                                          f"{says}"):
        check_servers_answer([url], 5)
