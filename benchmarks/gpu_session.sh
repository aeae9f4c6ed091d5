#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool; see ../shared/docs/gpu-device.md): install the carried
# wheels (.whl/: pydantic and its three dependencies), then `make gpu-check` and `make gpu-bench`, each
# under its own timeout so that a stall in one still leaves the others' figures; every log and JSON file
# lands in $OUT as it is written.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${CHECK_S:-170}" make gpu-check GPU_PY=python3 2>&1 | tee "$OUT/gpu_check.log" | grep -E "passed|failed|Error|error" | tail -15
make gpu-bench GPU_PY=python3 GPU_BENCH_OUT="$OUT" GPU_BENCH_S="${BENCH_S:-230 200}" 2> >(tee "$OUT/gpu_bench_lines.jsonl" >&2) >/dev/null
