#!/usr/bin/env bash
# Issue #37 on a lent GPU machine (no package registry there): run from the repository root with the
# wheels of bench/gpu_wheels.txt carried as .whl (see docs/performance.md, "GPU check"):
#   device run, carry [".whl"], command "bash bench/gpu_check.sh", timeout_s 540
# (fetch the wheels as bench/gpu_wheels.txt says, into .whl, which .git/info/exclude ignores)
# QUICK=1 runs the tiny models (a check of the script). The report lands in $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench/gpu_check.py --work /tmp/gpu_work ${QUICK:+--quick} 2>&1 | tee "${OUT:-/tmp}/gpu_check.log" || status=$?
cp /tmp/gpu_work/gpu_check.json "${OUT:-/tmp}/" || true
# Issue #34's FP8 benchmark on this machine's CPUs (more cores than a CI machine), in what time the
# lease leaves: one run of each command; its log comes back even when it is cut short.
if [ -z "${QUICK:-}" ] && [ "$SECONDS" -lt "${FP8_BENCH_BEFORE:-300}" ]; then
  timeout $(( ${FP8_BENCH_UNTIL:-420} - SECONDS )) python3 bench/bench_fp8.py --runs 1 --settle 1 \
    --data-dir /tmp/gpu_work/fp8data --work-dir /tmp/gpu_work/fp8out 2>&1 | tee "${OUT:-/tmp}/bench_fp8.log" || true
fi
exit "${status:-0}"
