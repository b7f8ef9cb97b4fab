"""Where does a SIMT float64 GEMM stop? DFMA issue probes shaped like a GEMM's inner loop.

What it answered is in bench/NOTES.md, "Step 10: SIMT float64" (the DFMA probes and the
power cap).

Two kernels, each run with TM x TN accumulators a thread, 128-thread blocks and a chosen
number of resident blocks per SM (capped by padding the dynamic shared memory), so the
number of warps per scheduler is controlled:

``reg``  the outer product ``acc[i][j] += a[i] * b[j]`` on register fragments, k times
         (the register pattern of a GEMM k-step, nothing else);
``smem`` the same with fragments read from a shared-memory tile as step 10 reads them
         (A row-major with k contiguous, B k-major, 16-byte reads, fragments of the next k
         loaded while the current k's FMAs issue), looping over the tile without barriers.

The gap between them and the full kernel says what costs: register operands and
occupancy (``reg``), shared-memory reads (``smem``), or the k-tile boundary and the
global loads (the kernel). Prints TFLOP/s and % of the chain probe (8 independent FMA
chains a thread, full occupancy: the DFMA peak). ``python -m bench.research.dfma_probe``
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.common import event_seconds, sustained_clock

SRC = r"""
// The TM x TN outer product acc += a b^T in one of several issue orders (ORDER):
// 0 row by row (a[i] reused across a row), 1 column by column, 2 two column halves each
// row by row, 3 rows alternating direction (zig-zag), 4 4 x 4 quadrants.
template <int ORDER, int TM, int TN>
__device__ __forceinline__ void outer(double (&acc)[TM][TN], const double (&a)[TM], const double (&b)[TN]) {
    if (ORDER == 0) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    } else if (ORDER == 1) {
#pragma unroll
        for (int j = 0; j < TN; ++j)
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    } else if (ORDER == 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int jj = 0; jj < TN / 2; ++jj) {
                    const int j = h * (TN / 2) + jj;
                    acc[i][j] = fma(a[i], b[j], acc[i][j]);
                }
    } else if (ORDER == 3) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int jj = 0; jj < TN; ++jj) {
                const int j = (i & 1) ? TN - 1 - jj : jj;
                acc[i][j] = fma(a[i], b[j], acc[i][j]);
            }
    } else {
#pragma unroll
        for (int ih = 0; ih < TM; ih += 4)
#pragma unroll
            for (int jh = 0; jh < TN; jh += 4)
#pragma unroll
                for (int i = ih; i < ih + 4 && i < TM; ++i)
#pragma unroll
                    for (int j = jh; j < jh + 4 && j < TN; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
}
template <int TM, int TN, int ORDER = 0>
__global__ void __launch_bounds__(128) probe_reg(double* out, double x, int iters) {
    double a[TM], b[TN], acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) a[i] = x + threadIdx.x + i;
#pragma unroll
    for (int j = 0; j < TN; ++j) b[j] = x - j * 0.5;
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0;
    for (int it = 0; it < iters; ++it) outer<ORDER>(acc, a, b);
    double s = 0;
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s += acc[i][j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Fragments from shared memory: A tile BM x BK (k contiguous, rows padded by 2), B tile
// BK x BN; 4 warps as 2 x 2 warp tiles of (TM*LM) x (TN*LN), lanes LM x LN.
template <int TM, int TN, int LN, int ORDER = 0>
__global__ void __launch_bounds__(128) probe_smem(double* out, double x, int iters, int zero) {
    constexpr int LM = 32 / LN, BK = 16, WM = TM * LM, WN = TN * LN, BM = 2 * WM, BN = 2 * WN;
    constexpr int ALD = BK + 2;
    extern __shared__ __align__(16) double sm[];
    double* As = sm;
    double* Bs = sm + BM * ALD;
    for (int e = threadIdx.x; e < BM * ALD; e += 128) As[e] = x + e * 1e-3;
    for (int e = threadIdx.x; e < BK * BN; e += 128) Bs[e] = x - e * 1e-3;
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int lm = lane / LN, ln = lane % LN;
    const int row0 = (warp / 2) * WM + lm, col0 = (warp % 2) * WN + ln * 2;
    double acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0;
    double fa0[TM], fb0[TN], fa1[TM], fb1[TN];
#define PROBE_LOAD(a, b, k)                                                                  \
    _Pragma("unroll") for (int i = 0; i < TM; ++i) a[i] = as[(row0 + i * LM) * ALD + (k)];   \
    _Pragma("unroll") for (int j = 0; j < TN; j += 2) {                                     \
        double2 t = *reinterpret_cast<const double2*>(bs + (k) * BN + col0 + (j / 2) * (LN * 2)); \
        b[j] = t.x; b[j + 1] = t.y;                                                         \
    }
#define PROBE_FMA(a, b) outer<ORDER>(acc, a, b);
    {
        const double* as = As;
        const double* bs = Bs;
        PROBE_LOAD(fa0, fb0, 0)
    }
    for (int it = 0; it < iters; ++it) {
        // an address the compiler cannot prove loop-invariant (zero is 0 at run time), so
        // the fragment reads stay inside the loop as in a GEMM
        const double* as = As + (it & zero);
        const double* bs = Bs + (it & zero);
#pragma unroll
        for (int k = 0; k < BK; k += 2) {
            PROBE_LOAD(fa1, fb1, k + 1)
            PROBE_FMA(fa0, fb0)
            PROBE_LOAD(fa0, fb0, (k + 2) % BK)
            PROBE_FMA(fa1, fb1)
        }
    }
#undef PROBE_LOAD
#undef PROBE_FMA
    double s = 0;
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s += acc[i][j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void probe_chain(double* out, double x, double y, int iters) {
    double a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5,
           a6 = a0 + 6, a7 = a0 + 7;
#pragma unroll 4
    for (int i = 0; i < iters; ++i) {
        a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y;
        a4 = a4 * x + y; a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
"""

SHAPES = ((8, 8), (8, 6), (6, 8), (8, 4))


ORDERS = ("rows", "columns", "halves", "zigzag", "quadrants")


def smem_probe_bytes(tm: int, tn: int, ln: int) -> int:
    """Static shared memory of ``probe_smem<tm, tn, ln>``: A (BM x (16 + 2)) and B (16 x BN)."""
    bm, bn = 2 * tm * (32 // ln), 2 * tn * ln
    return (bm * 18 + 16 * bn) * 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.research.dfma_probe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--orders", action="store_true",
                    help="only the 8 x 8 probes, once per outer-product issue order")
    ap.add_argument("--sustained", action="store_true",
                    help="the chain probe and the 8 x 8 row / zig-zag probes, each run for 2 s "
                         "with the SM clock and board power sampled")
    args = ap.parse_args(argv)

    import cupy

    names = ["probe_chain"]
    if args.orders or args.sustained:
        names += [f"probe_reg<8,8,{o}>" for o in range(len(ORDERS))]
        names += [f"probe_smem<8,8,4,{o}>" for o in range(len(ORDERS))]
    for tm, tn in ([] if args.orders or args.sustained else SHAPES):
        names.append(f"probe_reg<{tm},{tn}>")
        for ln in (4, 8):
            if (tn * ln) % 2 == 0:
                names.append(f"probe_smem<{tm},{tn},{ln}>")
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    smem_sm = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    out = cupy.empty(sms * 64 * 1024, dtype=np.float64)

    iters = 1 << 14
    k = mod.get_function("probe_chain")
    sec = event_seconds(lambda: k((sms * 8,), (256,), (out, np.float64(0.999), np.float64(1e-3), np.int32(iters))), repeat=5)
    peak = 2 * 8 * iters * 256 * sms * 8 / sec / 1e12
    print(f"chain probe (8 chains, 16 warps/scheduler): {peak:.2f} TFLOP/s")

    def launcher(name, tm, tn, blocks_per_sm, iters, kk, static_smem):
        """(launch function, flops per launch, registers, resident blocks per SM)."""
        f = mod.get_function(name)
        regs = f.num_regs
        # pad dynamic shared memory so that at most blocks_per_sm blocks fit one SM
        dyn = max(static_smem, smem_sm // blocks_per_sm - 1024 - 16)
        dyn = min(dyn, 227 * 1024)
        f.max_dynamic_shared_size_bytes = dyn
        fit_regs = 65536 // (128 * ((regs + 7) // 8 * 8))
        resident = min(blocks_per_sm, fit_regs)
        grid = sms * resident * 8
        args = (out, np.float64(1.0001), np.int32(iters)) + ((np.int32(0),) if "smem" in name else ())
        fn = lambda: f((grid,), (128,), args, shared_mem=dyn)  # noqa: E731
        return fn, 2 * tm * tn * kk * iters * 128 * grid, regs, resident

    def run(name, tm, tn, blocks_per_sm, iters, kk, static_smem):
        fn, flops, regs, resident = launcher(name, tm, tn, blocks_per_sm, iters, kk, static_smem)
        s = event_seconds(fn, repeat=5)
        tf = flops / s / 1e12
        print(f"{name:24s} regs {regs:3d}, {resident} blocks/SM = {resident} warps/scheduler: "
              f"{tf:6.2f} TFLOP/s = {100 * tf / peak:5.1f}% of the chain probe", flush=True)

    if args.sustained:
        # Each probe run back to back for 2 s with the SM clock and board power sampled: the
        # GEMM kernels run at the board's power cap, so the clock, not only the issue
        # rate, decides how close to the DFMA peak an inner loop gets.
        chain = mod.get_function("probe_chain")
        cargs = (out, np.float64(0.999), np.float64(1e-3), np.int32(iters))
        probes = [("probe_chain (8 chains, 16 warps/scheduler)",
                   lambda: chain((sms * 8,), (256,), cargs), 2 * 8 * iters * 256 * sms * 8)]
        for o in (0, 3):
            fn, flops, _, _ = launcher(f"probe_reg<8,8,{o}>", 8, 8, 2, 1 << 14, 1, 0)
            probes.append((f"probe_reg<8,8,{o}> ({ORDERS[o]})", fn, flops))
            fn, flops, _, _ = launcher(f"probe_smem<8,8,4,{o}>", 8, 8, 2, 1 << 10, 16,
                                       smem_probe_bytes(8, 8, 4))
            probes.append((f"probe_smem<8,8,4,{o}> ({ORDERS[o]})", fn, flops))
        for label, fn, flops in probes:
            mhz, watt, rate = sustained_clock(fn)
            tf = flops * rate / 1e12
            at_clock = 2 * 64 * sms * mhz * 1e6 / 1e12  # 64 FP64 lanes per SM (sm_80, sm_90)
            print(f"sustained {label:44s} {tf:6.2f} TFLOP/s at {mhz:4.0f} MHz, {watt:3.0f} W: "
                  f"{100 * tf / at_clock:5.1f}% of the DFMA rate at that clock", flush=True)
        return 0
    if args.orders:
        for o, oname in enumerate(ORDERS):
            print(f"-- order {o}: {oname}")
            run(f"probe_reg<8,8,{o}>", 8, 8, 2, 1 << 12, 1, 0)
            run(f"probe_smem<8,8,4,{o}>", 8, 8, 2, 1 << 8, 16, smem_probe_bytes(8, 8, 4))
        return 0
    for tm, tn in SHAPES:
        for bps in (2, 3, 4):
            run(f"probe_reg<{tm},{tn}>", tm, tn, bps, 1 << 12, 1, 0)
        for ln in (4, 8):
            static = smem_probe_bytes(tm, tn, ln)
            for bps in (2, 3, 4):
                run(f"probe_smem<{tm},{tn},{ln}>", tm, tn, bps, 1 << 8, 16, static)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
