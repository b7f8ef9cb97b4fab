// Step 2: global-memory coalescing. Same work per thread as step 1, but consecutive threads
// take consecutive COLUMNS of C: a warp reads one element of A (broadcast), 32 consecutive
// elements of B and writes 32 consecutive elements of C, one 128-byte transaction each.
#include "common.cuh"

namespace distmm {
template <typename T>
__device__ __forceinline__ void coalesced_body(int by, int M, int N, int K, T alpha,
                                               const T* __restrict__ A,
                                               long long lda, const T* __restrict__ B, long long ldb,
                                               T beta, T* __restrict__ C, long long ldc, int flags) {
    const int row = by * 8 + threadIdx.x / 32;
    const int col = blockIdx.x * 32 + threadIdx.x % 32;
    if (row >= M || col >= N) return;
    const bool ta = flags & DISTMM_TRANS_A, tb = flags & DISTMM_TRANS_B;
    typename acc_type<T>::type acc = 0;
    for (int k = 0; k < K; ++k)
        acc = madd(op_at(A, lda, ta, row, k), op_at(B, ldb, tb, k, col), acc);
    store_c(C, (long long)row * ldc + col, acc, alpha, beta);
}
}  // namespace distmm

template <typename T>
__global__ void __launch_bounds__(256)
distmm_gemm_coalesced(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                      const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                      long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 7) / 8; by += (int)gridDim.y)
        distmm::coalesced_body<T>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST(T) template __global__ void distmm_gemm_coalesced<T>(int, int, int, T, const T*, \
    long long, const T*, long long, T, T*, long long, int);
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
