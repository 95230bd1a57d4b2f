#!/usr/bin/env bash
# The CUDA device check: the parity and equality tests, then the engine benchmark, with every engine on the GPU.
#
#   scripts/device_check.sh [--cluster] [OUT_DIR]
#
# Run it on a machine with a CUDA build of torch and a visible GPU (it stops at once otherwise, saying which is
# missing). The tests run with `pytest --device cuda` (tests/conftest.py: in-process engines and worker processes
# default to `--device cuda`); `--cluster` adds the multi-process rungs (router, chaos, load), which take longer.
# Writes into OUT_DIR (default: device-check/): env.txt, nvidia-smi.txt, tests.log, tests.xml, bench.log; the
# benchmark also writes bench/results/engine_vs_transformers_cuda.{json,png}. Every step runs; the exit status is
# non-zero when any failed. Until this has passed on a GPU machine, docs/operations.md calls CUDA untested.
set -uo pipefail
cd "$(dirname "$0")/.."

cluster=0
if [[ "${1:-}" == "--cluster" ]]; then cluster=1; shift; fi
out="${1:-device-check}"
mkdir -p "$out"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi

# The equality ladder's in-process rungs (transformers parity, chunked, batched, prefix cache, DSpark, seeded
# sampling, P/D in one process), the multi-stream prepare on real streams, and the backend selection itself.
tests=(
  tests/unit/test_hardware_backends.py
  tests/integration/test_model_parity.py
  tests/integration/test_chunked_and_batched.py
  tests/integration/test_prefix_cache.py
  tests/integration/test_speculative.py
  tests/integration/test_seeded_sampling.py
  tests/integration/test_pd_inprocess.py
  tests/integration/test_multi_stream_prepare.py
)
if (( cluster )); then
  tests+=(tests/cluster/test_chaos.py tests/cluster/test_serving_load.py)
fi

"$py" - <<'PY' > "$out/env.txt" 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.version.cuda is None:
    raise SystemExit("this torch is a CPU build: install a CUDA build of torch")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PY
status=$?
cat "$out/env.txt"
if (( status != 0 )); then
  echo "device check: not a usable CUDA machine (see $out/env.txt)" >&2
  exit 2
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

failed=0
echo "== tests (--device cuda) =="
timeout 3600 "$py" -m pytest -q --device cuda --junitxml="$out/tests.xml" "${tests[@]}" 2>&1 | tee "$out/tests.log"
(( PIPESTATUS[0] == 0 )) || failed=1

echo "== engine benchmark (--device cuda) =="
timeout 3600 "$py" bench/bench_engine_vs_transformers.py --device cuda --batches 1,32 2>&1 | tee "$out/bench.log"
(( PIPESTATUS[0] == 0 )) || failed=1

if (( failed )); then
  echo "device check: FAILED (logs in $out/)" >&2
  exit 1
fi
echo "device check: passed (logs in $out/)"
