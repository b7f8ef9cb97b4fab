#!/usr/bin/env bash
# The closing GPU call for a session: device_final.sh (every GPU test, step 10's check and
# quick timing, trace, demo, subnormals), then device_ratios.sh (float32 steps 8/9 and
# float64 steps 8/9/10 against cuBLAS at 4096, 8192 and 16384, timed in alternation).
# Run from the repo root:  . .whl/env.sh && DISTMM_COMMIT=<hash> bash bench/device_close.sh
BUDGET=${BUDGET:-560}
. "$(dirname "$0")/device_common.sh"
T_SIMT=${T_SIMT:-150} bash bench/device_final.sh
echo "== device_ratios.sh ($(left)s left)" | tee -a "$OUT/final.log"
BUDGET=$(left) bash bench/device_ratios.sh 2>&1 | tail -3
echo "== done in ${SECONDS}s" | tee -a "$OUT/final.log"
