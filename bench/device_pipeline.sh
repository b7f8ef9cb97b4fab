#!/usr/bin/env bash
# One device call for issue 5 (stream pipeline): the GPU tests, then the pipeline
# benchmark with a timeline. Everything lands under $OUT (5 files):
#   pytest.log, bench.log, pipeline-<device>-<date>.jsonl, timeline.png, timeline.json
# Run from the repo root after `. .whl/env.sh`.
. "$(dirname "$0")/device_common.sh"
T_TESTS=${T_TESTS:-200}
T_BENCH=${T_BENCH:-330}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 -c "import cupy, numpy, os; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cpus', len(os.sched_getaffinity(0)))"
  free -g | head -2
} 2>&1 | tee "$OUT/bench.log"

echo "== tests ==" | tee -a "$OUT/bench.log"
timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -rs \
  ${TESTS:-tests/test_gpu_pipeline.py tests/test_trace_render.py tests/test_pipeline_sim.py} 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
tail -3 "$OUT/pytest.log" >> "$OUT/bench.log"

echo "== benchmark ==" | tee -a "$OUT/bench.log"
timeout "$T_BENCH" python3 bench/pipeline.py --probe --sizes ${SIZES:-16384 32768} \
  --dtypes ${DTYPES:-float32 float64} --repeat ${REPEAT:-3} --out-dir "$OUT" \
  --timeline "$OUT/timeline.png" --timeline-json "$OUT/timeline.json" \
  --timeline-n 32768 --timeline-dtype float32 2>&1 | tee -a "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
date -u | tee -a "$OUT/bench.log"
