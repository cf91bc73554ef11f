"""The launcher that hands a server the run's API key (rollout/server_key.py)."""

import os
import subprocess
import sys

from megatron_dapo.rollout.server_key import SERVER_KEY_ENV, keyed_command

# A stand-in server module: parses --api-key as SGLang's argparse does and prints what it got.
ECHO_SERVER = """
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--port")
parser.add_argument("--api-key")
args = parser.parse_args()
print(args.port, args.api_key)
"""


def test_a_key_that_starts_with_a_dash_reaches_the_server(tmp_path):
    # secrets.token_urlsafe starts with "-" about once in 64 runs: "--api-key -x..." reads as a missing value.
    (tmp_path / "echo_server.py").write_text(ECHO_SERVER)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, SERVER_KEY_ENV: "-Ab3_x", "PYTHONPATH": path}
    out = subprocess.run(keyed_command(sys.executable, "echo_server", ["--port", "30000"]), env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["30000", "-Ab3_x"]
