#!/usr/bin/env bash
# One call on a 4-GPU machine, from the repository root after `. .whl/env.sh`: where the Dask
# engine stalls on 4 GPUs (bench/research/dask_stall.py at the sizes that stalled and the
# issue's 32768), the distmm-cluster GPU test, and (on the CPU meanwhile) how this disk takes
# one output from 4 writers (bench/research/write_paths.py) and what MPI's launch costs with
# and without Open MPI's libfabric BTL. Logs land under $OUT.
set -u
. "$(dirname "$0")/prelude.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
( taskset -c 48-63 python3 -m bench.research.write_paths --gib 4 --procs 4 --dir /tmp --repeat 2
  for btl in default "^ofi"; do
    if [ "$btl" = default ]; then unset OMPI_MCA_btl; else export OMPI_MCA_btl=$btl; fi
    for r in 1 2 3; do
      s=$(date +%s.%N); mpiexec --oversubscribe --bind-to none -n 4 python3 -c \
        "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"; e=$(date +%s.%N)
      echo "launch btl=$btl run $r: $(python3 -c "print(f'{$e-$s:.2f}')") s"
    done
  done ) > "$OUT/cpu-probes.log" 2>&1 & cpu=$!
probe() { echo "== dask_stall $*"; timeout 240 python3 -m bench.research.dask_stall "$@" 2>&1 \
  | grep -v "CancelledError\|state_machine - WARNING" | cut -c1-600 | head -400; echo "exit ${PIPESTATUS[0]}"; }
probe --gpus 4 --nodes 2 --size 3000 --chunk 700 --dtype float64 --deadline 40 --calls 2 > "$OUT/stall-emulated.log"
tail -c 20000 "$OUT/stall-emulated.log" | head -150
probe --gpus 4 --size 32768 --deadline 40 --calls 3 > "$OUT/stall-32768.log"; head -c 6000 "$OUT/stall-32768.log"
probe --gpus 4 --size 65536 --deadline 60 --calls 1 > "$OUT/stall-65536.log"; head -c 6000 "$OUT/stall-65536.log"
echo "== distmm cluster on 4 GPUs"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_cluster_cmd_gpu.py 2>&1 | tail -15
wait $cpu; echo "== CPU probes"; cat "$OUT/cpu-probes.log"
