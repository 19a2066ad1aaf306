# Quick start: `make demo` runs the demo, `make test` runs lint and the CPU test suite.
# Each sets up its own environment first (scripts/setup-env): the demo needs torch and the project only,
# the tests add the test extra and, on machines without GPUs, the integrations' packages (vLLM, megatron-core).
# STACK picks the torch the tests run on: default (.venv, torch 2.13) or newest (.venv-newest, torch 2.15);
# `make test-newest` is `make test STACK=newest`. Pass extra arguments with ARGS="...".
STACK ?= default
VENV_default := .venv
VENV_newest := .venv-newest
VENV := $(VENV_$(STACK))
ifeq ($(VENV),)
$(error unknown STACK '$(STACK)' (default or newest))
endif
PY := $(VENV)/bin/python

.PHONY: demo test test-newest env test-env

env:
	@STACK=$(STACK) scripts/setup-env

test-env:
	@STACK=$(STACK) scripts/setup-env test

demo: env
	$(PY) -m fluxcompile demo $(ARGS)

test: test-env
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)

test-newest:
	@$(MAKE) --no-print-directory test STACK=newest
