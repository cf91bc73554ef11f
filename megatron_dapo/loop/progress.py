"""Where the run stands, shared by the loop and the parts that label what they do with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunProgress:
    steps_done: int = 0  # rollout steps done; also the version of the weights in the policy, which the servers get
