#!/bin/bash
# Device script: SIMT float64 shape search for step 10 (bench/simt64.py: every 8x8-thread-tile
# configuration checked and timed at 4096, the best 4 checked on odd/transposed shapes and
# timed at 4096/8192/16384 alternating with cuBLAS DGEMM), step 10's GPU tests, and an ncu
# profile of the best configuration at 8192. Run from the repository root:
#   . .whl/env.sh && bash bench/device_simt64_search.sh
. "$(dirname "$0")/device_common.sh"
{
echo "== $(date -u +%FT%TZ) device_simt64_search.sh; budget ${BUDGET}s; commit ${DISTMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
gpu_state
echo "== search ($(left)s left)"
timeout "$(step_timeout 330)" $PY -m bench.simt64 --out "$OUT" --budget 300 || echo "SEARCH FAILED rc=$?"
gpu_state
echo "== tests: step 10 ($(left)s left)"
timeout "$(step_timeout 120)" $PY -m pytest -m gpu -q -p no:cacheprovider -rf --timeout 90 \
    tests/test_gpu_kernels.py -k simt_fp64 2>&1 | tail -15 || echo "TESTS FAILED rc=$?"
if [ -f "$OUT/simt64-best.json" ] && command -v ncu >/dev/null; then
  echo "== ncu: best configuration at 8192 ($(left)s left)"
  timeout "$(step_timeout 100)" ncu --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats -k regex:simt \
      --launch-skip 1 --launch-count 1 $PY -m bench.simt64 --launch "$OUT/simt64-best.json" 8192 \
      2>&1 | grep -v "^==PROF==" | tail -120 || echo "NCU FAILED rc=$?"
fi
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device-simt64-search.log"
