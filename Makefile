# Quick start: `make demo` runs the demo, `make test` runs lint and the CPU test suite.
# Each sets up its own environment first (scripts/setup-env). Pass extra arguments with ARGS="...".
PY := .venv/bin/python

.PHONY: demo test env

env:
	@scripts/setup-env

demo: env
	$(PY) -m fluxcompile demo $(ARGS)

test: env
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)
