#!/usr/bin/env bash
# Check and time the float32 kernels after the no-flush (subnormal-keeping) FMA change:
# GPU tests of every float32 kernel and of the API, the subnormal check, and float32
# cuBLAS vs steps 8 and 9 at 4096/8192/16384 in one run.   . .whl/env.sh && bash bench/device_ftz.sh
. "$(dirname "$0")/device_common.sh"
log="$OUT/ftz.log"
mkdir -p "$DISTMM_CACHE_DIR" && cp bench/results/kernels-tune-cache-nvidia-h200.json "$DISTMM_CACHE_DIR/tune.json"
timeout 150 python3 -m bench.kernels --warm-only 2>&1 | tail -2 | tee "$log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_kernels.py tests/test_gpu_api.py 2>&1 | tail -4 | tee -a "$log"
timeout 60 python3 - <<'PY' 2>&1 | tee -a "$log"
import numpy as np, cupy, distmm
rng = np.random.default_rng()
a = (rng.standard_normal((64, 64)) * 1e-20).astype(np.float32)
b = (rng.standard_normal((64, 64)) * 1e-20).astype(np.float32)
ref = a @ b
for backend in ("raw", "cublas"):
    got = cupy.asnumpy(distmm.matmul(cupy.asarray(a), cupy.asarray(b), backend=backend))
    print(f"subnormals {backend:7s} nonzero {np.count_nonzero(got)}/{got.size} (numpy {np.count_nonzero(ref)}), "
          f"max|diff| {np.abs(got - ref).max():.3e}")
PY
timeout 120 python3 -m bench.kernels --dtypes float32 --sizes 4096 8192 16384 --no-rect \
  --kernels warptile dmma --out "$OUT" 2>&1 | tail -5 | tee -a "$log"
