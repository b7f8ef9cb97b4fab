#!/usr/bin/env bash
# Scaling studies on a GPU machine, one after the other within BUDGET seconds (default 560),
# from the repository root after `. .whl/env.sh`:
#   bash bench/device/studies.sh bench/studies/gpu-scaling-65536.toml bench/studies/gpu-scaling.toml
# Each study's records land in $OUT/<study>.jsonl (what a killed study wrote stays whole).
set -u
BUDGET=${BUDGET:-560}
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for study in "$@"; do
  left=$(( BUDGET - SECONDS ))
  [ "$left" -lt 20 ] && { echo "== $study: not run ($left s left)"; continue; }
  echo "== $study ($left s left)"
  timeout "$left" python3 -m distmm bench "$study" -o "$OUT/$(basename "$study" .toml).jsonl" 2>&1 \
    | cut -c1-300 | tail -60
  echo "exit ${PIPESTATUS[0]}"
done
ls -la "$OUT"
