#!/usr/bin/env bash
# Every GPU test and the first measurements in one call on a 4-GPU machine (64 cores), from
# the repository root after `. .whl/env.sh`:
#   GPU 0     the one-GPU tests (kernels, API, pipeline, config, precision=)
#   GPU 1, 2  the Dask and MPI tests (two GPUs where they use two)
#   GPU 3     bench/device/tensorcores.sh (build, tests and benchmark of steps 11-14; timed
#             alone on its GPU)
#   cores 48-63  the CPU study bench/studies/cpu-scaling.toml (16 cores set apart with taskset,
#             mpiexec --bind-to none inside them; the tests run on cores 0-47 meanwhile)
# then, on all four GPUs, the tests that take every GPU (distmm cluster, emulated nodes).
# Logs and records land under $OUT.
set -u
T=${T_GROUPS:-330}
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m | head -8
nproc; python3 -c "import cupy, numpy, sys; print('cupy', cupy.__version__, 'numpy', numpy.__version__, sys.version.split()[0])"
PT="python3 -m pytest -q -p no:cacheprovider -rs -m gpu"
ONE="tests/test_gpu_kernels.py tests/test_gpu_api.py tests/test_gpu_pipeline.py tests/test_gpu_config.py tests/test_precision_gpu.py"
TWO="tests/test_dask_gpu.py tests/test_dask_gpu_engine.py tests/test_dask_ipc_gpu.py tests/test_mpi_gpu.py tests/test_mpi_gpu_blocks.py tests/test_mpi_batch.py"
CUDA_VISIBLE_DEVICES=0 taskset -c 0-23 timeout $T $PT $ONE > "$OUT/pytest-one.log" 2>&1 & p1=$!
CUDA_VISIBLE_DEVICES=1,2 taskset -c 24-47 timeout $T $PT $TWO > "$OUT/pytest-two.log" 2>&1 & p2=$!
CUDA_VISIBLE_DEVICES=3 T_TESTS=200 T_BENCH=150 taskset -c 0-47 bash bench/device/tensorcores.sh \
  > "$OUT/tensorcores.log" 2>&1 & p3=$!
if [ -n "${CPU_STUDY-bench/studies/cpu-scaling.toml}" ]; then
  sed 's/"--bind-to", "core"/"--bind-to", "none"/' "${CPU_STUDY-bench/studies/cpu-scaling.toml}" \
    > /tmp/cpu-scaling.toml
  CUDA_VISIBLE_DEVICES= taskset -c 48-63 timeout $T python3 -m distmm bench /tmp/cpu-scaling.toml \
    -o "$OUT/scaling-cpu.jsonl" > "$OUT/cpu-study.log" 2>&1 & p4=$!
fi
wait $p1; echo "== one-GPU tests: exit $?"; tail -15 "$OUT/pytest-one.log"
wait $p2; echo "== Dask/MPI tests: exit $?"; tail -15 "$OUT/pytest-two.log"
wait $p3; echo "== tensor cores"; grep -v "^ok " "$OUT/tensorcores.log" | tail -40
[ -n "${p4-}" ] && { wait $p4; echo "== CPU study: exit $?"; tail -45 "$OUT/cpu-study.log" | cut -c1-300; }
echo "== 4-GPU tests ($(( ${BUDGET:-560} - SECONDS )) s left)"
timeout $(( ${BUDGET:-560} - SECONDS - 10 )) $PT tests/test_cluster_cmd_gpu.py tests/test_emulate_gpu.py \
  > "$OUT/pytest-four.log" 2>&1; echo "exit $?"; tail -25 "$OUT/pytest-four.log"
ls "$OUT"
