#!/usr/bin/env bash
# The offline bundle for GPU runs over UCX (distributed-ucxx), from the repository root:
#
#   bash bench/device/ucx_bundle.sh        # after ../shared/gpu-node/wheels.sh built .whl/
#
# It makes .whlu/ (~55 MB): the Dask wheels of .whl/ and distributed-ucxx with the UCX, UCXX
# and RMM libraries it loads, without the MPI and peer wheels (.whl/ and these together pass
# the 64 MiB a device call carries). cuda-core, cuda-bindings, nvidia-ml-py, numpy and pyyaml,
# which they also need, are in the GPU image. distributed-ucxx 0.52 asks for dask 2026.7.1
# through rapids-dask-dependency; it is installed --no-deps beside .whl/'s dask 2026.8.0, the
# pair every UCX record was measured with. A device call then carries [".whlu"] and begins
# `. .whlu/env.sh && `; `gpu_cluster(protocol="auto")` takes UCX there.
set -euo pipefail
[ -f .whl/env.sh ] || { echo "ucx_bundle: build .whl/ first (../shared/gpu-node/wheels.sh)" >&2; exit 1; }
mkdir -p .whlu
for w in dask-2 distributed-2 dask_cuda- partd- locket- tblib- tornado- zict-; do
  cp .whl/${w}*.whl .whlu/
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform any -d .whlu \
  distributed-ucxx-cu13==0.52.0 ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 \
  rapids-logger==0.3.0 librmm-cu13==26.10.0 rmm-cu13==26.10.0
sed 's#\.whl/#.whlu/#g' .whl/env.sh > .whlu/env.sh
du -sh .whlu
