"""The job's nodes from SLURM's environment, split into training nodes and rollout nodes (or shared by both)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from megatron_dapo.errors import DapoError


class AllocationError(DapoError, RuntimeError):
    """The allocation cannot hold the requested layout, or SLURM's environment is missing."""


@dataclass(frozen=True)
class Node:
    name: str
    address: str  # where other nodes reach it (SLURM's NodeAddr)


@dataclass(frozen=True)
class Layout:
    train: list[Node]  # the first nodes: the batch script runs on train[0], which hosts the rendezvous
    rollout: list[Node]  # the last nodes; colocated: the same nodes as train

    @property
    def master(self) -> Node:
        return self.train[0]


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def job_nodes(environ=None, scontrol=_scontrol) -> list[Node]:
    """Every node of the job, in SLURM's order, with its address."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise AllocationError("SLURM_JOB_NODELIST is not set: run this inside a job (sbatch launch/dapo.sbatch ...)")
    names = scontrol("show", "hostnames", nodelist).split()
    nodes = []
    for name in names:
        found = re.search(r"NodeAddr=(\S+)", scontrol("show", "node", "-o", name))
        nodes.append(Node(name, found.group(1) if found else name))
    return nodes


def split_nodes(nodes: list[Node], rollout_nodes: int) -> Layout:
    """The last `rollout_nodes` nodes serve SGLang, the others train."""
    if rollout_nodes < 1:
        raise AllocationError(f"--rollout-nodes: must be at least 1, got {rollout_nodes}")
    if rollout_nodes >= len(nodes):
        raise AllocationError(f"--rollout-nodes: {rollout_nodes} of a {len(nodes)}-node job leaves no node to "
                              f"train on; ask sbatch for more nodes (--nodes={rollout_nodes + 1} or more)")
    return Layout(train=nodes[:-rollout_nodes], rollout=nodes[-rollout_nodes:])


def colocate_nodes(nodes: list[Node], rollout_nodes: int | None) -> Layout:
    """Every node trains and serves SGLang."""
    if rollout_nodes is not None:
        raise AllocationError(f"ROLLOUT_NODES / --rollout-nodes ({rollout_nodes}): a colocated job "
                              f"(rollout.colocate: true) serves SGLang on every node it trains on; unset "
                              f"ROLLOUT_NODES, or set rollout.colocate to false for separate rollout nodes")
    return Layout(train=list(nodes), rollout=list(nodes))
