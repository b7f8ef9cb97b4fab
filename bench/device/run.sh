#!/usr/bin/env bash
# One runner for every GPU workload of distmm; from the repository root of a GPU machine:
#
#   bash bench/device/run.sh WORKLOAD [WORKLOAD ...]
#
# Workloads, run in the order given, each under its own timeout within BUDGET seconds:
#   info      the GPU, driver, cupy/numpy/python versions, `python -m distmm info`
#   warm      compile every kernel the GPU tests and benchmarks use, in parallel
#   tests     the GPU tests (pytest -m gpu; TESTS overrides the files)
#   kernels   benchmark `kernels`: every CUDA step and cuBLAS (KERNELS_ARGS), then its table and plots
#   ratios    benchmark `kernels`, the headline ratios: float32 steps 8/9 and float64 steps
#             8/9/10 against cuBLAS at 4096/8192/16384, timed in alternation (ROUNDS rounds)
#   tune      `distmm tune` for float32 and float64, with records; copies the tune cache out
#   pipeline  benchmark `pipeline`: host-resident products against in-core cuBLAS, with a
#             timeline (SIZES, DTYPES, REPEAT)
#   overhead  benchmark `api-overhead`: distmm.matmul on cupy operands against cupy.matmul
#   firstcall benchmark `pipeline`, variants first-call and steady: one fresh process per size
#             and dtype (SIZES, default 32768), in-core cuBLAS in the same process
#   mpi       benchmark `mpi` (MPI_MODES, default "gpu cpu16"; each mode gets what is left of
#             BUDGET, so run one mode per call): gpu = 1 rank fp32/fp64 32768 against in-core
#             cuBLAS, 2 ranks sharing one GPU at fp32 16384, 2 ranks on 2 GPUs at fp32 32768
#             when 2 are visible, each beside nvmath-python's distributed matmul (cuBLASMp
#             over NCCL) at the one-GPU-per-rank cases where .whl/nvmath/ holds its wheels
#             (installed into /tmp/nvmath-site, on its ranks' PYTHONPATH only); cpu16 = 16,
#             8, 4, 2, 1 CPU ranks at fp64 16384 against numpy's 16-thread BLAS (pylops-mpi
#             at 16 and 4 where it imports); heat beside both modes where .whl/heat/ holds it
#             (installed --no-deps into /tmp/heat-site, on its ranks' PYTHONPATH only)
#   daskgpu   benchmark `dask-gpu`: distmm-dask, dask.array (chunks 8192, 4096) and in-core cuBLAS
#             on dask-cuda clusters (DASKGPU_SETTINGS, default "1gpu shared mixed"; 2gpu needs
#             two GPUs), fp32/fp64 at 16384/32768 (SIZES, DTYPES, ROUNDS default 3)
#   smoke     the traced pipeline through `distmm trace`, `distmm demo` on the local engine and
#             on a LocalCUDACluster (its GPU figure beside cuBLAS)
#   profile   ncu of the best kernel (float32, float64) at 4096, and its SASS hot loop
#   close     info warm tests smoke ratios (a session's closing call)
#
# The offline bundle these workloads need (zarr for the I/O tests, pylops-mpi for the mpi peers):
#   bash ../shared/gpu-node/wheels.sh zarr==3.1.6 numcodecs donfig crc32c google-crc32c \
#        pylops-mpi==0.8.0 pylops pyproximal
# and, for the mpi workload's nvmath-python peer, its wheels in their own folder (42 MB; the
# bundle ~53 MB): nvmath 0.8 with cuBLASMp 0.7, the pair that runs on the node's NCCL 2.28
# (with the image's NVSHMEM); cuda-core 0.7 because nvmath 0.8 declares cuda-core < 1. So that
# they never shadow what cupy and numba-cuda use in the other workloads, run_mpi installs
# them apart and only nvmath's ranks see them:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform any -d .whl/nvmath \
#     nvmath-python==0.8.0 nvidia-cublasmp-cu13==0.7.0.125 cuda-core==0.7.0
# and, for its heat peer, heat 1.8.0 alone (0.5 MB; it declares torch<2.11.1, so it is
# installed --no-deps into /tmp/heat-site against the node's torch; add scipy and the
# torchvision built for that torch only if the node lacks them: `import heat` needs both):
#   python3 -m pip download -q --no-deps -d .whl/heat heat==1.8.0
# GPU runs over UCX carry their own bundle instead, .whlu/ (bench/device/ucx_bundle.sh: the Dask
# wheels and distributed-ucxx with its UCX libraries, ~55 MB, no MPI or peer wheels): begin
# `. .whlu/env.sh && ` and run e.g. DASKGPU_ARGS="--protocol ucx" ... daskgpu.
# Why these versions (bench/NOTES.md, MPI engine): nvmath 1.0 takes cuBLASMp >=0.8.1,<0.10,
# and every cuBLASMp >= 0.8 needs NCCL >= 2.29.2 (ncclCommQueryProperties): against the
# node's NCCL 2.28 it fails to load (nvmath_peer.load says so), and nvidia-nccl-cu13 2.29.2
# is a 201 MB wheel. cuBLASMp 0.7 needs libnvshmem_host.so.3, which the GPU image has.
#
# Everything lands under $OUT (default /tmp/distmm-out): <workload>.log, the records
# (<benchmark>-<device>-<date>.jsonl), plots. Always set DISTMM_COMMIT to the local HEAD: a
# lent machine's copy may carry a stale .git (seen: records stamped with an older commit).
# Research probes (bench/research/) are run directly: python -m bench.research.<name> --help.
[ $# -gt 0 ] || { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2; }
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/distmm-out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}
export DISTMM_CACHE_DIR=${DISTMM_CACHE_DIR:-/tmp/distmm-cache}
unset CUPY_TF32   # the cuBLAS float32 reference is IEEE SGEMM, never TF32
BUDGET=${BUDGET:-570}
PY=${PY:-python3}
left() { echo $(( BUDGET - SECONDS )); }
# a step's timeout: what it wants, or what is left of the budget (at least 5 s)
step() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }
gpu_state() { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv; }
GPU_TESTS="tests/test_gpu_api.py tests/test_gpu_kernels.py tests/test_gpu_pipeline.py tests/test_dask_gpu.py tests/test_dask_gpu_engine.py tests/test_gpu_config.py tests/test_mpi_gpu.py"

run_info() {
  date -u
  echo "commit ${DISTMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  gpu_state
  $PY -c "import cupy, numpy, os, sys; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__, 'python', sys.version.split()[0], 'cpus', len(os.sched_getaffinity(0)))"
  command -v nvcc >/dev/null && nvcc --version | tail -1
  $PY -m distmm info
}

run_warm() {
  timeout "$(step 150)" $PY -m bench.kernels --warm-only 2>&1 | tail -3
}

run_tests() {
  timeout "$(step ${T_TESTS:-300})" $PY -m pytest -q -p no:cacheprovider -rs -m gpu ${TESTS:-$GPU_TESTS} \
    > "$OUT/pytest.log" 2>&1
  local rc=$?
  tail -25 "$OUT/pytest.log"
  echo "pytest exit $rc"
}

run_kernels() {
  timeout "$(step 260)" $PY -m bench.kernels --out-dir "$OUT" ${KERNELS_ARGS:-} || echo "BENCH FAILED rc=$?"
  timeout "$(step 40)" $PY -m bench.plot_kernels "$OUT"/kernels-*.jsonl --out "$OUT" || echo "PLOT FAILED rc=$?"
}

run_ratios() {
  local rounds=${ROUNDS:-5}
  timeout "$(step 150)" $PY -m bench.kernels --out-dir "$OUT" --rounds "$rounds" --dtypes float32 \
    --sizes 4096 8192 16384 --no-rect --kernels warptile dmma || echo "BENCH FAILED rc=$?"
  timeout "$(step 150)" $PY -m bench.kernels --out-dir "$OUT" --rounds "$rounds" --dtypes float64 \
    --sizes 4096 8192 16384 --no-rect --kernels warptile dmma simt_fp64 || echo "BENCH FAILED rc=$?"
}

run_tune() {
  timeout "$(step 130)" $PY -m distmm tune --dtype float32 float64 --size 4096 --confirm-size 8192 \
    --records "$OUT" || echo "TUNE FAILED rc=$?"
  cp "$DISTMM_CACHE_DIR/tune.json" "$OUT/tune.json" 2>/dev/null
}

run_pipeline() {
  timeout "$(step ${T_BENCH:-330})" $PY -m bench.pipeline --probe --sizes ${SIZES:-16384 32768} \
    --dtypes ${DTYPES:-float32 float64} --repeat ${REPEAT:-3} --out-dir "$OUT" \
    --timeline "$OUT/timeline.png" --timeline-json "$OUT/timeline.json" \
    --timeline-n 32768 --timeline-dtype float32 || echo "BENCH FAILED rc=$?"
}

run_overhead() {
  timeout "$(step 150)" $PY -m bench.api_overhead gpu --out-dir "$OUT" || echo "BENCH FAILED rc=$?"
}

run_firstcall() {
  timeout "$(step 240)" $PY -m bench.pipeline --first-call --sizes ${SIZES:-32768} \
    --dtypes ${DTYPES:-float32 float64} --warmup --out-dir "$OUT" || echo "BENCH FAILED rc=$?"
}

run_mpi() {
  local mode nvm=()
  if ls .whl/nvmath/*.whl >/dev/null 2>&1; then  # nvmath-python's wheels, apart from /tmp/site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/nvmath-site .whl/nvmath/*.whl && nvm=(--nvmath-site /tmp/nvmath-site) \
      || echo "nvmath-python wheels: install failed"
  fi
  if ls .whl/heat/*.whl >/dev/null 2>&1; then  # heat --no-deps, against the node's own torch
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/heat-site .whl/heat/*.whl && nvm+=(--heat-site /tmp/heat-site) \
      || echo "heat wheels: install failed"
  fi
  for mode in ${MPI_MODES:-gpu cpu16}; do
    timeout "$(step ${T_MPI:-$(left)})" $PY -m bench.mpi --mode "$mode" --out-dir "$OUT" "${nvm[@]}" \
      ${MPI_ARGS:-} || echo "BENCH FAILED ($mode) rc=$?"
  done
}

run_daskgpu() {
  timeout "$(step ${T_BENCH:-540})" $PY -m bench.dask_gpu --settings ${DASKGPU_SETTINGS:-1gpu shared mixed} ${DASKGPU_ARGS:-} \
    --sizes ${SIZES:-16384 32768} --dtypes ${DTYPES:-float32 float64} --rounds ${ROUNDS:-3} \
    --out-dir "$OUT" || echo "BENCH FAILED rc=$?"
}

run_smoke() {
  timeout "$(step 90)" $PY -m distmm trace --n 8192 --dtype float32 -o "$OUT/trace-8192.png" 2>&1 | tail -5
  timeout "$(step 90)" $PY -m distmm demo -n 4096 --engine local 2>&1 | tail -3
  timeout "$(step 120)" $PY -m distmm demo -n 8192 --dtype float32 2>&1 | grep -E "LocalCUDACluster|LocalCluster|dask engine|cuBLAS|relative error"
}

run_profile() {
  if command -v ncu >/dev/null; then
    for dt in float32 float64; do
      echo "-- ncu: best kernel, $dt, n=4096"
      timeout "$(step 60)" ncu --clock-control none --kernel-name regex:distmm_gemm \
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables $PY -m bench.kernels --profile $dt 4096 \
        2>&1 | grep -vE "^==PROF==|^\s*$" | tail -120 || echo "NCU FAILED rc=$?"
    done
  else
    echo "ncu not found: profile skipped"
  fi
  timeout "$(step 60)" $PY -m bench.research.sass_hot_loop --dtype float32 > "$OUT/sass.txt" 2>&1 \
    && grep -A8 "== hot loop 0x" "$OUT/sass.txt" | head -10 || echo "SASS FAILED rc=$?"
}

set -- $(for w in "$@"; do [ "$w" = close ] && echo info warm tests smoke ratios || echo "$w"; done)
for w in "$@"; do
  declare -F "run_$w" >/dev/null || { echo "run.sh: unknown workload '$w' (see bench/device/run.sh's header)" >&2; exit 2; }
done
# the offline bundle, once the workloads are known to exist
[ -f .whl/env.sh ] && { . .whl/env.sh || exit 1; }
mkdir -p "$OUT"
# A pip install byte-compiles the package; this copy of the checkout was never run: without
# this, a fresh process's first product also paid compiling distmm's modules (~0.05 s).
$PY -m compileall -q distmm > /dev/null 2>&1
for w in "$@"; do
  echo "== $w ($(left)s left)"
  "run_$w" 2>&1 | tee "$OUT/$w.log"
done
gpu_state
echo "== done in ${SECONDS}s"
