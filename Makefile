# A newcomer's two commands, on a fresh machine:
#   make demo   sets up .venv/ and runs the main job
#   make test   sets up .venv/ and runs the whole test suite
# Both are idempotent: the environment is built once and rebuilt only when setup.py or csrc/ change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# setup.py imports torch to build the extension, so torch goes in first; keep in step with setup.py.
TORCH := torch==2.14.1 torchvision==0.29.1
# Keep in step with setup.py's SGLANG_VERSION.
SGLANG := sglang==0.5.23

.PHONY: setup demo test test-fast bench test-gpu

setup: $(VENV)/.built

$(VENV)/.deps: setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel ninja
	$(PY) -m pip install $(TORCH)
	touch $@

# -v shows the compiler lines (g++ for the CPU kernels, nvcc for the CUDA ones). SGLang goes in
# without its CUDA-only dependencies (see SGLANG_CPU_DEPS in setup.py): the tests run it on the CPU.
$(VENV)/.built: $(VENV)/.deps $(wildcard csrc/*)
	$(PY) -m pip install --no-build-isolation -v -e '.[test,sglang-cpu]'
	$(PY) -m pip install --no-deps $(SGLANG)
	touch $@

demo: setup
	$(VENV)/bin/megatron-dapo demo

# Two lanes (pytest-xdist processes), a module to a lane at a time: on 2 cores a serial run leaves 28 % of the CPU
# idle (servers starting, fault tests waiting out their deadlines), and two lanes fill it. Modules go whole, so
# module fixtures (servers, clusters) are built once; the slowest go first (tests/conftest.py, LONGEST_FIRST).
# --durations: CI's log lists the 30 slowest tests, where to look when the suite outgrows its time budget.
LANES := -n 2 --dist loadfile --no-loadscope-reorder
test: setup
	$(PY) -m pytest tests -ra --timeout=900 --durations=30 $(LANES)

# While developing: the unit tests and one test of each kind of integration (a trainer run, a real SGLang
# server, a conversion; the torchrun workers, the reward pool and the rollout service are among the unit
# tests' fixtures), in under 5 minutes on 2 cores. CI and the README's `make test` run everything.
test-fast: setup
	$(PY) -m pytest tests -ra --timeout=900 --durations=10 -m "not slow or smoke" $(LANES)

bench: setup
	$(PY) bench/bench_dapo_loss.py

# On a machine with a GPU, with the .venv: every GPU check in one call (tests/gpu/run.sh: build in place, CUDA
# tests, op benchmark, bf16 policy vs transformers, a short DAPO run; table in tests/gpu/results/gpu_check.md).
# On a bare GPU machine without the .venv: `bash tests/gpu/run.sh` after carrying tests/gpu/wheels.
test-gpu: setup
	PY=$(PY) bash tests/gpu/run.sh
