// Step 4: 1D register blocking. A 64 x 64 tile of C per block of 512 threads; each thread
// computes TM = 8 consecutive rows of one column, so one shared-memory read of B feeds 8
// multiply-adds. op(A) is kept transposed in shared memory (As[k][m]) so the 8 values a
// thread needs are consecutive and shared by the whole warp (broadcast).
#include "common.cuh"

namespace distmm {
template <typename T>
__device__ __forceinline__ void blocktile1d_body(int by, int M, int N, int K, T alpha,
                                                 const T* __restrict__ A,
                                                 long long lda, const T* __restrict__ B, long long ldb,
                                                 T beta, T* __restrict__ C, long long ldc, int flags) {
    constexpr int BM = 64, BN = 64, BK = 8, TM = 8, NT = 512, PAD = 4;
    __shared__ T As[BK][BM + PAD];
    __shared__ T Bs[BK][BN + PAD];
    const bool ta = flags & DISTMM_TRANS_A, tb = flags & DISTMM_TRANS_B;
    const int tid = threadIdx.x;
    const int tx = tid % BN, ty = tid / BN;
    const int m0 = by * BM, n0 = blockIdx.x * BN;
    typedef typename acc_type<T>::type Acc;
    Acc acc[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) acc[i] = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
        {   // one element of op(A) per thread, lanes along A's contiguous dimension
            int m = ta ? tid % BM : tid / BK, k = ta ? tid / BM : tid % BK;
            int gm = m0 + m, gk = k0 + k;
            As[k][m] = (gm < M && gk < K) ? op_at(A, lda, ta, gm, gk) : T(0);
        }
        {
            int k = tb ? tid % BK : tid / BN, n = tb ? tid / BK : tid % BN;
            int gk = k0 + k, gn = n0 + n;
            Bs[k][n] = (gk < K && gn < N) ? op_at(B, ldb, tb, gk, gn) : T(0);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            T b = Bs[k][tx];
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] = madd(As[k][ty * TM + i], b, acc[i]);
        }
        __syncthreads();
    }
    const int col = n0 + tx;
    if (col < N) {
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            int row = m0 + ty * TM + i;
            if (row < M) store_c(C, (long long)row * ldc + col, acc[i], alpha, beta);
        }
    }
    (void)NT;
}
}  // namespace distmm

template <typename T>
__global__ void __launch_bounds__(512)
distmm_gemm_blocktile1d(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                        const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                        long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 63) / 64; by += (int)gridDim.y)
        distmm::blocktile1d_body<T>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST(T) template __global__ void distmm_gemm_blocktile1d<T>(int, int, int, T, const T*, \
    long long, const T*, long long, T, T*, long long, int);
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
