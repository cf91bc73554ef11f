"""The run's API key for its SGLang servers (SGLang's `--api-key`): without it a server refuses every call but
/health, so nobody else who can reach a rollout node can generate on our servers or push weights into them.

The key lives in the environment (`MEGATRON_DAPO_SERVER_KEY`), which only the run's own user can read and
which every process of the run inherits: the SLURM launcher makes one per job for all its steps, the trainer
one per run (shared by its ranks) when none is set. Servers given by URL take the key they were started with,
exported by the user. A server gets the key through this module's launcher, `python -m
megatron_dapo.rollout.server_key MODULE ARGS...`, which adds `--api-key` inside the process: a key on the
command line would be readable by every user of the node (`ps`).
"""

from __future__ import annotations

import os
import runpy
import secrets
import sys

SERVER_KEY_ENV = "MEGATRON_DAPO_SERVER_KEY"


def server_key() -> str | None:
    return os.environ.get(SERVER_KEY_ENV) or None


def auth_headers() -> dict[str, str]:
    """The header every call to our servers carries (none without a key)."""
    key = server_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def ensure_server_key() -> str:
    """The run's key: the environment's, else a new random one put there (for the processes started after)."""
    if not server_key():
        os.environ[SERVER_KEY_ENV] = secrets.token_urlsafe(32)
    return os.environ[SERVER_KEY_ENV]


def share_server_key() -> None:
    """Every trainer rank (collective): the driver's key (its environment's, else a new one) in this rank's
    environment, where the servers the run starts and every call to them take it from."""
    import torch.distributed as dist  # here: the servers' launcher below stays light

    from megatron_dapo.parallel.runtime import driver_value

    os.environ[SERVER_KEY_ENV] = driver_value(ensure_server_key() if dist.get_rank() == 0 else None)


def keyed_command(python: str, module: str, args: list[str]) -> list[str]:
    """The command that runs `python -m module args` with the run's key added by this module's launcher."""
    return [python, "-m", "megatron_dapo.rollout.server_key", module, *args]


def main() -> None:
    module, *args = sys.argv[1:]
    key = server_key()
    # One token: a key may start with "-", which argparse would take for an option after a separate "--api-key".
    sys.argv = [module, *args, *([f"--api-key={key}"] if key else [])]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
