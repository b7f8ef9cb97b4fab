#!/usr/bin/env bash
# The tensor-core steps (11 mma TF32, 12 mma BF16/FP16, 13 wgmma BF16/FP16 with cp.async,
# 14 wgmma BF16/FP16 with TMA, 15 mma BF16/FP16 with TMA) on one GPU, in one call, from the
# repository root:
#
#   bash bench/device/tensorcores.sh
#
# 1. build: every tensor-core source with CI's nvcc commands (-arch=sm_90, sm_80) and with
#    -arch=sm_90a, ptxas's register and spill report kept ($OUT/ptxas-<file>-<arch>.txt);
# 2. compile what the tests and the benchmark use, in parallel (bench.kernels --warm-only);
#    the GPU tests of steps 11-15 (tests/test_gpu_kernels.py -k "tensor_core or kernel_for"):
#    bounds against float64, odd sizes, transposes, poisoned C, alpha/beta; and
#    precision='s executor test that runs kernel_for's choice (tests/test_precision_gpu.py);
# 3. the benchmark at 8192^3 (SIZES), each step beside cuBLAS at the same precision, in
#    alternation (ROUNDS), records under $OUT (kernels-<device>-<date>.jsonl); each step
#    also with each of TC_VARIANTS that names its parameters (space-separated
#    KEY=INT[,KEY=INT]: other tiles, more or fewer stages);
# 4. host-resident bfloat16 at 32768^3 (BF16_SIZES; none skips it) through the stream
#    pipeline against in-core cuBLAS bf16, with its timeline (bench/pipeline.py --precision bf16).
# PRECISIONS (default "tf32 bf16 fp16") limits steps 2-3 to some of them; TC_TESTS=0 skips
# the tests (a benchmark-only call), TC_FILTER replaces their -k expression.
# Steps 13, 14 (sm_90a) and 15 are compiled by nvcc at run time: without nvcc on PATH (or
# /usr/local/cuda/bin) their tests and benchmark fail, and the log says so.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/distmm-out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}
export DISTMM_CACHE_DIR=${DISTMM_CACHE_DIR:-/tmp/distmm-cache}
unset CUPY_TF32
PY=${PY:-python3}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
date -u
echo "commit ${DISTMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
command -v nvcc >/dev/null && nvcc --version | tail -1 \
  || echo "nvcc: not found (steps 13-15 cannot be built)"

echo "== build"
for cu in kernels/cuda/11_mma_tf32.cu kernels/cuda/12_mma_bf16.cu kernels/cuda/13_wgmma_bf16.cu \
    kernels/cuda/14_wgmma_tma.cu kernels/cuda/15_mma_tma.cu; do
  for arch in sm_90 sm_80 sm_90a; do
    log="$OUT/ptxas-$(basename "$cu" .cu)-$arch.txt"
    if nvcc -std=c++17 -arch=$arch -cubin -Xptxas -v -o /dev/null "$cu" > "$log" 2>&1; then
      spills=$(grep -o '[0-9]* bytes spill stores' "$log" | sort -u | tr '\n' ' ')
      echo "ok $cu $arch: $(grep -c 'spill stores' "$log") kernels, $spills"
    else
      echo "FAILED $cu $arch"; tail -5 "$log"
    fi
  done
done

echo "== compile what the tests and the benchmark use (parallel processes)"
# variants timed beside each step's defaults (bench.kernels --tc-variant; a variant
# applies to every step whose parameters it names)
read -r -a variants <<< "${TC_VARIANTS:-BN=256 BM=256 LOOP=0 WN=32}"
vargs=(); for v in "${variants[@]}"; do vargs+=(--tc-variant "$v"); done
read -r -a precisions <<< "${PRECISIONS:-tf32 bf16 fp16}"
timeout ${T_WARM:-200} $PY -m bench.kernels --precisions "${precisions[@]}" --warm-only "${vargs[@]}" 2>&1 | tail -12

echo "== GPU tests (steps 11-15)"
if [ "${TC_TESTS:-1}" = 0 ]; then echo "skipped (TC_TESTS=0)"; else
timeout ${T_TESTS:-300} $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_gpu_kernels.py \
  tests/test_precision_gpu.py -k "${TC_FILTER:-tensor_core or kernel_for or in_flight or tma}" \
  > "$OUT/pytest-tensorcores.log" 2>&1
rc=$?
tail -30 "$OUT/pytest-tensorcores.log"
echo "pytest exit $rc"
fi

echo "== benchmark"
timeout ${T_BENCH:-200} $PY -m bench.kernels --precisions "${precisions[@]}" --sizes ${SIZES:-8192} \
  --no-rect --rounds ${ROUNDS:-3} --out-dir "$OUT" "${vargs[@]}" || echo "BENCH FAILED rc=$?"

echo "== host-resident bfloat16 through the stream pipeline (bench.pipeline --precision bf16)"
[ "${BF16_SIZES:-32768}" = none ] && { echo "skipped (BF16_SIZES=none)"; ls -la "$OUT"; exit 0; }
timeout ${T_BF16:-240} $PY -m bench.pipeline --precision bf16 --sizes ${BF16_SIZES:-32768} \
  --repeat 3 --out-dir "$OUT" --timeline "$OUT/timeline-bf16.png" \
  --timeline-json "$OUT/timeline-bf16.json" || echo "BF16 PIPELINE FAILED rc=$?"
ls -la "$OUT"
