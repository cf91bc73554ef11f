"""What a tool is to the rollout: a name, and an async call from the model's text to the text it gets back.

A tool's failures (a timeout, a limit, a crash, a bad request) are the model's business: they come back as a
ToolResult with `error` set and a message in `text` for the policy to read, never as an exception into the
trainer. Only a tool that cannot work at all (its sandbox cannot be set up, its service is unreachable at start)
raises, when it is built. The Python sandbox is one tool; a calculator or a remote sandbox service over HTTP
would be others, with no change to the loop that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolResult:
    text: str  # what goes back to the model: the output, with the error's message where there is one
    error: str | None = None  # None, or what ended the call: "timeout", "cpu_time", "killed", "exit"
    seconds: float = 0.0  # wall-clock time of the call
    output_bytes: int = 0  # bytes the call wrote, before the output limit cut them


class Tool(Protocol):
    name: str

    async def call(self, request: str) -> ToolResult:
        """Run one request (for the Python tool, a program's source); never raises for the request's faults."""

    def close(self) -> None:
        """Stop what the tool started."""
