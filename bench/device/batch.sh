#!/usr/bin/env bash
# The batch-job runs (benchmark mpi-batch) on a GPU machine, from the repository root, after
# `. .whl/env.sh`: what starting MPI costs, a smoke product, the GPU tests of the striped path,
# then `mpirun -n P distmm matmul` at fp32 32768 (P = 2, 4; one process with the local engine
# and with the MPI engine; zarr and HDF5 outputs at P = 4) and 65536 (P = 2, 4 and one
# process), each beside cat, dd conv=fsync and in-core cuBLAS measured in the same run.
# Records and profiles land under $OUT. SIZES_BIG= (empty) skips 65536.
set -u
OUT=${OUT:-/tmp/distmm-out}
export NCCL_NVLS_ENABLE=0
W=/tmp/distmm-batch
echo "== launch: one process importing mpi4py (MPI_Init), and mpiexec -n 4 of the same"
(time python3 -c "from mpi4py import MPI") 2>&1 | grep real
(time mpiexec --oversubscribe --bind-to none -n 4 python3 -c \
  "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()") 2>&1 | grep real
echo "== smoke: 2 ranks, fp32 4096, panels read from the files"
mkdir -p $W/smoke
python3 -c "import numpy as np; r=np.random.default_rng(0); [np.save(f'$W/smoke/{x}.npy', r.standard_normal((4096, 4096), dtype=np.float32)) for x in 'ab']"
if ! timeout 90 mpiexec --oversubscribe --bind-to none -n 2 python3 -m distmm matmul $W/smoke/a.npy \
    $W/smoke/b.npy -o $W/smoke/c.npy --backend cublas; then
  echo "SMOKE FAILED: the runs below broadcast panels instead"; export DISTMM_BATCH_PANELS=broadcast
fi
echo "== GPU tests of the striped path"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mpi_batch.py 2>&1 | tail -4
echo "== fp32 32768"
timeout 220 python3 -m bench.mpi_batch --sizes 32768 --ranks 2 4 --repeat 3 --formats zarr h5 \
  --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
rm -rf $W
if [ -n "${SIZES_BIG-65536}" ]; then
  echo "== fp32 ${SIZES_BIG-65536}"
  timeout 250 python3 -m bench.mpi_batch --sizes ${SIZES_BIG-65536} --ranks 2 4 --repeat 1 \
    --gemm-repeat 1 --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
  rm -rf $W
fi
