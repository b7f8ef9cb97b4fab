#!/usr/bin/env bash
# The headline ratios on a GPU: float32 steps 8 and 9 (the raw backend's kernel; its float32
# default is step 8's tuned best) and float64 steps 8, 9 and 10 against cuBLAS at
# 4096, 8192 and 16384, timed in alternation (ROUNDS rounds, median), so that a clock or power
# change during the run hits cuBLAS and the kernels alike.
# Run from the repo root:  . .whl/env.sh && DISTMM_COMMIT=<hash> bash bench/device_ratios.sh
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/device_common.sh"
ROUNDS=${ROUNDS:-5}
log="$OUT/ratios.log"
{ date -u; gpu_state; } | tee "$log"
timeout "$(step_timeout 150)" $PY -m bench.kernels --out "$OUT" --rounds "$ROUNDS" --dtypes float32 \
    --sizes 4096 8192 16384 --no-rect --kernels warptile dmma 2>&1 | tee -a "$log" || echo "BENCH FAILED" | tee -a "$log"
timeout "$(step_timeout 150)" $PY -m bench.kernels --out "$OUT" --rounds "$ROUNDS" --dtypes float64 \
    --sizes 4096 8192 16384 --no-rect --kernels warptile dmma simt_fp64 2>&1 | tee -a "$log" || echo "BENCH FAILED" | tee -a "$log"
echo "== zarr-backed GPU pipeline tests (the bundle needs zarr: wheels.sh zarr==3.1.6 numcodecs ...)" | tee -a "$log"
timeout "$(step_timeout 60)" $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_gpu_pipeline.py -k zarr \
    2>&1 | tail -5 | tee -a "$log"
gpu_state | tee -a "$log"
echo "== done in ${SECONDS}s" | tee -a "$log"
