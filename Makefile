# Quick start: `make demo` runs the demo, `make test` runs lint and the CPU test suite.
# Each sets up its own environment first (scripts/setup-env): the demo needs torch and the project only,
# the tests add the test extra and, on machines without GPUs, vLLM. Pass extra arguments with ARGS="...".
PY := .venv/bin/python

.PHONY: demo test env test-env

env:
	@scripts/setup-env

test-env:
	@scripts/setup-env test

demo: env
	$(PY) -m fluxcompile demo $(ARGS)

test: test-env
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)
