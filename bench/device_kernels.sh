#!/bin/bash
# The one device script of issue 4: build, check, tune and time distmm's CUDA kernels.
# Run from the repository root on a GPU machine:  . .whl/env.sh && bash bench/device_kernels.sh
# Writes at most 8 files under $OUT (default /tmp/distmm-out): device.log, sass.txt,
# tune.json, tune-*.jsonl, kernels-*.jsonl, kernels-table-*.md and two PNGs.
# STEPS (default "warm test tune bench plot") picks the parts to run; every step has its
# own timeout so the whole script ends within BUDGET seconds (default 570).
BUDGET=${BUDGET:-570}
. "$(dirname "$0")/device_common.sh"
STEPS=${STEPS:-"warm test tune bench plot profile"}
has() { [[ " $STEPS " == *" $1 "* ]]; }

{
echo "== $(date -u +%FT%TZ) device_kernels.sh: steps: $STEPS; budget ${BUDGET}s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
$PY -c "import cupy, numpy, sys; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__, 'python', sys.version.split()[0])"
nvcc --version | tail -1
nproc

# SASS of the float32 warptile kernel (default config, NN): instruction mix of the hot loop.
( tmp=$(mktemp -d) && $PY - "$tmp" <<'PYEOF'
import sys, distmm.registry as r
from distmm.executor import cuda_loader as L
s = r.best_kernel(); p = s.params("float32")
e = s.name_expression("float32", p, False, False)
open(sys.argv[1] + "/k.cu", "w").write(L.source(s.file) + L._explicit_instantiation(e, "float"))
PYEOF
  nvcc -std=c++17 -DDISTMM_NVRTC -arch=sm_90 -cubin -Xptxas -v -o "$tmp/k.cubin" "$tmp/k.cu" > "$OUT/sass.txt" 2>&1
  cuobjdump -sass "$tmp/k.cubin" > "$tmp/k.sass" 2>&1
  $PY - "$tmp/k.sass" >> "$OUT/sass.txt" <<'PYEOF'
import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []
for ln in lines:
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
def op(t):
    t = re.sub(r"^@!?U?P\w+\s+", "", t)
    return t.split()[0] if t else "?"
print("== instruction histogram (whole kernel)")
for k, v in collections.Counter(op(t) for _, t in ins).most_common(25):
    print(f"{v:7d} {k}")
best = None
for i, (addr, t) in enumerate(ins):
    m = re.search(r"BRA\s+(?:`?\(?\.?L?_?x?_?)?0x([0-9a-f]+)", t)
    if m and int(m.group(1), 16) < addr:
        body = [x for a, x in ins if int(m.group(1), 16) <= a <= addr]
        n = sum(op(x) == "FFMA" for x in body)
        if best is None or n > best[0]:
            best = (n, int(m.group(1), 16), addr, body)
if best:
    n, lo, hi, body = best
    print(f"== hot loop 0x{lo:x}..0x{hi:x}: {len(body)} instructions, {n} FFMA "
          f"({100 * n / len(body):.1f}%)")
    for k, v in collections.Counter(op(x) for x in body).most_common(25):
        print(f"{v:7d} {k}")
    print("== hot loop listing (first 250)")
    print("\n".join(body[:250]))
PYEOF
) &
SASS_PID=$!

if has warm; then
  echo "== warm: compile every kernel the tests and benchmark use ($(left)s left)"
  timeout "$(step_timeout 150)" $PY -m bench.kernels --warm-only || echo "WARM FAILED rc=$?"
fi
if has test; then
  echo "== tests: pytest -m gpu ($(left)s left)"
  timeout "$(step_timeout 200)" $PY -m pytest -m gpu -q -p no:cacheprovider -rf --timeout 120 \
      ${TESTS:-tests/test_gpu_kernels.py tests/test_gpu_api.py} 2>&1 | tail -60 || echo "TESTS FAILED rc=$?"
fi
if has tune; then
  echo "== tune ($(left)s left)"
  timeout "$(step_timeout 130)" $PY -m distmm.tune --dtype float32 float64 --size 4096 \
      --confirm-size 8192 --records "$OUT" || echo "TUNE FAILED rc=$?"
  cp "$DISTMM_CACHE_DIR/tune.json" "$OUT/tune.json" 2>/dev/null
fi
if has bench; then
  echo "== bench ($(left)s left)"
  timeout "$(step_timeout 260)" $PY -m bench.kernels --out "$OUT" ${BENCH_ARGS:-} || echo "BENCH FAILED rc=$?"
fi
if has plot; then
  echo "== plot ($(left)s left)"
  timeout "$(step_timeout 40)" $PY -m bench.plot_kernels "$OUT"/kernels-*.jsonl --out "$OUT" || echo "PLOT FAILED rc=$?"
fi
if has profile && command -v ncu >/dev/null; then
  for dt in float32 float64; do
    echo "== ncu: best kernel, $dt, n=4096 ($(left)s left)"
    timeout "$(step_timeout 60)" ncu --clock-control none --kernel-name regex:distmm_gemm \
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables $PY -m bench.kernels --profile $dt 4096 \
        2>&1 | grep -vE "^==PROF==|^\s*$" | tail -120 || echo "NCU FAILED rc=$?"
  done
fi
wait $SASS_PID
grep -A8 "== hot loop 0x" "$OUT/sass.txt" | head -10
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv
echo "== done in ${SECONDS}s"
} 2>&1 | tee "$OUT/device.log"
