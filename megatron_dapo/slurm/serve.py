"""One SGLang server for a run, in the foreground: `python -m megatron_dapo.slurm.serve CONFIG URL_FILE`.

Started by the launcher as an `srun` step on a rollout node. It serves the run's model with the run's
`rollout:` settings (the CPU flags and shim included) and the job's API key (server_key.py), on a free port of
the node's address, writes its URL to URL_FILE (on the shared filesystem) once it answers /health, and lives
as long as the server: it exits non-zero when the server dies, and stops the server when SLURM stops the step
(SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.from_config import server_config
from megatron_dapo.rollout.sglang_server import ServerError, SGLangServer
from megatron_dapo.run_config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_dapo.slurm.serve", description=__doc__)
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("url_file", help="where to write this server's URL once it is healthy")
    parser.add_argument("--advertise", required=True, help="this node's address as the other nodes reach it")
    parser.add_argument("--log", required=True, help="the server's log file")
    parser.add_argument("--base-gpu-id", type=int, default=0, help="its first GPU on this node")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as for megatron-dapo train")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"serve: bad config: {e}", file=sys.stderr)
        return 2
    # Bound to the address the other nodes reach it on (SLURM's NodeAddr), not to every interface of the node.
    port = free_port(args.advertise)
    server = SGLangServer(server_config(cfg, host=args.advertise, port=port, base_gpu_id=args.base_gpu_id), args.log)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally below
    try:
        server.start().wait_healthy()
        url_file = Path(args.url_file)
        tmp = url_file.with_suffix(".tmp")
        tmp.write_text(f"http://{args.advertise}:{port}\n")
        tmp.rename(url_file)
        print(f"serve: SGLang server up at http://{args.advertise}:{port}", flush=True)
        while server.alive():
            time.sleep(1.0)
        print(f"serve: the SGLang server exited with {server.proc.returncode}; log {args.log}:\n"
              f"{server.log_tail(2000)}", file=sys.stderr)
        return 1
    except ServerError as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop(grace_s=2.0)  # inside SLURM's KillWait


if __name__ == "__main__":
    sys.exit(main())
