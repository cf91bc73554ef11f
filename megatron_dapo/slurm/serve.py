"""One SGLang server for a run, in the foreground: `python -m megatron_dapo.slurm.serve CONFIG URL_FILE`.

Started by the launcher as an `srun` step on a rollout node. It serves the run's model with the
run's `rollout:` settings (the CPU flags and shim included), on a free port of its node, writes its
URL to URL_FILE (on the shared filesystem) once it answers /health, and lives as long as the server:
it exits non-zero when the server dies, and stops the server when SLURM stops the step (SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.rollout.sglang_server import ServerError, SGLangServer, SGLangServerConfig
from megatron_dapo.run_config import load_config
from megatron_dapo.runtime import free_port


def server_config(cfg, host: str, port: int, base_gpu_id: int = 0) -> SGLangServerConfig:
    r = cfg.rollout
    on_cpu = r.server_device == "cpu"
    return SGLangServerConfig(cfg.model.path, device=r.server_device, host=host, port=port,
                              tensor_parallel=r.server_tensor_parallel, base_gpu_id=base_gpu_id,
                              dtype="float32" if on_cpu else "auto",  # as the trainer starts its own servers
                              max_total_tokens=16384 if on_cpu else None,
                              startup_timeout_s=r.server_startup_timeout_s,
                              extra_args=list(r.server_extra_args)
                              + (["--enable-deterministic-inference"] if r.deterministic else []))


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
    port = free_port("0.0.0.0")
    server = SGLangServer(server_config(cfg, "0.0.0.0", port, args.base_gpu_id), args.log)
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
