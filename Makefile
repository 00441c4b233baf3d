# gpubalance: `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# command -> Debian package that provides it
SYSTEM_DEPS := gcc:gcc promtool:prometheus haproxy:haproxy openssl:openssl chromium:chromium amtool:prometheus-alertmanager
FUZZ_INPUTS ?= 100000
# repetitions of `make test-repeat`, and its pytest-xdist workers (1: one test at a time)
N ?= 5
REPEAT_JOBS ?= 1
# where `make test-repeat` writes each failure's traceback as it happens
REPEAT_FAILURES ?= test-repeat-failures.txt
# pytest-xdist workers of `make test` (the CI machine has 2 cores)
TEST_JOBS ?= 2
# `make eval`: variants per scenario family it judges; TRAIN_COUNT: variants per family that
# train `make model`'s model and `make eval`'s folds (at least EVAL_COUNT; the first EVAL_COUNT
# of each are the judged ones)
# GENTD: the Alibaba GenTD26 folder, for `make eval` to check on it too
EVAL_COUNT ?= 8
TRAIN_COUNT ?= 32
GENTD ?=

.PHONY: all venv system-deps fakenvml test test-repeat lint demo bench soak eval model clean

all: test

system-deps:
	@missing=""; for pair in $(SYSTEM_DEPS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "missing system packages:$$missing"; \
	    echo "run: sudo apt-get install -y --no-install-recommends$$missing"; \
	    exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "run: sudo apt-get install -y python3-venv"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

fakenvml: venv system-deps
	$(PY) -m gpubalance lab fakenvml build --out build/fakenvml

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv system-deps fakenvml lint
	$(VENV)/bin/pytest -q -n $(TEST_JOBS) --dist loadgroup --durations=15

# the tests that run on real clocks, N rounds of all of them: counts how often each passes
test-repeat: venv system-deps fakenvml
	rm -f $(REPEAT_FAILURES)
	GPUBALANCE_FAILURE_LOG=$(abspath $(REPEAT_FAILURES)) $(VENV)/bin/pytest -q -n $(REPEAT_JOBS) -m "live or haproxy or timing" --count $(N) --repeat-scope session

demo: venv system-deps fakenvml
	$(PY) -m gpubalance lab demo

bench: venv system-deps fakenvml
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/exporter.py
	$(PY) bench/lab.py
	$(PY) bench/validation.py
	$(PY) bench/analyzer.py
	$(PY) bench/rho_estimates.py
	$(PY) bench/loop.py
	$(PY) bench/fuzz.py --exposition $(FUZZ_INPUTS) --otlp $(FUZZ_INPUTS)

# 30 minutes: too long for `make bench`; the tests run a 2-minute version
soak: venv system-deps fakenvml
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/soak.py --minutes 30

# the model gpubalance ships (the analyzer's default classifier), with its report beside it
model: venv
	$(PY) -m gpubalance analyzer train --count $(TRAIN_COUNT) --seed 1 --out analyzer/models/default.skops

# held-out verdict scores beside the baselines -> analyzer/EVALUATION.md and its plots
eval: venv
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m gpubalance analyzer evaluate --count $(EVAL_COUNT) --train-count $(TRAIN_COUNT) \
	  --model-out build/eval/model.skops
	@if [ -n "$(GENTD)" ]; then \
	  $(PY) -m gpubalance analyzer check-gentd "$(GENTD)" --model build/eval/model.skops \
	    --report analyzer/EVALUATION.md; \
	fi

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
