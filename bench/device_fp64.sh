#!/bin/bash
# Short device script for the float64 kernels (step 9 DMMA, step 8 SIMT) in one run:
# compile, check against float64 references, tune step 9's float64 shapes, and time cuBLAS
# DGEMM and the kernels at 4096/8192/16384 (float32 at 8192 too, since step 9 is also the
# float32 raw kernel). Run from the repository root on a GPU machine:
#   . .whl/env.sh && bash bench/device_fp64.sh
# Writes device.log, tune.json, tune-*.jsonl and kernels-*.jsonl under $OUT; ends within
# BUDGET seconds (default 230).
BUDGET=${BUDGET:-230}
. "$(dirname "$0")/device_common.sh"
PYTEST="$PY -m pytest -m gpu -q -p no:cacheprovider -rf --timeout 60 tests/test_gpu_kernels.py"

{
echo "== $(date -u +%FT%TZ) device_fp64.sh; budget ${BUDGET}s; commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "== warm: step 9 for every dtype and layout, its tuning samples, step 8 defaults (NN) ($(left)s left)"
# (from a file: the compile processes are spawned, and spawn cannot re-import <stdin>)
WARM_PY=$(mktemp --suffix=.py)
cat > "$WARM_PY" <<'PYEOF'
import time
import distmm.registry as r
from bench.kernels import warm_items
from distmm.executor import cuda_loader
if __name__ == "__main__":
    t0 = time.perf_counter()
    items = [it for it in warm_items() if it[0] == "dmma"]
    items += [("warptile", dt, None, False, False) for dt in ("float32", "float64")]
    err = cuda_loader.warm(items)
    print(f"compiled {len(items)} kernels in {time.perf_counter() - t0:.1f} s; {len(err)} errors")
    for e in err:
        print("  ", e)
PYEOF
timeout "$(step_timeout 70)" $PY "$WARM_PY" || echo "WARM FAILED rc=$?"
echo "== tests: step 9 float64, tuning samples, nvcc path ($(left)s left)"
timeout "$(step_timeout 60)" $PYTEST -k "dmma-float64 or tuning_space or nvcc_cubin" 2>&1 | tail -25 \
    || echo "TESTS FAILED rc=$?"
echo "== tune step 9 float64 ($(left)s left)"
timeout "$(step_timeout 70)" $PY -m distmm.tune --dtype float64 --size 4096 --confirm-size 8192 \
    --records "$OUT" || echo "TUNE FAILED rc=$?"
cp "$DISTMM_CACHE_DIR/tune.json" "$OUT/tune.json" 2>/dev/null
echo "== bench float64 ($(left)s left)"
timeout "$(step_timeout 50)" $PY -m bench.kernels --out "$OUT" --dtypes float64 --sizes 4096 8192 16384 \
    --no-rect --kernels warptile dmma || echo "BENCH FAILED rc=$?"
echo "== bench float32 n=8192 ($(left)s left)"
timeout "$(step_timeout 25)" $PY -m bench.kernels --out "$OUT" --dtypes float32 --sizes 8192 \
    --no-rect --kernels warptile dmma || echo "BENCH FAILED rc=$?"
echo "== tests: the rest of step 9: float32, int32, int64, k=0 ($(left)s left)"
timeout "$(step_timeout 60)" $PYTEST -k "dmma and not dmma-float64" 2>&1 | tail -25 || echo "TESTS FAILED rc=$?"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device.log"
