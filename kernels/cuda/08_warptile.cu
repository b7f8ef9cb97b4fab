// Step 8: warp tiling and a deeper cp.async pipeline. The block tile is split into warp
// tiles (WM x WN), each computed by one warp whose 32 lanes own TM x TN accumulators; a
// warp's shared-memory reads are then broadcasts or 128 contiguous bytes, and the block
// keeps STAGES tiles in flight. MINB is the number of blocks per multiprocessor the
// register allocation must allow (1: up to 255 registers a thread; 2: at most
// 65536 / (2 * threads)). Every shape parameter is a template parameter, searched by
// `distmm tune` (see distmm/registry.py for the space and the defaults).
#include "pipelined.cuh"

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          int MINB, bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_warptile(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                     const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                     long long ldc, int flags) {
    static_assert((WM / TM) * (WN / TN) == 32, "a warp tile is one warp");
    distmm::pipelined_body<T, BM, BN, BK, WM, WN, TM, TN, STAGES, TA, TB>(
        M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
// The default configurations of distmm/registry.py, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, TA, TB)                                   \
    template __global__ void distmm_gemm_warptile<T, BM, BN, BK, WM, WN, TM, TN, ST, 1, TA, TB>( \
        int, int, int, T, const T*, long long, const T*, long long, T, T*, long long, int);
#define DISTMM_INST(T, BM, BN, BK, WM, WN, TM, TN, ST)                 \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, true, true)
DISTMM_INST(float, 64, 128, 16, 32, 64, 8, 8, 3)
DISTMM_INST(int, 128, 128, 16, 32, 64, 8, 8, 3)
DISTMM_INST(double, 64, 128, 16, 64, 32, 8, 8, 2)
DISTMM_INST(long long, 128, 64, 16, 32, 32, 8, 4, 3)
#endif
