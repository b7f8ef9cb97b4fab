# Sourced by the bench/device_*.sh scripts: output folder, kernel caches, time budget.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/distmm-out}
mkdir -p "$OUT"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}
export DISTMM_CACHE_DIR=${DISTMM_CACHE_DIR:-/tmp/distmm-cache}
unset CUPY_TF32
BUDGET=${BUDGET:-300}
PY=${PY:-python3}
left() { echo $(( BUDGET - SECONDS )); }
step_timeout() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }
gpu_state() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv; }
