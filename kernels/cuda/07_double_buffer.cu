// Step 7: double-buffered shared memory with cp.async. Step 6's 128 x 128 x 8 tile and 8 x 8
// per-thread outer products, but tiles go global -> shared through cp.async (no registers,
// no load/store instruction pairs) into two buffers: tile k+1 is in flight while tile k is
// multiplied, and one __syncthreads per tile suffices. Shared memory keeps each operand's
// global layout (see pipelined.cuh). Threads form one 16 x 16 grid over the block tile.
#include "pipelined.cuh"

template <typename T, bool TA, bool TB>
__global__ void __launch_bounds__(256)
distmm_gemm_double_buffer(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                          const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                          long long ldc, int flags) {
    distmm::pipelined_body<T, 128, 128, 8, 128, 128, 8, 8, 2, TA, TB>(
        M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST2(T, TA, TB) template __global__ void distmm_gemm_double_buffer<T, TA, TB>(int, \
    int, int, T, const T*, long long, const T*, long long, T, T*, long long, int);
#define DISTMM_INST(T) DISTMM_INST2(T, false, false) DISTMM_INST2(T, false, true) \
    DISTMM_INST2(T, true, false) DISTMM_INST2(T, true, true)
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
