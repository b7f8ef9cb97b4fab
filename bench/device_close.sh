#!/usr/bin/env bash
# The closing GPU call for a session: device_final.sh (every GPU test, step 10's check and
# quick timing, trace, demo, subnormals), then the float64 steps 8/9/10 and float32 step 8
# kernel at 4096, 8192 and 16384 next to cuBLAS in the same run.
# Run from the repo root:  . .whl/env.sh && DISTMM_COMMIT=<hash> bash bench/device_close.sh
BUDGET=${BUDGET:-560}
. "$(dirname "$0")/device_common.sh"
T_SIMT=${T_SIMT:-150} bash bench/device_final.sh
echo "== kernels: float64 steps 8, 9, 10 and float32 step 8 with cuBLAS ($(left)s left)" | tee -a "$OUT/final.log"
timeout "$(step_timeout 150)" $PY -m bench.kernels --out "$OUT" --dtypes float64 --sizes 4096 8192 16384 \
    --no-rect --kernels warptile dmma simt_fp64 2>&1 | tee -a "$OUT/final.log" || echo "BENCH FAILED"
timeout "$(step_timeout 90)" $PY -m bench.kernels --out "$OUT" --dtypes float32 --sizes 4096 8192 16384 \
    --no-rect --kernels warptile 2>&1 | tee -a "$OUT/final.log" || echo "BENCH FAILED"
gpu_state | tee -a "$OUT/final.log"
echo "== done in ${SECONDS}s" | tee -a "$OUT/final.log"
