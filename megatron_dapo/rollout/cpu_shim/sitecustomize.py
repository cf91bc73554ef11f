"""Run by Python at the start of every process of a CPU SGLang server (this folder is on its PYTHONPATH).

SGLang's debug dumper (srt/debug_utils/dumper.py) imports megatron.core, when it is installed, at class definition,
only to name the training framework in debug dumps, which our servers never write. In this environment that costs
each of a server's three processes 3.5 s of CPU at every start, a third of its start-up; marked absent here, the
dumper takes it for not installed, as it would be in a serving-only environment."""

import sys

sys.modules.setdefault("megatron.core", None)
