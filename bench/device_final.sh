#!/usr/bin/env bash
# The lead's integration call on a GPU machine: every GPU test, the SIMT fp64 step's
# check and timing, the traced pipeline CLI, and a subnormal check of the raw kernels.
# Run from the repo root:  . .whl/env.sh && bash bench/device_final.sh
# Writes under $OUT: final.log, pytest.log, trace-8192.png, plus what device_simt64.sh writes.
. "$(dirname "$0")/device_common.sh"
log="$OUT/final.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -m distmm info
} 2>&1 | tee "$log"

echo "== warm: compile the kernels in parallel" | tee -a "$log"
timeout 150 python3 -m bench.kernels --warm-only 2>&1 | tail -3 | tee -a "$log"

echo "== GPU tests" | tee -a "$log"
timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
  tests/test_gpu_api.py tests/test_gpu_kernels.py tests/test_gpu_pipeline.py tests/test_dask_gpu.py \
  2>&1 | tee "$OUT/pytest.log" | tail -25 | tee -a "$log"
echo "pytest exit ${PIPESTATUS[0]}" | tee -a "$log"

if [ -f bench/device_simt64.sh ] && [ -z "$SKIP_SIMT" ]; then
  echo "== SIMT fp64 step" | tee -a "$log"
  timeout ${T_SIMT:-170} bash bench/device_simt64.sh 2>&1 | tail -30 | tee -a "$log"
fi

echo "== distmm trace (traced pipelined run through the CLI)" | tee -a "$log"
timeout 90 python3 -m distmm trace --n 8192 --dtype float32 -o "$OUT/trace-8192.png" 2>&1 | tail -5 | tee -a "$log"

echo "== distmm demo on the local engine (auto: GPU pipeline for a large float product)" | tee -a "$log"
timeout 90 python3 -m distmm demo -n 4096 --engine local 2>&1 | tail -3 | tee -a "$log"

echo "== subnormals: raw float32 kernels vs cuBLAS vs numpy" | tee -a "$log"
timeout 60 python3 - <<'PY' 2>&1 | tee -a "$log"
import numpy as np, cupy, distmm
rng = np.random.default_rng()
a = (rng.standard_normal((64, 64)) * 1e-20).astype(np.float32)
b = (rng.standard_normal((64, 64)) * 1e-20).astype(np.float32)   # products ~1e-40: subnormal
ref = a @ b
for backend in ("raw", "cublas"):
    got = cupy.asnumpy(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend))
    print(f"{backend:7s} nonzero {np.count_nonzero(got)}/{got.size} (numpy {np.count_nonzero(ref)}), "
          f"max|diff| {np.abs(got - ref).max():.3e}")
PY
date -u | tee -a "$log"
