# modelship: `make demo` and `make test` are the two commands a newcomer needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
RUNTIME := .venv-triton
BIN := $(VENV)/bin
# uv from PATH, else the one pip puts next to $(PYTHON) (`python -m uv` needs no PATH entry).
UV := $(or $(shell command -v uv 2>/dev/null),$(PYTHON) -m uv)
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := false

.PHONY: install uv browser gateway demo test test-fast lint unit bench clean-stack deploy worker

install: browser gateway
	@# The two venvs side by side: each is mostly linking wheels out of uv's cache, and
	@# neither needs the other.
	@$(MAKE) --no-print-directory -s -j2 $(VENV)/.installed $(RUNTIME)/.installed

# Debian's headless Chromium and its driver, for the Slack emulator web-view test (selenium
# drives it); installed only when missing, with apt (root, or sudo when not root).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; }

# Debian's nginx: the stack's gateway in front of the Tritons (docs/gateway.md), which
# `stack up` runs itself on loopback ports. Installed only when missing, with apt; the
# distribution's own service (port 80), which the install may start, is stopped and disabled.
gateway:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq nginx && \
	  { ! command -v systemctl >/dev/null 2>&1 || \
	    $(SUDO) systemctl disable --now nginx >/dev/null 2>&1 || true; }; }

# torch for the dev extra: the CPU build, from a folder of wheels when it exists (these
# machines keep torch 2.13.0+cpu in /opt/wheels; uv does not look there by itself). Without
# the pin a resolver picks a multi-GB CUDA build. Override both for another machine, e.g.
# `make install TORCH_WHEELS=~/wheels`.
TORCH ?= torch==2.13.0+cpu
TORCH_WHEELS ?= /opt/wheels
TORCH_FIND_LINKS := $(if $(wildcard $(TORCH_WHEELS)/torch-*.whl),--find-links $(TORCH_WHEELS))

# uv itself, once, before the two venvs are built side by side.
uv:
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv

# No --compile-bytecode: compiling all of site-packages (22,489 files) took 72 s of CPU and
# most of the install's 2 minutes, where a first `make test` imports about a third of
# them. Bytecode is written instead by the processes themselves, once, on first import:
# make runs its recipes without PYTHONDONTWRITEBYTECODE (which these machines may set;
# with it, every process would compile mlflow/GX/skl2onnx again, ~10 s each). The writes
# are atomic (a temporary file, then a rename), so two processes importing one module at
# once are safe.
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.installed: pyproject.toml | uv
	@test -x $(BIN)/python || $(UV) venv -q --python $(PYTHON) $(VENV)
	@$(UV) pip install -q --python $(BIN)/python -e '.[dev]' \
	  $(if $(TORCH),'$(TORCH)') $(TORCH_FIND_LINKS)
	@touch $@

$(RUNTIME)/.installed: requirements-triton.txt | uv
	@test -x $(RUNTIME)/bin/python || $(UV) venv -q --python $(PYTHON) $(RUNTIME)
	@$(UV) pip install -q --python $(RUNTIME)/bin/python -r requirements-triton.txt
	@touch $@

demo: install
	$(BIN)/modelship stack up
	$(BIN)/modelship demo

# Register prefect.yaml's deployments (promote, check, swap, rollback, nightly on cron) on the
# stack's Prefect server, creating the process work pool first; `make worker` runs them.
deploy: install
	$(BIN)/modelship deploy

worker: install
	$(BIN)/modelship worker

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache  # the layer contracts in pyproject.toml (README "Layers")

# The whole suite on both cores (pytest-xdist). Each test file is one unit of work (its module
# fixtures stay in one process) and each worker starts its own session stack; the units
# go out heaviest first, so the two workers end together (tests/conftest.py: its
# scheduler, FILE_SECONDS, SPLIT).
# --durations=25 prints where the time went.
# The canary's latency tests run alone: they measure latency, and the other worker's
# promotions make it bursty (lag-1 autocorrelation 0.59 measured), so the block test, which
# is built to discount exactly that, no longer shows a 2.5x p99 at 3100 requests. Their stack
# comes up first, and lint runs beside them at idle priority (SCHED_IDLE: it gets a core
# only when nothing else wants one, so the latency tests see a quiet machine) and costs no
# time of its own; its output follows theirs, and a lint failure stops `make test` before the
# long part, as a failure of the canary's tests does not (both parts run). The canary's stack
# then serves the first worker as its session stack (tests/stack_fixtures.py), one stack
# start fewer; the exit trap stops it. The unit tests (pure: no server, no wall-clock
# verdict) run beside the two workers in one process at idle priority, as lint does: the
# workers leave about a fifth of the cores idle while their tests wait on servers, windows
# and bakes, and the unit tests take that time instead of a worker's (at nice 19 rather
# than SCHED_IDLE, the e2e files took ~10% longer); their output follows the workers'.
PYTEST := $(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder
ALONE := tests/integration/test_canary.py
ALONE_STACK = env MODELSHIP_HOME="$$home" MODELSHIP_TRITON_RUNTIME=$(CURDIR)/$(RUNTIME) \
  MODELSHIP_STACK_READY_TIMEOUT_S=300 $(BIN)/modelship stack
IDLE := $(shell chrt --idle 0 true 2>/dev/null && echo chrt --idle 0 || echo nice -n 19)
test: install
	@home=$$(mktemp -d)/.modelship; \
	trap 'wait; $(ALONE_STACK) down >/dev/null 2>&1; rm -rf "$${home%/.modelship}"' EXIT; \
	$(ALONE_STACK) up --replicas 2 --json >"$$home.up.log" 2>&1 & up=$$!; \
	$(IDLE) $(MAKE) --no-print-directory lint >"$$home.lint.log" 2>&1 & lint=$$!; \
	wait $$up || { echo "stack up for $(ALONE) failed:"; cat "$$home.up.log"; exit 1; }; \
	echo "MODELSHIP_TEST_STACK_HOME=$$home pytest --durations=5 $(ALONE)"; \
	MODELSHIP_TEST_STACK_HOME="$$home" $(BIN)/pytest -q -p no:cacheprovider --durations=5 \
	  $(ALONE); alone=$$?; \
	wait $$lint; linted=$$?; cat "$$home.lint.log"; \
	[ $$linted -eq 0 ] || { echo "lint failed (above): fix it, then run make test again"; exit $$linted; }; \
	echo "$(IDLE) $(BIN)/pytest -q -p no:cacheprovider --durations=5 tests/unit (beside)"; \
	$(IDLE) $(BIN)/pytest -q -p no:cacheprovider --durations=5 tests/unit \
	  >"$$home.unit.log" 2>&1 & unit=$$!; \
	echo "MODELSHIP_TEST_STACK_HOME_gw0=$$home $(PYTEST) --durations=25 --ignore=$(ALONE) --ignore=tests/unit"; \
	MODELSHIP_TEST_STACK_HOME_gw0="$$home" $(PYTEST) --durations=25 --ignore=$(ALONE) \
	  --ignore=tests/unit; rest=$$?; \
	wait $$unit; units=$$?; cat "$$home.unit.log"; \
	exit $$(( alone ? alone : rest ? rest : units ))

# Lint and the unit tests only: the quick loop while editing. Lint (one core: mypy) runs
# beside the unit tests' two workers and fills the core they leave idle; its output
# follows theirs.
test-fast: install
	@log=$$(mktemp); $(MAKE) --no-print-directory lint >"$$log" 2>&1 & lint=$$!; \
	$(PYTEST) tests/unit; unit=$$?; \
	wait $$lint; linted=$$?; cat "$$log"; rm -f "$$log"; \
	exit $$(( linted ? linted : unit ))

unit: install
	$(PYTEST) tests/unit

bench: install
	$(BIN)/python -m bench

clean-stack:
	-$(BIN)/modelship stack down
