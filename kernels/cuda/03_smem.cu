// Step 3: shared-memory tiling. A 32 x 32 block of threads stages 32 x 32 tiles of op(A) and
// op(B) in shared memory and each thread reuses them 32 times. Each tile is read from global
// memory along its contiguous dimension (coalesced for either transpose flag), which for a
// transposed operand means writing a shared-memory column: the +1 padding of every row puts
// the 32 elements of a column in 32 different banks.
#include "common.cuh"

namespace distmm {
template <typename T>
__device__ __forceinline__ void smem_body(int by, int M, int N, int K, T alpha,
                                          const T* __restrict__ A,
                                          long long lda, const T* __restrict__ B, long long ldb,
                                          T beta, T* __restrict__ C, long long ldc, int flags) {
    constexpr int BS = 32;
    __shared__ T As[BS][BS + 1];  // As[m][k]
    __shared__ T Bs[BS][BS + 1];  // Bs[k][n]
    const bool ta = flags & DISTMM_TRANS_A, tb = flags & DISTMM_TRANS_B;
    const int tx = threadIdx.x % BS, ty = threadIdx.x / BS;
    const int m0 = by * BS, n0 = blockIdx.x * BS;
    typename acc_type<T>::type acc = 0;
    for (int k0 = 0; k0 < K; k0 += BS) {
        // op(A) tile: lanes run along A's contiguous dimension.
        {
            int m = ta ? tx : ty, k = ta ? ty : tx;
            int gm = m0 + m, gk = k0 + k;
            As[m][k] = (gm < M && gk < K) ? op_at(A, lda, ta, gm, gk) : T(0);
        }
        {
            int k = tb ? tx : ty, n = tb ? ty : tx;
            int gk = k0 + k, gn = n0 + n;
            Bs[k][n] = (gk < K && gn < N) ? op_at(B, ldb, tb, gk, gn) : T(0);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BS; ++k) acc = madd(As[ty][k], Bs[k][tx], acc);
        __syncthreads();
    }
    const int row = m0 + ty, col = n0 + tx;
    if (row < M && col < N) store_c(C, (long long)row * ldc + col, acc, alpha, beta);
}
}  // namespace distmm

template <typename T>
__global__ void __launch_bounds__(1024)
distmm_gemm_smem(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                 const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                 long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 31) / 32; by += (int)gridDim.y)
        distmm::smem_body<T>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST(T) template __global__ void distmm_gemm_smem<T>(int, int, int, T, const T*, \
    long long, const T*, long long, T, T*, long long, int);
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
