// Step 5: 2D register blocking. A 128 x 128 tile of C per block of 256 threads; each thread
// computes an 8 x 8 sub-tile as an outer product: per k it reads 8 values of op(A) and 8 of
// op(B) from shared memory and does 64 multiply-adds (step 4: 9 reads for 8).
#include "common.cuh"

namespace distmm {
template <typename T>
__device__ __forceinline__ void blocktile2d_body(int by, int M, int N, int K, T alpha,
                                                 const T* __restrict__ A,
                                                 long long lda, const T* __restrict__ B, long long ldb,
                                                 T beta, T* __restrict__ C, long long ldc, int flags) {
    constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8, NT = 256, PAD = 4;
    __shared__ T As[BK][BM + PAD];
    __shared__ T Bs[BK][BN + PAD];
    const bool ta = flags & DISTMM_TRANS_A, tb = flags & DISTMM_TRANS_B;
    const int tid = threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const int m0 = by * BM, n0 = blockIdx.x * BN;
    typedef typename acc_type<T>::type Acc;
    Acc acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int it = 0; it < BM * BK / NT; ++it) {
            int e = tid + it * NT;
            int m = ta ? e % BM : e / BK, k = ta ? e / BM : e % BK;
            int gm = m0 + m, gk = k0 + k;
            As[k][m] = (gm < M && gk < K) ? op_at(A, lda, ta, gm, gk) : T(0);
        }
#pragma unroll
        for (int it = 0; it < BN * BK / NT; ++it) {
            int e = tid + it * NT;
            int k = tb ? e % BK : e / BN, n = tb ? e / BK : e % BN;
            int gk = k0 + k, gn = n0 + n;
            Bs[k][n] = (gk < K && gn < N) ? op_at(B, ldb, tb, gk, gn) : T(0);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            T a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][ty * TM + i];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tx * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = madd(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int row = m0 + ty * TM + i;
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            int col = n0 + tx * TN + j;
            if (col < N) store_c(C, (long long)row * ldc + col, acc[i][j], alpha, beta);
        }
    }
}
}  // namespace distmm

template <typename T>
__global__ void __launch_bounds__(256)
distmm_gemm_blocktile2d(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                        const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                        long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 127) / 128; by += (int)gridDim.y)
        distmm::blocktile2d_body<T>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST(T) template __global__ void distmm_gemm_blocktile2d<T>(int, int, int, T, const T*, \
    long long, const T*, long long, T, T*, long long, int);
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
