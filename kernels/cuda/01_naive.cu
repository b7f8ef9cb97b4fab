// Step 1: naive. One thread per C element; consecutive threads take consecutive ROWS of C,
// so a warp reads 32 different rows of A and writes C with a stride of ldc: uncoalesced.
#include "common.cuh"

namespace distmm {
template <typename T>
__device__ __forceinline__ void naive_body(int by, int M, int N, int K, T alpha,
                                           const T* __restrict__ A,
                                           long long lda, const T* __restrict__ B, long long ldb,
                                           T beta, T* __restrict__ C, long long ldc, int flags) {
    // block: 256 threads over an 8 x 32 tile of C; thread t takes row t % 8, column t / 8.
    const int row = by * 8 + threadIdx.x % 8;
    const int col = blockIdx.x * 32 + threadIdx.x / 8;
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
distmm_gemm_naive(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                  const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                  long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 7) / 8; by += (int)gridDim.y)
        distmm::naive_body<T>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST(T) template __global__ void distmm_gemm_naive<T>(int, int, int, T, const T*, \
    long long, const T*, long long, T, T*, long long, int);
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
