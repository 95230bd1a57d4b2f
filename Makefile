# pdspark: `make run` sets up .venv and runs the main job; `make test` sets up .venv and runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= dsv4-tiny
PROMPT ?= def fibonacci(n):

.PHONY: setup run test lint bench clean proto

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first (a bare `torch` requirement would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/pdspark generate --model $(MODEL) --max-tokens 64 "$(PROMPT)"

lint: setup
	$(VENV)/bin/ruff check src tests bench scripts

test: setup lint
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) bench/bench_engine_vs_transformers.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Regenerate the gRPC/protobuf code from proto/ (committed; tests/test_proto_drift.py checks it is current).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=src --pyi_out=src --grpc_python_out=src proto/pdspark/v1/*.proto
