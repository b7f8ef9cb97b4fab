"""How fast can mma.sync go on this GPU at all? The instruction's own ceiling, and a launcher for ncu.

The issue asks steps 11/12 (mma.sync) for 0.70 of cuBLAS at 8192^3 (TF32, BF16). On Hopper
cuBLAS runs wgmma; mma.sync is the older warp-level instruction, and whether 0.70 of wgmma's
rate is within its reach is a measurement, not a given. ``ceiling`` times kernels that do
nothing but mma.sync on registers: every warp keeps ``--chains`` independent accumulators
and issues them in turn for ``--iters`` rounds, no shared or global memory inside the loop,
with 4 or 8 warps a block and several blocks an SM. Their best rate is the most any
mma.sync GEMM can reach here. Beside it, cuBLAS (``cublasGemmEx`` at the same precision,
``bench.kernels.cublas_precision_runner``) at ``--size``^3, in the same process.

``launch`` runs one step-12/11 configuration twice at ``--size`` (for ``ncu --launch-skip 1
--launch-count 1``): ``--params BM=128,BN=256,WN=64``.

``python -m bench.research.mma_ceiling ceiling`` /
``python -m bench.research.mma_ceiling launch --precision bf16 --params BN=256,WN=64``
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.common.timing import event_seconds

# One kernel per instruction: (PTX shape and types, A registers, B registers, FLOPs an mma).
INSTRUCTIONS = {
    "bf16": ("m16n8k16.row.col.f32.bf16.bf16.f32", 4, 2, 2 * 16 * 8 * 16),
    "fp16": ("m16n8k16.row.col.f32.f16.f16.f32", 4, 2, 2 * 16 * 8 * 16),
    "tf32": ("m16n8k8.row.col.f32.tf32.tf32.f32", 4, 2, 2 * 16 * 8 * 8),
}

_SOURCE = r"""
extern "C" __global__ void mma_loop(float* out, int iters, unsigned seed) {
    unsigned a[SETS][4], b[SETS][2];
    INIT
    float c[CHAINS][4];
    for (int j = 0; j < CHAINS; ++j) for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j)
            asm volatile("mma.sync.aligned.SHAPE {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                         "{%0, %1, %2, %3};\n"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                         : "r"(a[j % SETS][0]), "r"(a[j % SETS][1]), "r"(a[j % SETS][2]),
                           "r"(a[j % SETS][3]), "r"(b[j % SETS][0]), "r"(b[j % SETS][1]));
    }
    float s = 0.f;
    for (int j = 0; j < CHAINS; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""

# One set of operands whose bits are mostly zero (the ceiling's own runs)
_NEAR_ZERO = """
    for (int i = 0; i < 4; ++i) a[0][i] = (seed + threadIdx.x * 7 + i) & 0x3c003c00u;
    for (int i = 0; i < 2; ++i) b[0][i] = (seed + threadIdx.x * 5 + i) & 0x3c003c00u;"""

# Two sets of random operands (hashed from the thread and register; bits = (x & MASK) |
# EXPONENT), the chains alternating between them, so that consecutive mma toggle their bits
_RANDOM = """
    for (int r = 0; r < 12; ++r) {
        unsigned x = (threadIdx.x + 131u * blockIdx.x) * 2654435761u + (r + 1u) * 40503u + seed;
        x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
        const unsigned v = (x & MASK) | EXPONENT;
        if (r < 8) a[r / 4][r % 4] = v; else b[(r - 8) / 2][(r - 8) % 2] = v;
    }"""


def ceiling_kernel(precision: str, chains: int, random_bits: tuple[int, int] | None = None):
    """The register-only loop for ``precision`` with ``chains`` accumulators a warp, on
    near-zero operands, or with ``random_bits`` = (mask, exponent) on random ones."""
    import cupy
    shape = INSTRUCTIONS[precision][0]
    if random_bits is None:
        init, sets = _NEAR_ZERO, 1
    else:
        init = _RANDOM.replace("MASK", f"0x{random_bits[0]:08x}u").replace(
            "EXPONENT", f"0x{random_bits[1]:08x}u")
        sets = 2
    src = (_SOURCE.replace("INIT", init).replace("SETS", str(sets)).replace("SHAPE", shape)
           .replace("CHAINS", str(chains)))
    return cupy.RawKernel(src, "mma_loop", options=("-std=c++17",))


def square_operands(n: int, precision: str):
    """``(a_in, b_in, c)``: standard-normal n x n operands in ``precision``'s input format
    (converted on the GPU) and an n x n float32 C."""
    import cupy

    from distmm.executor import cuda_loader, registry

    fmt = registry.PRECISION_INPUT[precision]
    rng = cupy.random.default_rng()
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a_in, b_in = cuda_loader.to_input_format(a, fmt), cuda_loader.to_input_format(b, fmt)
    return a_in, b_in, cupy.empty((n, n), dtype=np.float32)


def ceiling(args) -> None:
    import cupy

    from bench.kernels import cublas_precision_runner

    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"{name}: {sms} SMs, clock {dev.attributes['ClockRate'] / 1e6:.2f} GHz (max)")
    for precision in args.precisions:
        flops_mma = INSTRUCTIONS[precision][3]
        best = (0.0, None)
        for chains in args.chains:
            kern = ceiling_kernel(precision, chains)
            for warps in (4, 8):
                for per_sm in (1, 2, 4):
                    blocks = sms * per_sm
                    out = cupy.empty(blocks * warps * 32, dtype=np.float32)
                    sec = event_seconds(lambda: kern((blocks,), (warps * 32,),
                                                   (out, np.int32(args.iters), np.uint32(1))),
                                        repeat=5, warmup=1)
                    tf = blocks * warps * args.iters * chains * flops_mma / sec / 1e12
                    print(f"  {precision} mma.sync chains={chains} warps/block={warps} "
                          f"blocks/SM={per_sm}: {tf:7.1f} TFLOP/s ({sec * 1e3:.2f} ms)", flush=True)
                    if tf > best[0]:
                        best = (tf, (chains, warps, per_sm))
        n = args.size
        a_in, b_in, c = square_operands(n, precision)
        run = cublas_precision_runner(a_in, b_in, c, n, n, n, precision)
        blas = 2.0 * n ** 3 / event_seconds(run, repeat=5, warmup=1) / 1e12
        print(f"{precision}: mma.sync ceiling {best[0]:.1f} TFLOP/s {best[1]} against cuBLAS "
              f"{blas:.1f} at {n}^3: the ceiling is {best[0] / blas:.2f} of cuBLAS "
              f"(0.70 of cuBLAS = {0.7 * blas:.1f})", flush=True)
        del a_in, b_in, c
        cupy.get_default_memory_pool().free_all_blocks()


def launch(args) -> None:
    from bench.kernels import parse_variant
    from distmm.executor import cuda_loader, registry

    name = args.kernel or ("mma_tf32" if args.precision == "tf32" else "mma_bf16")
    spec = registry.get_tc(name)
    fmt = registry.PRECISION_INPUT[args.precision]
    params = dict(spec.params(fmt), **parse_variant(args.params)) if args.params else spec.params(fmt)
    n = args.size
    a_in, b_in, c = square_operands(n, args.precision)
    run = (lambda: cuda_loader.launch_tc(name, a_in, False, n, b_in, False, n, c, n, n, n, n,
                                         precision=args.precision, params=params))
    sec = event_seconds(run, repeat=5, warmup=1)  # 6 launches: ncu --launch-skip 1
    print(f"{name} {args.precision} {n}^3 {params}: {2.0 * n ** 3 / sec / 1e12:.1f} TFLOP/s")


def sass(args) -> int:
    """ptxas's report and the SASS instruction mix of step 12's (or 11's) k loop, NN layout."""
    import subprocess
    import tempfile
    from pathlib import Path

    from bench.kernels import parse_variant
    from bench.research.sass_hot_loop import report
    from distmm.executor import cuda_loader, registry

    name = "mma_tf32" if args.precision == "tf32" else "mma_bf16"
    spec = registry.get_tc(name)
    fmt = registry.PRECISION_INPUT[args.precision]
    p = dict(spec.params(fmt), **parse_variant(args.params)) if args.params else spec.params(fmt)
    tin = {"bf16": "distmm_bf16", "fp16": "distmm_fp16", "tf32": "float"}[args.precision]
    kern = "distmm_gemm_mma_tf32" if name == "mma_tf32" else "distmm_gemm_mma_bf16"
    inst = (f"template __global__ void {kern}<{tin},{p['BM']},{p['BN']},{p['BK']},{p['WM']},"
            f"{p['WN']},{p['STAGES']},{p['MINB']},false,false>(int, int, int, float, const {tin}*, "
            f"long long, const {tin}*, long long, float, float*, long long, int);\n")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(cuda_loader.source(spec.file) + "\n" + inst)
        res = subprocess.run(["nvcc", "-std=c++17", "-DDISTMM_NVRTC", "-arch=sm_90", "-cubin",
                              "-Xptxas", "-v", "-o", str(cubin), str(cu)], capture_output=True, text=True)
        print(res.stdout + res.stderr)
        if res.returncode:
            return 1
        text = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    print(f"{name} {args.precision} {p}")
    print(report(text, "HMMA"))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.mma_ceiling", description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("ceiling")
    c.add_argument("--precisions", nargs="+", default=["bf16", "tf32"], choices=list(INSTRUCTIONS))
    c.add_argument("--chains", type=int, nargs="+", default=[4, 8, 16])
    c.add_argument("--iters", type=int, default=4096)
    c.add_argument("--size", type=int, default=8192)
    la = sub.add_parser("launch")
    la.add_argument("--precision", default="bf16", choices=list(INSTRUCTIONS))
    la.add_argument("--params", default="")
    la.add_argument("--kernel", default=None,
                    help="tensor-core step to launch (default: mma_tf32 or mma_bf16, by precision)")
    la.add_argument("--size", type=int, default=8192)
    sa = sub.add_parser("sass")
    sa.add_argument("--precision", default="bf16", choices=list(INSTRUCTIONS))
    sa.add_argument("--params", default="BN=256,WN=64")
    args = p.parse_args(argv)
    if args.what == "sass":
        return sass(args)
    ceiling(args) if args.what == "ceiling" else launch(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
