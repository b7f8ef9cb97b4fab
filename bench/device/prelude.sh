# Sourced first by the scripts of bench/device: the output folder ($OUT), the environment
# every device run shares (NCCL without NVLink multicast, unbuffered Python, nvcc on PATH,
# persistent kernel caches, TF32 off unless a run asks for it), and the run's date and commit.
OUT=${OUT:-/tmp/distmm-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}
export DISTMM_CACHE_DIR=${DISTMM_CACHE_DIR:-/tmp/distmm-cache}
unset CUPY_TF32
date -u; echo "commit ${DISTMM_COMMIT:-?}"
# A pip install byte-compiles the package; this copy of the checkout was never run: without
# this, each fresh machine's first product also paid compiling distmm's modules (the Dask
# engine's alone ~0.05-0.1 s; bench/NOTES.md, "The Dask engine's first call"), as run.sh already avoids.
python3 -m compileall -q distmm > /dev/null 2>&1
