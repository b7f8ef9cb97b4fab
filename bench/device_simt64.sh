#!/bin/bash
# Short device script for step 10 (SIMT float64, kernels/cuda/10_simt_fp64.cu): compile,
# check it against float64 references (every dtype, sizes 1..4097, transposes, its tuning
# samples), time cuBLAS DGEMM, step 8 (SIMT) and step 10 at 4096 and 8192 in one run, and a
# quick timing of a few of step 10's float64 shapes at 4096. Run from the repository root:
#   . .whl/env.sh && bash bench/device_simt64.sh
# Writes device.log and kernels-*.jsonl under $OUT; ends within BUDGET seconds (default 150).
BUDGET=${BUDGET:-150}
. "$(dirname "$0")/device_common.sh"
PYTEST="$PY -m pytest -m gpu -q -p no:cacheprovider -rf --timeout 60 tests/test_gpu_kernels.py"

# The quick-tune shapes (float64): the default and its neighbours in the small space.
SHAPES_PY=$(mktemp --suffix=.py)
cat > "$SHAPES_PY" <<'PYEOF'
import sys
import time
import distmm.registry as r

def shapes():
    spec = r.get("simt_fp64")
    d = spec.params("float64")
    want = [d, dict(d, MINB=1), dict(d, BM=64, BN=128), dict(d, BK=8), dict(d, STAGES=4),
            dict(d, TM=4, TN=8), dict(d, WM=64, WN=16), dict(d, BM=128, BN=128, MINB=1)]
    out = []
    for p in want:
        if p not in out and not spec.violations("float64", p):
            out.append(p)
    return out

def warm():
    from distmm.executor import cuda_loader
    t0 = time.perf_counter()
    items = [("simt_fp64", dt, None, bool(a), bool(b)) for dt in r.DTYPES
             for a in (0, 1) for b in (0, 1)]
    items += [("warptile", "float64", None, False, False)]
    items += [("simt_fp64", "float64", p, False, False) for p in shapes()[1:]]
    cands = r.get("simt_fp64").candidates("float64")  # the GPU test's tuning samples
    for p in cands[1:len(cands):max(1, len(cands) // 4)]:
        items += [("simt_fp64", "float64", p, False, False), ("simt_fp64", "float64", p, True, True)]
    err = cuda_loader.warm(items)
    print(f"compiled {len(items)} kernels in {time.perf_counter() - t0:.1f} s; {len(err)} errors")
    for e in err:
        print("  ", e)

def tune(n=4096):
    import cupy
    from distmm.tune import _raw_runner, random_operands, relerr_gpu, time_gpu
    spec = r.get("simt_fp64")
    a, b = random_operands(n, n, n, "float64")
    c = cupy.empty((n, n), dtype="float64")
    blas = lambda: cupy.matmul(a, b, out=c)  # noqa: E731
    sec = time_gpu(blas, repeat=5, warmup=1)
    print(f"cublas float64 n={n}: {2 * n**3 / sec / 1e12:.2f} TFLOP/s")
    for p in shapes():
        run = _raw_runner(spec, p, a, b, c)
        c.fill(float("nan"))
        run()
        cupy.cuda.get_current_stream().synchronize()
        err = relerr_gpu(c, a, b)
        s = time_gpu(run, repeat=5, warmup=1)
        print(f"simt_fp64 n={n} {p}: {2 * n**3 / s / 1e12:.2f} TFLOP/s "
              f"({100 * sec / s:.0f}% of cuBLAS) relerr {err:.1e}", flush=True)

if __name__ == "__main__":
    {"warm": warm, "tune": tune}[sys.argv[1]]()
PYEOF

{
echo "== $(date -u +%FT%TZ) device_simt64.sh; budget ${BUDGET}s; commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "== warm: step 10 every dtype and layout, its quick-tune shapes and test samples, step 8 float64 ($(left)s left)"
timeout "$(step_timeout 45)" $PY "$SHAPES_PY" warm || echo "WARM FAILED rc=$?"
echo "== tests: step 10 ($(left)s left)"
timeout "$(step_timeout 45)" $PYTEST -k "simt_fp64" 2>&1 | tail -25 || echo "TESTS FAILED rc=$?"
echo "== bench float64: cuBLAS, step 8, step 10 at 4096 and 8192 ($(left)s left)"
timeout "$(step_timeout 30)" $PY -m bench.kernels --out "$OUT" --dtypes float64 --sizes 4096 8192 \
    --no-rect --kernels warptile simt_fp64 || echo "BENCH FAILED rc=$?"
echo "== quick tune: step 10 float64 shapes at 4096 ($(left)s left)"
timeout "$(step_timeout 25)" $PY "$SHAPES_PY" tune || echo "TUNE FAILED rc=$?"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device.log"
rm -f "$SHAPES_PY"
