#!/usr/bin/env bash
# precision= on one GPU, from the repository root, after `. .whl/env.sh` (ml_dtypes among the
# wheels): the GPU tests of the reduced modes (cuBLAS per mode, the device rounding against
# the CPU emulation, cupy operands, the stream pipeline, gemm, and the registry's tensor-core
# kernels where it lists one for the mode), then the CPU tests of the same modes as a check
# that the emulation and the device agree on this checkout.
set -u
echo "== GPU tests of precision="
timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_precision_gpu.py 2>&1 \
  | tail -40
echo "== CPU emulation"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_precision.py -k "not mpi and not dask" \
  2>&1 | tail -5
