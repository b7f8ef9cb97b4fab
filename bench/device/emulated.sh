#!/usr/bin/env bash
# Emulated nodes on a 4-GPU machine, from the repository root, after `. .whl/env.sh`: the GPU
# tests of distmm.emulate (4 ranks as 2 emulated nodes, NCCL's transports read from its
# NCCL_DEBUG=INFO log; 4 dask-cuda workers as 2 nodes), then the study
# bench/studies/gpu-emulated.toml (records under $OUT). STUDY= (empty) runs the tests only.
set -u
OUT=${OUT:-/tmp/distmm-out}
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
echo "== GPU tests of emulated nodes"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_emulate_gpu.py 2>&1 \
  | tail -30
if [ -n "${STUDY-bench/studies/gpu-emulated.toml}" ]; then
  echo "== the study"
  python3 -m distmm bench --dry-run "${STUDY-bench/studies/gpu-emulated.toml}"
  timeout 1500 python3 -m distmm bench "${STUDY-bench/studies/gpu-emulated.toml}" \
    -o "$OUT/gpu-emulated.jsonl" 2>&1 | cut -c1-400
fi
