#!/usr/bin/env bash
# Device script: cuBLAS's SIMT DGEMM (pedantic math) against step 10, and the DFMA issue
# order probes. From the repo root:  . .whl/env.sh && DISTMM_COMMIT=<hash> bash bench/device_simt_reference.sh
BUDGET=${BUDGET:-300}
. "$(dirname "$0")/device_common.sh"
{
echo "== $(date -u +%FT%TZ) device_simt_reference.sh; commit ${DISTMM_COMMIT:-unknown}"
gpu_state
timeout "$(step_timeout 60)" $PY -c "
from distmm.executor import cuda_loader
print(cuda_loader.warm([('simt_fp64', 'float64', None, False, False)]))" 2>&1 | tail -2
timeout "$(step_timeout 150)" $PY -m bench.simt_reference --out "$OUT" || echo "REFERENCE FAILED rc=$?"
timeout "$(step_timeout 120)" $PY -m bench.dfma_probe --orders || echo "PROBE FAILED rc=$?"
gpu_state
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/simt-reference.log"
