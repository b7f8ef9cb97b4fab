#!/bin/bash
# Device script: A/B of step 10's compile-time inner-loop variants (bench/simt64_variants.py)
# against cuBLAS DGEMM, with the SM clock and power sampled meanwhile, the DFMA probes run
# sustained (clock and power), then step 10's GPU tests with the source defaults. Run from the repository root:
#   . .whl/env.sh && bash bench/device_simt64_variants.sh [NAME=KPAIRS,ORDER ...]
BUDGET=${BUDGET:-420}
. "$(dirname "$0")/device_common.sh"
VARIANTS=${*:-"unrolled=64,0 pair=1,0 col=64,1 pairs3=1,0:STAGES=3"}
{
echo "== $(date -u +%FT%TZ) device_simt64_variants.sh; budget ${BUDGET}s; commit ${DISTMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
gpu_state
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 250 > "$OUT/clocks.csv" &
SMI=$!
echo "== variants: $VARIANTS ($(left)s left)"
timeout "$(step_timeout 330)" $PY -m bench.simt64_variants --out "$OUT" --clocks "${CLOCKS:-8192}" $VARIANTS || echo "VARIANTS FAILED rc=$?"
kill $SMI 2>/dev/null
$PY - "$OUT/clocks.csv" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
busy = [(int(r[1].split()[0]), float(r[2].split()[0])) for r in rows if len(r) > 2 and float(r[2].split()[0]) > 200]
if busy:
    cl = sorted(c for c, _ in busy); pw = sorted(p for _, p in busy)
    print(f"SM clock under load (power > 200 W, {len(busy)} samples): min {cl[0]} median {cl[len(cl)//2]} max {cl[-1]} MHz; "
          f"power median {pw[len(pw)//2]:.0f} W, max {pw[-1]:.0f} W")
PYEOF
if [ -z "$SKIP_PROBE" ]; then
  echo "== DFMA probes, sustained ($(left)s left)"
  timeout "$(step_timeout 60)" $PY -m bench.dfma_probe --sustained || echo "PROBE FAILED rc=$?"
fi
echo "== tests: step 10 with the source defaults ($(left)s left)"
timeout "$(step_timeout 90)" $PY -m pytest -m gpu -q -p no:cacheprovider -rf --timeout 60 \
    tests/test_gpu_kernels.py -k "simt_fp64 or split_tail" 2>&1 | tail -15 || echo "TESTS FAILED rc=$?"
gpu_state
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device.log"
