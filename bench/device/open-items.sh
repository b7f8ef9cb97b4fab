#!/usr/bin/env bash
# The measurements the open issues still lack, on a 4-GPU machine, from the repository root
# after `. .whl/env.sh`; name the steps to run (each a few minutes), in order:
#   bash bench/device/open-items.sh outofcore resume trace emulated emulated-tuned
# outofcore       131072^2 fp32 on GPUs 0,1 from host blocks (bench/mpi_outofcore.py); on
#                 cards above 100 GB the device limit is set to 64 GiB so that ranks stream
# resume          mpirun -n 4 at fp32 32768: whole, stopped half way by SIGTERM, resumed
#                 (bench/mpi_resume.py)
# trace           the Dask engine's first and warm calls on 4 GPUs, traced
#                 (bench/research/dask_stream.py)
# emulated        bench/studies/gpu-emulated.toml (both engines, 4 GPUs as 2 emulated nodes)
# emulated-tuned  the same with NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4 (NCCL's TCP knobs)
# firstcall       host-resident first calls at 32768 (fp64, fp32), each in a fresh process that
#                 made its operands with cupy first (bench/pipeline.py --first-call)
# batch           mpirun -n P distmm matmul at fp32 32768, P = 1 (two ways), 2, 4 (bench/mpi_batch.py)
# resume-big      the resume step at fp64 65536 (whole runs of ~25 s), twice
# resume-one      one process on one GPU at fp32 57344 (fits a 64 GiB disk), twice, each run's
#                 profile kept (resume-<repeat>-<whole|stopped|resumed>.json): where a stopped
#                 GPU run spends the 3-6 s between its SIGTERM and its exit
# direct          the stream pipeline's copies straight between the device and the caller's
#                 arrays (distmm-debug.pipeline-direct; one GPU): the pipeline's GPU tests, then
#                 host-resident bf16 at 32768 (with timelines) and fp32 / fp64 at 32768, each
#                 through the ring (0) and straight (1)
# pinned          operands and result page-locked by their owner (cupyx.empty_pinned), which
#                 cross straight: the pipeline's GPU tests, then host-resident bf16 at 32768 (with
#                 timelines) and fp32 / fp64 at 32768, each beside the ring's numpy arrays
# register        what page-locking costs numpy arrays and distmm's own huge-page results, and
#                 what cupyx.empty_pinned costs (bench/research/host_register.py, 1 and 4 GiB)
# cuinit          what the CUDA start-up costs a process: 4 GPUs visible or 1, alone or 4 at once
# exitprobe       what ending costs mpiexec -n 1 and -n 4 of processes that started CUDA, with and
#                 without 8 GiB of device memory and 2 GiB of pinned host memory (each ends as
#                 distmm's ranks do: MPI_Finalize, then os._exit)
# share           the GPU test of batch-panels share, then mpirun -n 2, 4 at fp32 32768 and
#                 -n 4 at 65536 with batch-panels read (and the single-process command at
#                 32768) and with share (label "-share"), beside the same run's references
# Records land under $OUT.
set -u
export OMPI_MCA_btl=${OMPI_MCA_btl-^ofi}
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | uniq -c; free -g | head -2
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
for step in "$@"; do
  echo "== $step"
  case $step in
    outofcore)
      limit=; [ "$mem" -gt 100000 ] && limit=64GiB
      CUDA_VISIBLE_DEVICES=0,1 DASK_DISTMM__DEVICE_MEMORY_LIMIT=$limit timeout 400 \
        mpiexec --oversubscribe --bind-to none -n 2 python3 -m bench.mpi_outofcore --n 131072 \
        --repeat 1 --out-dir "$OUT" 2>&1 | grep -v "^ *$" | tail -30 ;;
    resume)
      timeout 400 python3 -m bench.mpi_resume --n 32768 --ranks 4 --repeat 2 --out-dir "$OUT" \
        2>&1 | tail -5 ;;
    trace)
      timeout 240 python3 -m bench.research.dask_stream --setting 4gpu --sizes 32768 --calls 3 \
        --trace 2>&1 | grep -v "CancelledError\|state_machine - WARNING" | cut -c1-400 \
        | grep "==\|trace\|distmm-" | head -80 ;;
    emulated)
      timeout 560 python3 -m distmm bench bench/studies/gpu-emulated.toml \
        -o "$OUT/gpu-emulated.jsonl" 2>&1 | cut -c1-300 | tail -12 ;;
    emulated-tuned)
      NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4 timeout 560 python3 -m distmm bench \
        bench/studies/gpu-emulated.toml -o "$OUT/gpu-emulated-tuned.jsonl" 2>&1 \
        | cut -c1-300 | tail -12 ;;
    firstcall)
      timeout 300 python3 -m bench.pipeline --first-call --sizes 32768 --dtypes float64 float32 \
        --steady 2 --out-dir "$OUT" 2>&1 | grep -v DEBUG | tail -8 ;;
    batch)
      timeout 200 python3 -m bench.mpi_batch --sizes 32768 --ranks 2 4 --repeat 3 \
        --work /tmp/distmm-batch --out-dir "$OUT" 2>&1 | cut -c1-400
      rm -rf /tmp/distmm-batch ;;
    resume-big)
      timeout 420 python3 -m bench.mpi_resume --n 65536 --dtype float64 --ranks 4 --repeat 2 \
        --out-dir "$OUT" 2>&1 | tail -5
      rm -rf /tmp/distmm-resume ;;
    resume-one)
      timeout 300 python3 -m bench.mpi_resume --n 57344 --dtype float32 --ranks 1 --repeat 2 \
        --out-dir "$OUT" --profile-dir "$OUT" 2>&1 | tail -5
      rm -rf /tmp/distmm-resume ;;
    direct)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_pipeline.py \
        2>&1 | tail -3
      for d in 0 1; do
        DASK_DISTMM_DEBUG__PIPELINE_DIRECT=$d timeout 100 python3 -m bench.pipeline \
          --precision bf16 --sizes 32768 --repeat 3 --out-dir "$OUT" \
          --timeline "$OUT/timeline-bf16-direct$d.png" \
          --timeline-json "$OUT/timeline-bf16-direct$d.json" 2>&1 | grep "32768\|timeline" | tail -4
      done
      for d in 0 1; do
        DASK_DISTMM_DEBUG__PIPELINE_DIRECT=$d timeout 120 python3 -m bench.pipeline --sizes 32768 \
          --dtypes float32 float64 --variants cublas distmm-host --repeat 3 --out-dir "$OUT" \
          2>&1 | grep "n= 32768" | tail -4
      done ;;
    pinned)
      timeout 60 python3 -m bench.research.copy2d 2>&1 | tail -7
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_pipeline.py \
        2>&1 | tail -3
      timeout 150 python3 -m bench.pipeline --precision bf16 --sizes 32768 --repeat 5 \
        --out-dir "$OUT" --timeline "$OUT/timeline-bf16.png" \
        --timeline-json "$OUT/timeline-bf16.json" 2>&1 | grep "  bf16\|timeline" | tail -8
      timeout 200 python3 -m bench.pipeline --sizes 32768 --dtypes float32 float64 \
        --variants cublas distmm-host distmm-host-pinned --repeat 5 --out-dir "$OUT" \
        2>&1 | grep "n= 32768" | tail -6 ;;
    register)
      timeout 150 python3 -m bench.research.host_register --sizes 1 4 2>&1 | tail -12 ;;
    cuinit)
      probe='import time; t=time.perf_counter(); import cupy; i=time.perf_counter(); cupy.cuda.runtime.getDeviceCount(); cupy.cuda.Device(0).use(); cupy.zeros(1); cupy.cuda.Device().synchronize(); print(f"import {i - t:.2f} s, init {time.perf_counter() - i:.2f} s")'
      echo "4 visible:"; python3 -c "$probe"; python3 -c "$probe"
      echo "1 visible:"; CUDA_VISIBLE_DEVICES=0 python3 -c "$probe"
      echo "4 at once, 4 visible:"; for g in 0 1 2 3; do python3 -c "$probe" & done; wait
      echo "4 at once, 1 visible each:"
      for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g python3 -c "$probe" & done; wait ;;
    exitprobe)
      for n in 1 4; do for mem in 0 1; do for rep in 1 2; do
        /usr/bin/time -f "n=$n memory=$mem: %e s" mpiexec --oversubscribe --bind-to none -n $n \
          python3 -c "
import os, time, cupy
from mpi4py import MPI
c = MPI.COMM_WORLD
cupy.cuda.Device(c.rank % cupy.cuda.runtime.getDeviceCount()).use()
cupy.zeros(1)
if $mem:
    d = cupy.empty(8 << 30, dtype=cupy.uint8); d.fill(1)
    h = cupy.cuda.alloc_pinned_memory(2 << 30)
cupy.cuda.Device().synchronize()
c.Barrier()
t = time.time()
if c.rank == 0:
    print(f'at end {t:.3f}', flush=True)
MPI.Finalize()
os._exit(0)" 2>&1 | grep -v '^$'; date +"exited %s.%N"
      done; done; done ;;
    share)
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
        tests/test_mpi_batch.py -k "share" 2>&1 | tail -4
      for n in 32768 65536; do
        if [ $n = 32768 ]; then args="--ranks 2 4 --repeat 3"; else args="--ranks 4 --repeat 2 --no-cli"; fi
        timeout 280 python3 -m bench.mpi_batch --sizes $n $args --gemm-repeat 1 \
          --work /tmp/distmm-batch --out-dir "$OUT" 2>&1 | cut -c1-300
        DISTMM_BATCH_PANELS=share timeout 150 python3 -m bench.mpi_batch --sizes $n $args \
          --no-cli --label=-share --gemm-repeat 1 --work /tmp/distmm-batch --out-dir "$OUT" \
          2>&1 | cut -c1-300
        rm -rf /tmp/distmm-batch
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$OUT"
