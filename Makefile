# flashpost: the two commands a newcomer needs, plus benchmarks.
#   make demo   set up, then run the main job (see README)
#   make test   set up, then lint and run the test suite (what CI runs)
#   make bench  set up, then run the CPU benchmarks (GPU ones run on the lent H200)
# Every target does its own set-up and is idempotent: a second run spends seconds on it.

VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup python engine demo test lint bench clean-sandboxes

setup: python engine

python:
	@bash infra/setup_python.sh

engine:
	@bash infra/docker/ensure_engine.sh
	@bash infra/docker/build_base_image.sh

demo: setup
	$(PY) -m rl.train experiment=demo

lint: python
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/run_cpu.py

clean-sandboxes: python
	$(PY) -c "from envs.engine import reap_containers; print(reap_containers())"
