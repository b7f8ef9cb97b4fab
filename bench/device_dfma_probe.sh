#!/bin/bash
# Device script: DFMA issue probes (bench/dfma_probe.py) and the stall reasons of step 10's
# best float64 configuration (bench/simt64.py --launch) under ncu. From the repository root:
#   . .whl/env.sh && bash bench/device_dfma_probe.sh [PARAMS_JSON]
. "$(dirname "$0")/device_common.sh"
BEST=${1:-}
{
echo "== $(date -u +%FT%TZ) device_dfma_probe.sh; commit ${DISTMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
gpu_state
timeout "$(step_timeout 200)" $PY -m bench.dfma_probe || echo "PROBE FAILED rc=$?"
gpu_state
if [ -n "$BEST" ] && command -v ncu >/dev/null; then
  echo "== ncu stall reasons: $BEST at 8192 ($(left)s left)"
  timeout "$(step_timeout 150)" ncu --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__inst_executed_pipe_fp64.sum,sm__pipe_fp64_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_op_shared_ld.sum" \
      -k regex:simt --launch-skip 1 --launch-count 1 $PY -m bench.simt64 --launch "$BEST" 8192 \
      2>&1 | grep -v "^==PROF==" | tail -60 || echo "NCU FAILED rc=$?"
fi
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device-dfma-probe.log"
