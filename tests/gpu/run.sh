#!/usr/bin/env bash
# Every GPU check in one go, for a machine with a CUDA device (a few minutes): the CUDA tests, then
# the CUDA sections of the benchmarks. PY names the interpreter (default: the README's .venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
nvidia-smi -L || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
"$PY" -m pytest tests/gpu -ra -q
"$PY" bench/bench_dapo_loss.py --device cuda
"$PY" bench/bench_logprobs_memory.py --device cuda --tp 1
