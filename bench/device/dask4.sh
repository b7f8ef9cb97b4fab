#!/usr/bin/env bash
# The Dask engine on a 4-GPU machine in one call, from the repository root after
# `. .whl/env.sh`: its GPU tests on two GPUs, the stall probe's 32768 calls (warm time), the
# study bench/studies/gpu-dask.toml (1, 2, 4 GPUs against cuBLAS in the same run) and the
# emulated-nodes GPU tests. Logs and records land under $OUT.
set -u
BUDGET=${BUDGET:-570}
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | uniq -c
PT="python3 -m pytest -q -p no:cacheprovider -rs -m gpu"
echo "== Dask GPU tests on GPUs 0,1"
CUDA_VISIBLE_DEVICES=0,1 timeout ${T_TESTS:-230} $PT tests/test_dask_gpu.py \
  tests/test_dask_gpu_engine.py tests/test_dask_ipc_gpu.py > "$OUT/pytest-dask.log" 2>&1
echo "exit $?"; tail -12 "$OUT/pytest-dask.log"
echo "== probe: 4 GPUs, fp32 32768, chunks 8192"
timeout 120 python3 -m bench.research.dask_stall --gpus 4 --size 32768 --deadline 40 --calls 4 \
  2>&1 | grep -v "CancelledError\|state_machine - WARNING" | head -60
left=$(( BUDGET - SECONDS - 75 ))
echo "== study gpu-dask ($left s)"
timeout $left python3 -m distmm bench bench/studies/gpu-dask.toml -o "$OUT/gpu-dask.jsonl" 2>&1 \
  | cut -c1-300 | tail -40
echo "exit ${PIPESTATUS[0]}"
left=$(( BUDGET - SECONDS - 5 ))
if [ "$left" -gt 30 ]; then
  echo "== emulated nodes on 4 GPUs ($left s)"
  timeout $left $PT tests/test_emulate_gpu.py 2>&1 | tail -8
fi
