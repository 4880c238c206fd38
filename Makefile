# flashpost: the two commands a newcomer needs, plus benchmarks.
#   make demo   set up, then run the main job (see README)
#   make test   set up, then lint and run the test suite, numerics tests also on other CPU kernel paths (CI)
#   make bench  set up, then run the CPU benchmarks (GPU ones run on the lent H200)
# Every target does its own set-up and is idempotent: a second run spends seconds on it.

VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup python engine demo test test-isa lint bench clean-sandboxes

setup: python engine

python:
	@bash infra/setup_python.sh

engine:
	@bash infra/docker/ensure_engine.sh
	@bash infra/docker/build_base_image.sh

# Chromium only photographs the Ray dashboard for the report: without it the demo runs and says so
demo: setup
	@bash infra/ensure_chromium.sh || echo "no chromium: the demo report goes without its dashboard screenshot"
	$(PY) -m rl.train experiment=demo

lint: python
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-isa

# The `numerics` tests (two numerical paths compared) again under other CPU kernel paths: ATen's generic
# and AVX2 kernels, oneDNN and MKL capped at AVX2 (the code MKL runs on AMD). Each sums in another order,
# so a tolerance or seed that holds only for this CPU's summation order fails here, not on a user's CPU.
ISA_PATHS := ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"

test-isa: python
	@files=$$($(PY) -m pytest -q -p no:cacheprovider --collect-only -m numerics | grep '::' | cut -d: -f1 | sort -u); \
	for isa in $(ISA_PATHS); do \
		echo "numerics tests under $$isa"; \
		env $$isa $(PY) -m pytest -q -p no:cacheprovider -m numerics --durations=5 $$files || exit 1; \
	done

bench: setup
	$(PY) bench/run_cpu.py

clean-sandboxes: python
	$(PY) -c "from envs.engine import reap_containers; print(reap_containers())"
