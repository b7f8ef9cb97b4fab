#!/usr/bin/env bash
# The batch-job runs (benchmark mpi-batch) on a GPU machine, from the repository root, after
# `. .whl/env.sh`: what starting MPI costs, the GPU tests of the striped path, the write paths
# of this disk (bench/research/write_paths.py), then `mpirun -n P distmm matmul` at fp32 32768
# (P = 2, 4; one process with the local engine and with the MPI engine; zarr and HDF5 outputs
# at P = 4; P = 2, 4 with batch-panels share, label "-share"; and P = 1, 4 again with direct
# writes off, label "-buffered") and 65536 (P = 2, 4
# and one process), each beside cat, dd conv=fsync and in-core cuBLAS measured in the same run.
# Records and profiles land under $OUT. SIZES_BIG= (empty) skips 65536.
set -u
export OMPI_MCA_btl=${OMPI_MCA_btl-^ofi}
. "$(dirname "$0")/prelude.sh"
W=/tmp/distmm-batch
echo "== launch: one process importing mpi4py (MPI_Init), and mpiexec -n 4 of the same"
(time python3 -c "from mpi4py import MPI") 2>&1 | grep real
(time mpiexec --oversubscribe --bind-to none -n 4 python3 -c \
  "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()") 2>&1 | grep real
echo "== GPU tests of the striped path, and the direct writes"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_mpi_batch.py \
  tests/test_direct_io.py -k "gpu or direct or whole_rows" 2>&1 | tail -4
echo "== write paths, 4 GiB fsync'd"
timeout 90 python3 -m bench.research.write_paths --gib 4 --procs 4 --dir /tmp --repeat 2 \
  --ways pwrite-1 pwrite direct direct-1 span span-1 2>&1 | tail -8
echo "== fp32 32768"
timeout 200 python3 -m bench.mpi_batch --sizes 32768 --ranks 2 4 --repeat 3 --formats zarr h5 \
  --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
DISTMM_BATCH_PANELS=share timeout 100 python3 -m bench.mpi_batch --sizes 32768 --ranks 2 4 \
  --no-cli --repeat 3 --label=-share --gemm-repeat 1 --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
DISTMM_DIRECT_WRITES=false timeout 100 python3 -m bench.mpi_batch --sizes 32768 --ranks 4 \
  --repeat 2 --label=-buffered --gemm-repeat 1 --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
rm -rf $W
if [ -n "${SIZES_BIG-65536}" ]; then
  echo "== fp32 ${SIZES_BIG-65536}"
  timeout 200 python3 -m bench.mpi_batch --sizes ${SIZES_BIG-65536} --ranks 2 4 --repeat 1 \
    --gemm-repeat 1 --work $W --out-dir "$OUT" 2>&1 | cut -c1-400
  rm -rf $W
fi
ls -la "$OUT"
