// Step 6: vectorised 16-byte loads. Step 5's tiling, but global memory is read 16 bytes per
// thread (float4 / double2 / int4 / longlong2) along each operand's contiguous dimension, and
// the inner loop reads its 8 + 8 register values from shared memory as 16-byte vectors
// (op(A) transposed in shared memory, As[k][m], so a thread's rows are consecutive).
// The transpose flags are template parameters: they decide which global dimension is
// contiguous and so how a 16-byte chunk lands in shared memory. Rows whose start is not
// 16-byte aligned, and chunks that cross the matrix edge, fall back to element loads.
#include "common.cuh"

namespace distmm {

// Read V = 16/sizeof(T) elements g[r*ld + c .. c+V) of a row-major matrix (zero outside
// rows < row_lim, cols < col_lim), as one 16-byte load where the chunk is whole and aligned.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ g, long long ld, int r, int c,
                                           int row_lim, int col_lim, bool vec, T* out) {
    constexpr int V = vec16<T>::n;
    if (r < row_lim && vec && c + V <= col_lim) {
        ld16(g + (long long)r * ld + c, out);
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e)
            out[e] = (r < row_lim && c + e < col_lim) ? g[(long long)r * ld + c + e] : T(0);
    }
}

template <typename T, bool TA, bool TB>
__device__ __forceinline__ void vectorized_body(int by, int M, int N, int K, T alpha,
                                                const T* __restrict__ A,
                                                long long lda, const T* __restrict__ B, long long ldb,
                                                T beta, T* __restrict__ C, long long ldc, int flags) {
    constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8, NT = 256;
    constexpr int V = vec16<T>::n;
    __shared__ __align__(16) T As[BK][BM + V];
    __shared__ __align__(16) T Bs[BK][BN + V];
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
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
        constexpr int CHUNKS = BM * BK / V;  // the same for B since BM == BN
#pragma unroll
        for (int it = 0; it < CHUNKS / NT; ++it) {
            int ch = tid + it * NT;
            T tmp[V];
            if (!TA) {  // A stored M x K: chunk along k, scattered into a column of As
                int m = ch / (BK / V), k = (ch % (BK / V)) * V;
                load_chunk(A, lda, m0 + m, k0 + k, M, K, vec_a, tmp);
#pragma unroll
                for (int e = 0; e < V; ++e) As[k + e][m] = tmp[e];
            } else {    // A stored K x M: chunk along m, one 16-byte store
                int k = ch / (BM / V), m = (ch % (BM / V)) * V;
                load_chunk(A, lda, k0 + k, m0 + m, K, M, vec_a, tmp);
                st16(&As[k][m], tmp);
            }
            if (!TB) {  // B stored K x N: chunk along n
                int k = ch / (BN / V), n = (ch % (BN / V)) * V;
                load_chunk(B, ldb, k0 + k, n0 + n, K, N, vec_b, tmp);
                st16(&Bs[k][n], tmp);
            } else {    // B stored N x K: chunk along k, scattered into a column of Bs
                int n = ch / (BK / V), k = (ch % (BK / V)) * V;
                load_chunk(B, ldb, n0 + n, k0 + k, N, K, vec_b, tmp);
#pragma unroll
                for (int e = 0; e < V; ++e) Bs[k + e][n] = tmp[e];
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            T a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; i += V) ld16(&As[k][ty * TM + i], &a[i]);
#pragma unroll
            for (int j = 0; j < TN; j += V) ld16(&Bs[k][tx * TN + j], &b[j]);
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

template <typename T, bool TA, bool TB>
__global__ void __launch_bounds__(256)
distmm_gemm_vectorized(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                       const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                       long long ldc, int flags) {
    // row tiles past the grid's 65535 (cuda_loader caps gridDim.y) in turn
    for (int by = blockIdx.y; by < (M + 127) / 128; by += (int)gridDim.y)
        distmm::vectorized_body<T, TA, TB>(by, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
#define DISTMM_INST2(T, TA, TB) template __global__ void distmm_gemm_vectorized<T, TA, TB>(int, int, \
    int, T, const T*, long long, const T*, long long, T, T*, long long, int);
#define DISTMM_INST(T) DISTMM_INST2(T, false, false) DISTMM_INST2(T, false, true) \
    DISTMM_INST2(T, true, false) DISTMM_INST2(T, true, true)
DISTMM_INST(float) DISTMM_INST(double) DISTMM_INST(int) DISTMM_INST(long long)
#endif
