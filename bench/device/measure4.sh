#!/usr/bin/env bash
# The GPU tests and the open measurements on a 4-GPU host (64 cores), in phases named on the
# command line, from the repository root after `. .whl/env.sh`:
#   bash bench/device/measure4.sh tests trace      # one call (~8 min)
#   bash bench/device/measure4.sh batch            # the next (~8 min)
# tests  in parallel, each on its own GPU and cores:
#          GPU 0     the one-GPU tests (API, pipeline, config, precision=), then the first-call
#                    benchmark at 32768 (fp64, fp32; bench/pipeline.py --first-call)
#          GPUs 1,2  the MPI and Dask GPU tests (two GPUs where they use two)
#          GPU 3     bench/device/tensorcores.sh (steps 11-14: build, tests, variants, bf16
#                    through the stream pipeline)
# quick  the GPU tests of the latest changes (streams, the driver under IPC, step 14), in
#        parallel on GPU 0, GPUs 1-2 and GPU 3
# emulated  4 GPUs as 2 emulated nodes, both engines (bench/studies/gpu-emulated.toml), with
#        mpiexec's own binding (distmm widens a GPU rank's one core: mpi-cpus)
# dask4  the Dask engine's 4-GPU rows (bench/studies/gpu-dask-4.toml) and the fp32 trace
# firstcall  the Dask engine's first call on 4 GPUs: threads sampled, dispatch times, trace; the
#        machine's first run (cold kernel caches), then a second process
# pieces the Dask rows three ways: the default (float32: whole k), pieces of 16384, of one chunk
# leads  gemm_k's schedules, the NCCL/IPC GPU tests, ipc_reopen, the fp32 trace (one call)
# gemmk  one block's GEMM as one k and in k pieces on one GPU (bench/research/gemm_k.py)
# emutrace  the Dask engine across 2 emulated nodes at 32768, traced per block task
#        (bench/research/dask_stream.py --nodes 2)
# emudask  the Dask engine across 2 emulated nodes at 32768 (gpu-emulated-dask.toml), with
#        the stacks of a stand-still (bench/research/dask_stall.py)
# nccl   the Dask GPU tests of device chunks between emulated nodes through NCCL and of CUDA
#        IPC (tests/test_emulate_gpu.py, tests/test_dask_ipc_gpu.py)
# summa  the MPI engine's broadcasts and GEMMs per panel (bench/research/summa_trace.py) on
#        4 GPUs as one host and as 2 emulated nodes
# dasktests  the Dask GPU tests on GPUs 0,1 (two GPUs where they use two)
# trace  the Dask engine on all 4 GPUs at 32768 (TRACE_DTYPES, default fp32 then fp64), chunks
#        8192, traced per block task (bench/research/dask_stream.py --trace; logs under $OUT)
# batch  `mpirun -n P distmm matmul` at fp32 32768 (P = 1 two ways, 2, 4; repeat 3) and 65536
#        (P = 1, 2, 4; repeat 1), each beside cat, dd conv=fsync and in-core cuBLAS measured in
#        the same run (bench/mpi_batch.py)
# dask   the study bench/studies/gpu-dask.toml (1, 2, 4 GPUs against cuBLAS in the same run)
# tf32   the study bench/studies/gpu-tf32.toml (both engines on 2 and 4 GPUs at TF32, cuBLAS
#        TF32 in the same run)
# Logs and records land under $OUT.
set -u
export OMPI_MCA_btl=${OMPI_MCA_btl-^ofi}
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | uniq -c
PT="python3 -m pytest -q -p no:cacheprovider -rs -m gpu"
for phase in "$@"; do
  echo "== $phase ($SECONDS s)"
  case $phase in
    tests)
      ONE="tests/test_gpu_api.py tests/test_gpu_pipeline.py tests/test_gpu_config.py tests/test_precision_gpu.py"
      TWO="tests/test_mpi_gpu.py tests/test_mpi_gpu_blocks.py tests/test_mpi_batch.py tests/test_dask_gpu.py tests/test_dask_gpu_engine.py tests/test_dask_ipc_gpu.py"
      ( CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout ${T_ONE:-200} $PT $ONE > "$OUT/pytest-one.log" 2>&1
        echo "one-GPU tests exit $?" >> "$OUT/pytest-one.log"
        CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout ${T_FIRST:-150} python3 -m bench.pipeline \
          --first-call --sizes 32768 --dtypes float64 float32 --steady 2 --out-dir "$OUT" \
          > "$OUT/firstcall.log" 2>&1 ) & p1=$!
      CUDA_VISIBLE_DEVICES=1,2 taskset -c 16-47 timeout ${T_TWO:-330} $PT $TWO > "$OUT/pytest-two.log" 2>&1 & p2=$!
      CUDA_VISIBLE_DEVICES=3 T_TESTS=150 T_BENCH=120 T_BF16=120 taskset -c 48-63 \
        bash bench/device/tensorcores.sh > "$OUT/tensorcores.log" 2>&1 & p3=$!
      wait $p1; tail -6 "$OUT/pytest-one.log"; grep -v DEBUG "$OUT/firstcall.log" | tail -8
      wait $p2; echo "MPI/Dask tests exit $?"; tail -12 "$OUT/pytest-two.log"
      wait $p3; grep -v "^ok " "$OUT/tensorcores.log" | tail -45 ;;
    quick)
      # the GPU tests of what changed since they last ran on a device: streams at the greatest
      # priority, the driver's entry points under CUDA IPC, step 14's tensor maps, the Dask
      # worker probe's warm-up thread and the block k loop (the IPC tests on GPUs 1-2)
      ( CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout ${T_Q0:-240} $PT tests/test_streams.py \
          tests/test_driver.py tests/test_gpu_kernels.py -k "${Q0_K:-streams or driver or wgmma_tma or tma_step}" \
          > "$OUT/pytest-q0.log" 2>&1; echo "exit $?" >> "$OUT/pytest-q0.log"
        CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout 200 $PT tests/test_dask_gpu_engine.py -k probe \
          >> "$OUT/pytest-q0.log" 2>&1; echo "exit $?" >> "$OUT/pytest-q0.log" ) & q0=$!
      ( CUDA_VISIBLE_DEVICES=1,2 taskset -c 16-47 timeout ${T_Q1:-300} $PT tests/test_dask_ipc_gpu.py \
          tests/test_mpi_gpu.py tests/test_mpi_batch.py tests/test_mpi_cpus.py \
          > "$OUT/pytest-q1.log" 2>&1
        echo "exit $?" >> "$OUT/pytest-q1.log" ) & q1=$!
      if [ -n "${Q3-}" ]; then  # the Dask GPU engine's own tests (~5 minutes): Q3=1
        ( CUDA_VISIBLE_DEVICES=3 taskset -c 48-63 timeout ${T_Q3:-300} $PT tests/test_dask_gpu_engine.py \
            tests/test_dask_gpu.py > "$OUT/pytest-q3.log" 2>&1; echo "exit $?" >> "$OUT/pytest-q3.log" ) & q3=$!
      fi
      wait $q0 $q1; [ -n "${q3-}" ] && wait $q3
      for f in q0 q1 ${q3:+q3}; do echo "-- $f"; grep -v "^\s*$" "$OUT/pytest-$f.log" | tail -6; done ;;
    emulated)
      # 4 GPUs as 2 emulated nodes, fp32 65536, both engines and the all-links MPI series
      # (bench/studies/gpu-emulated.toml), launched with mpiexec's own binding (one core a
      # rank, which distmm widens for GPU ranks: mpi-cpus), cuBLAS in the same run
      timeout ${T_EMU:-420} python3 -m distmm bench bench/studies/gpu-emulated.toml \
        -o "$OUT/gpu-emulated.jsonl" 2>&1 | cut -c1-300 | grep -v "^\s*$" | tail -10 ;;
    nccl)
      timeout ${T_NCCLTESTS:-240} $PT tests/test_emulate_gpu.py tests/test_dask_ipc_gpu.py \
        -k "not nccl_carries" > "$OUT/pytest-nccl.log" 2>&1
      echo "NCCL/IPC tests exit $?"; grep -v "^\s*$" "$OUT/pytest-nccl.log" | tail -30 ;;
    emutrace)
      # the Dask engine across 2 emulated nodes at fp32 32768, traced per block task: when
      # each k piece's copies ran (a copy of a chunk from the other node waits for its NCCL
      # receive) beside the GEMMs (bench/research/dask_stream.py --nodes 2 --trace)
      timeout ${T_EMUTRACE:-150} python3 -m bench.research.dask_stream --setting 4gpu --nodes 2 \
        --sizes 32768 --dtype float32 --calls 2 --trace > "$OUT/trace-emulated.log" 2>&1
      grep -v "CancelledError\|state_machine - WARNING" "$OUT/trace-emulated.log" \
        | cut -c1-330 | grep "^== \|client steps\|pieces:" | head -12 ;;
    emudask)
      # the Dask engine alone across 2 emulated nodes at fp32 32768
      # (bench/studies/gpu-emulated-dask.toml); if it stands still, every thread's stack
      # (bench/research/dask_stall.py, 16384^2)
      timeout ${T_EMUDASK:-240} python3 -m distmm bench bench/studies/gpu-emulated-dask.toml \
        -o "$OUT/gpu-emulated-dask.jsonl" 2>&1 | cut -c1-300 | grep "^\[\|error" | tail -4
      grep -q distmm-dask "$OUT/gpu-emulated-dask.jsonl" 2>/dev/null || timeout 120 python3 -m \
        bench.research.dask_stall --gpus 4 --nodes 2 --size 16384 --chunk 4096 --deadline 40 \
        --calls 1 2>&1 | cut -c1-400 \
        | grep -v "WARNING\|warn" | tail -60 ;;
    dask4)
      # the Dask engine's 4-GPU rows (bench/studies/gpu-dask-4.toml), then the fp32 trace's
      # first and warm calls (the first GEMM of each worker against the others); DASK4_TAG
      # names the files (a run with DASK_DISTMM_DEBUG__LATER_PIECE_K set beside the default)
      timeout ${T_DASK4:-200} python3 -m distmm bench bench/studies/gpu-dask-4.toml \
        -o "$OUT/gpu-dask-4${DASK4_TAG-}.jsonl" 2>&1 | cut -c1-300 | grep "^\[" | tail -6
      [ -n "${DASK4_NO_TRACE-}" ] && continue
      timeout ${T_TRACE:-110} python3 -m bench.research.dask_stream --setting 4gpu --sizes 32768 \
        --dtype float32 --calls 2 --trace > "$OUT/trace-4gpu-float32${DASK4_TAG-}.log" 2>&1
      grep -v "CancelledError\|state_machine - WARNING" "$OUT/trace-4gpu-float32${DASK4_TAG-}.log" \
        | cut -c1-330 | grep "^== \|client steps\|pieces:" | head -12 ;;
    leads)
      # the thirteenth session's leads, in one call: a block's GEMM schedules on GPU 0 (gemm_k,
      # first pieces of one and two chunks) beside the NCCL/IPC GPU tests on GPUs 2-3; then
      # mapping an IPC export again after it was ended (bench/research/ipc_reopen.py, GPUs
      # 0-1); then the Dask engine's fp32 trace on 4 GPUs with the scheduler's dispatch times
      CUDA_VISIBLE_DEVICES=0 timeout ${T_GEMMK:-150} python3 -m bench.research.gemm_k \
        > "$OUT/gemm-k.log" 2>&1 & g=$!
      CUDA_VISIBLE_DEVICES=2,3 timeout ${T_NCCLTESTS:-240} $PT tests/test_emulate_gpu.py \
        tests/test_dask_ipc_gpu.py -k "not nccl_carries" > "$OUT/pytest-nccl.log" 2>&1 & t=$!
      wait $g; echo "gemm_k exit $?"; tail -20 "$OUT/gemm-k.log"
      timeout 120 python3 -m bench.research.ipc_reopen > "$OUT/ipc-reopen.log" 2>&1
      echo "ipc_reopen exit $?"; tail -20 "$OUT/ipc-reopen.log"
      wait $t; echo "NCCL/IPC tests exit $?"; grep -v "^\s*$" "$OUT/pytest-nccl.log" | tail -8
      timeout ${T_TRACE:-150} python3 -m bench.research.dask_stream --setting 4gpu --sizes 32768 \
        --dtype float32 --calls 3 --trace > "$OUT/trace-4gpu-float32.log" 2>&1
      echo "trace exit $?"
      grep -v "CancelledError\|state_machine - WARNING" "$OUT/trace-4gpu-float32.log" | cut -c1-330 \
        | grep "^== \|client steps\|pieces:\|dispatch\|update-graph" | head -40 ;;
    firstcall)
      # where the Dask engine's first call on 4 GPUs goes: the client's threads (and the local
      # scheduler's) sampled every 2 ms until the first task, every worker's threads during the
      # call (what holds a new cluster's workers ~0.1-0.2 s: bench/NOTES.md, "The Dask
      # engine's first call"), the dispatch times, the trace;
      # twice, in two processes: the machine's first (cold on-disk kernel caches), then one
      # as a user's later session meets it (on one H200 the first copy took 380 ms in the
      # first and 23 ms in the second: bench/NOTES.md, "The Dask engine's first call")
      # (FIRST_SETTING: another setting of dask_stream, e.g. 2gpu on a machine of two)
      fs=${FIRST_SETTING:-4gpu}
      for run in cold warm; do
        timeout ${T_FIRST:-150} python3 -m bench.research.dask_stream --setting $fs --sizes 32768 \
          --dtype float32 --calls 2 --trace --sample --sample-workers > "$OUT/firstcall-$fs-$run.log" 2>&1
        echo "$run exit $?"
        grep -v "CancelledError\|state_machine - WARNING" "$OUT/firstcall-$fs-$run.log" | cut -c1-300 \
          | grep "^== \|client steps\|sampled\|^     \|worker tcp\|dispatch\|update-graph\|pieces:" | head -90
      done ;;
    pieces)
      # the Dask engine's rows (gpu-dask-4.toml, or PIECES_STUDY) in one call, each way of
      # PIECES_WAYS (default: "- p16 chunk"): "-" the default (a float32 block's whole k as
      # one piece, one GEMM per chunk of C), "p16" pieces of 16384 (the default until the
      # fifteenth session), "chunk" pieces of one chunk, "whole" the whole k as one piece
      # whatever the dtype; records gpu-dask-N{,-p16,-chunk,-whole}.jsonl
      st=${PIECES_STUDY:-bench/studies/gpu-dask-4.toml}; tag=$(basename "$st" .toml)
      for w in ${PIECES_WAYS:-- p16 chunk}; do
        v=-$w; [ "$w" = - ] && v=""
        case $w in
          chunk) env="DASK_DISTMM_DEBUG__FIRST_PIECE_K=4096 DASK_DISTMM_DEBUG__LATER_PIECE_K=4096" ;;
          p16) env="DASK_DISTMM_DEBUG__FIRST_PIECE_K=16384 DASK_DISTMM_DEBUG__LATER_PIECE_K=16384" ;;
          whole) env="DASK_DISTMM_DEBUG__FIRST_PIECE_K=1048576" ;;
          *) env="" ;;
        esac
        env $env timeout ${T_PIECES:-170} python3 -m distmm bench "$st" -o "$OUT/$tag$v.jsonl" \
          2>&1 | cut -c1-300 | grep "^\[" | tail -4
      done ;;
    gemmk)
      # one GPU: a block's GEMM as one k, as pieces, as the first piece's parts then pieces
      # (bench/research/gemm_k.py; 16384^2 blocks of k = 32768, chunks 8192)
      CUDA_VISIBLE_DEVICES=0 timeout ${T_GEMMK:-120} python3 -m bench.research.gemm_k \
        > "$OUT/gemm-k.log" 2>&1; echo "exit $?"; cat "$OUT/gemm-k.log" | tail -16 ;;
    summa)
      # the MPI engine's panels from CUDA events (bench/research/summa_trace.py), fp32
      # ${SUMMA_SIZE:-65536} on 4 GPUs as ${SUMMA_NODES:-2 1} emulated nodes (1: one host);
      # NCCL_DEBUG=INFO (init, graph, net) in each log under $OUT
      for nodes in ${SUMMA_NODES:-2 1}; do
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,NET timeout ${T_SUMMA:-150} \
          python3 -m bench.research.summa_trace --launch 4 --nodes $nodes \
          --size ${SUMMA_SIZE:-65536} --calls 2 --out "$OUT/summa-$nodes.json" \
          > "$OUT/summa-$nodes.log" 2>&1
        echo "exit $? (nodes $nodes)"
        grep -v "NCCL INFO" "$OUT/summa-$nodes.log" | grep -v "^\s*$" | cut -c1-400 | tail -12
        grep "NCCL INFO" "$OUT/summa-$nodes.log" | grep -i "via\|nchannels\|Using network\|NET/Socket" \
          | sed 's/^[^ ]* //' | sort | uniq -c | sort -rn | head -${SUMMA_NCCL_LINES:-12} | cut -c1-250
      done ;;
    dasktests)
      CUDA_VISIBLE_DEVICES=0,1 timeout ${T_DT:-200} $PT ${DASK_TESTS:-tests/test_dask_gpu.py \
        tests/test_dask_gpu_engine.py tests/test_dask_ipc_gpu.py} > "$OUT/pytest-dask.log" 2>&1
      echo "exit $?"; tail -8 "$OUT/pytest-dask.log" ;;
    trace)
      for dt in ${TRACE_DTYPES:-float32 float64}; do
        timeout ${T_TRACE:-110} python3 -m bench.research.dask_stream --setting 4gpu --sizes 32768 \
          --dtype $dt --calls 3 --trace > "$OUT/trace-4gpu-$dt.log" 2>&1
        echo "exit $?"
        grep -v "CancelledError\|state_machine - WARNING" "$OUT/trace-4gpu-$dt.log" | cut -c1-330 \
          | grep "^== \|client steps\|pieces\|trace.*start\|export\|release" | tail -${TRACE_LINES:-40}
      done ;;
    batch)
      timeout ${T_BATCH:-230} python3 -m bench.mpi_batch --sizes 32768 --ranks 2 4 --repeat 3 \
        --work /tmp/distmm-batch --out-dir "$OUT" 2>&1 | cut -c1-300
      rm -rf /tmp/distmm-batch
      timeout ${T_BIG:-270} python3 -m bench.mpi_batch --sizes 65536 --ranks 2 4 --repeat 1 \
        --gemm-repeat 1 --work /tmp/distmm-batch --out-dir "$OUT" 2>&1 | cut -c1-300
      rm -rf /tmp/distmm-batch ;;
    tf32)
      timeout ${T_TF32:-240} python3 -m distmm bench bench/studies/gpu-tf32.toml \
        -o "$OUT/gpu-tf32.jsonl" 2>&1 | cut -c1-300 | tail -12 ;;
    dask)
      timeout ${T_DASK:-400} python3 -m distmm bench bench/studies/gpu-dask.toml \
        -o "$OUT/gpu-dask.jsonl" 2>&1 | cut -c1-300 | tail -40 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
ls -la "$OUT"
