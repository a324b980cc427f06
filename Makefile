# The two entry points of the README. Each installs what it needs first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-slow bench doctor

install:
	VENV=$(VENV) bash scripts/install.sh

# The main job. Until the Dynamo serve graph exists it runs every benchmark (with its same-run
# baseline) and prints the table.
demo: install
	$(PY) -m dynamo_flexkv.cli doctor
	$(PY) -m dynamo_flexkv.bench all --json bench-results.jsonl

test: install
	$(PY) -m pytest -q

# Long randomized runs of the index and planner properties.
test-slow: install
	$(PY) -m pytest -q -m slow

doctor: install
	$(PY) -m dynamo_flexkv.cli doctor
