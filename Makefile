# The two entry points of the README (`make demo`, `make test`) install what they need first
# (idempotent). lint, typecheck and test-unit only use the venv that `make install` made.
VENV ?= .venv
PY := $(VENV)/bin/python
# Fails with the fix when the venv is missing (no install: these targets are the quick ones).
NEED_VENV = @test -x $(PY) || { echo "make: no $(PY): run 'make install' first (or set VENV=path)" >&2; exit 2; }

IMAGE ?= dynamo-flexkv:latest

.PHONY: install demo test test-unit test-ci-slow test-slow lint typecheck bench doctor peer-lmcache image lint-image

install:
	VENV=$(VENV) bash scripts/install.sh

# The main job: the Mooncake conversation trace replayed concurrently against the agg_router_vllm
# graph (2 vLLM workers) with no offload, with FlexKVConnector's host+SSD offload and tier-aware
# routing, the same with Dynamo's router hints, with host+SSD offload but device-only routing, with
# one node cache both workers share, and (once `make peer-lmcache` installed it) with LMCache in the
# workers instead (`--engine reference`: the agg_router graph of reference-engine workers, without
# the hints row; `dynamo-flexkv replay --full` runs every configuration and size).
demo: install
	$(PY) -m dynamo_flexkv.cli demo --json demo-results.jsonl

# Every benchmark with its same-run baseline.
bench: install
	$(PY) -m dynamo_flexkv.bench all --json bench-results.jsonl

# The peer `bench vllm --peer lmcache` compares with: LMCache 0.5.6 into .peers/lmcache, its own
# prefix (never the venv; test and demo do not need it).
peer-lmcache: install
	VENV=$(VENV) bash scripts/install_peer_lmcache.sh

# The default suite's processes: pytest-xdist workers, each taking whole test files (a module's graph
# fixture stays in one process). Most of the suite waits on the processes it starts; TEST_JOBS=1 runs
# it in this process, one test at a time.
TEST_JOBS ?= 2
XDIST = $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

# Everything CI runs (.ci/run): install, then lint, types, the default suite (not slow), then CI's
# subset of the slow tests (ci_slow: one per served engine path, docs/TESTING.md).
test: install
	@$(MAKE) --no-print-directory lint typecheck
	$(PY) -m pytest -q $(XDIST) --durations=15
	@$(MAKE) --no-print-directory test-ci-slow

# ruff's rules and the layout `ruff format` owns (pyproject.toml [tool.ruff]).
lint:
	$(NEED_VENV)
	$(PY) -m ruff check --output-format concise .
	$(PY) -m ruff format --check .

# mypy over the whole package (pyproject.toml [tool.mypy]).
typecheck:
	$(NEED_VENV)
	$(PY) -m mypy

# The unit tests of the default suite: in the test process only, no server, no subprocess
# (each module's kind is its folder: tests/unit/, ...; tests/conftest.py).
test-unit:
	$(NEED_VENV)
	$(PY) -m pytest -q -m "unit and not slow"

# CI's subset of the slow tests (marked ci_slow): one per served engine path, one at a time (each
# serves a graph that wants the machine's cores). From the existing .venv (no install).
test-ci-slow:
	$(NEED_VENV)
	$(PY) -m pytest -q -m ci_slow --durations=10

# Every slow test: long randomized runs, vLLM graphs, graphs over network-namespace nodes, benchmark smokes.
test-slow: install
	$(PY) -m pytest -q -m slow

doctor: install
	$(PY) -m dynamo_flexkv.cli doctor

# The image `render --k8s` names (Dockerfile: Dynamo's vLLM runtime with this checkout's wheel built
# into it). Needs Docker with BuildKit and the network (the base image is nvcr.io's).
image: lint-image
	docker build -t $(IMAGE) .

lint-image: install
	$(VENV)/bin/hadolint Dockerfile
