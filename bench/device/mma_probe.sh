#!/usr/bin/env bash
# What limits the mma.sync steps (11 TF32, 12 BF16) on one GPU, from the repository root:
#
#   bash bench/device/mma_probe.sh [ceiling] [ncu] [sass]
#
# ceiling  mma.sync's own rate on registers beside cuBLAS at 8192^3 (bench/research/mma_ceiling.py)
# ncu      Nsight Compute (speed of light, warp states, scheduler, pipes, memory) of step 12 at
#          8192^3 with its defaults and with NCU_PARAMS (128 x 256 tiles, 64 x 64 warps), and of
#          step 11 with the same tile; logs ncu-*.txt under $OUT
# sass     step 12's 128 x 256 / 64 x 64 instantiation (NN): ptxas's report and the SASS
#          instruction mix of its k loop (bench/research/sass_hot_loop.py's counting)
# stalls   where step 12's warps wait, per SASS instruction: ncu's warp states and source
#          counters of the defaults (STALL_PRECISION, default bf16; STALL_PARAMS) at 8192^3,
#          the report and its sass page (csv) and raw metrics under $OUT; STALL_KERNEL names
#          another step (mma_tma: step 15)
. bench/device/prelude.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for what in ${*:-ceiling ncu sass}; do
  echo "== $what"
  case $what in
    ceiling)
      timeout ${T_CEIL:-120} python3 -m bench.research.mma_ceiling ceiling --precisions bf16 tf32 ;;
    ncu)
      for spec in "bf16:" "bf16:${NCU_PARAMS:-BN=256,WN=64}" "tf32:${NCU_PARAMS:-BN=256,WN=64}"; do
        prec=${spec%%:*}; params=${spec#*:}; log="$OUT/ncu-$prec-${params:-default}.txt"
        timeout ${T_NCU:-120} ncu --clock-control none --kernel-name regex:distmm_gemm_mma \
          --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
          --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy \
          --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
          python3 -m bench.research.mma_ceiling launch --precision "$prec" --params "$params" \
          > "$log" 2>&1
        echo "-- ncu $prec ${params:-default} (exit $?)"
        grep -E "TFLOP|Duration|Throughput|Issue Slots|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Registers Per|Stall|Warp Cycles Per Issued|Executed Ipc|Achieved Occupancy|Bank|L2 Hit|Pipe" "$log" | head -40
      done ;;
    stalls)
      prec=${STALL_PRECISION:-bf16}; rep="$OUT/stalls-$prec${STALL_KERNEL:+-$STALL_KERNEL}"
      timeout ${T_NCU:-180} ncu --clock-control none --kernel-name regex:distmm_gemm_mma \
        --launch-skip 1 --launch-count 1 --section WarpStateStats --section SourceCounters \
        --section SpeedOfLight --section SchedulerStats --import-source no -f -o "$rep" \
        python3 -m bench.research.mma_ceiling launch --precision "$prec" --params "${STALL_PARAMS:-}" \
        ${STALL_KERNEL:+--kernel "$STALL_KERNEL"} \
        > "$rep.log" 2>&1; echo "-- ncu stalls $prec (exit $?)"; tail -3 "$rep.log"
      ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2> "$rep-sass.err"
      echo "sass page exit $? ($(wc -l < "$rep-sass.csv") lines)"; head -c 600 "$rep-sass.err"
      ncu --import "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2>&1
      ncu --import "$rep.ncu-rep" --page details > "$rep-details.txt" 2>&1
      grep -iE "stall|Issued|Eligible|Throughput|Warp Cycles" "$rep-details.txt" | head -40
      python3 -m bench.research.stall_table "$rep-sass.csv" --top 30 | tee "$rep-table.txt" ;;
    sass)
      python3 -m bench.research.mma_ceiling sass > "$OUT/sass-mma-bf16.txt" 2>&1; echo "exit $?"
      head -60 "$OUT/sass-mma-bf16.txt" ;;
  esac
done
