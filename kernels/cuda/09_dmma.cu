// Step 9: FP64 tensor cores. For double, every warp computes its WM x WN warp tile as
// (WM/8) x (WN/8) tiles of 8 x 8 with mma.sync.m8n8k4 (DMMA: IEEE fp64 fused multiply-adds,
// sm_80+), or on sm_90, where WM and BK are multiples of 16, as (WM/16) x (WN/8) tiles of
// 16 x 8 with mma.sync.m16n8k16, instead of SIMT DFMA; other element types run step 8's
// SIMT body unchanged (same parameters), so this step is the raw backend for every dtype.
//
// DMMA fragments (PTX ISA, mma.m8n8k4 .f64): lane = 4 * g + t (g = lane / 4, t = lane % 4)
// holds A[g][t] of the 8 x 4 A tile, B[t][g] of the 4 x 8 B tile and C[g][2t], C[g][2t + 1]
// of the 8 x 8 accumulator tile. A thread's accumulators are WM * WN / 32 doubles, so TM x TN
// (TM * TN = WM * WN / 32, the registry's register budget check) only labels that count; the
// registry takes TM = 8 for double.
//
// Shared memory: as in step 8 each operand keeps its global layout (cp.async 16-byte copies),
// but every row is padded by 4 doubles (row length = 4 or 12 mod 16 doubles): the 16 lanes of
// a half warp read 4 consecutive doubles in each of 4 rows, which then fall in 4 disjoint
// groups of 8 banks, in all four layouts (A[m][k], A[k][m], B[k][n], B[n][k]).
#include "pipelined.cuh"

namespace distmm {

template <typename T> struct is_f64 { static constexpr bool value = false; };
template <> struct is_f64<double> { static constexpr bool value = true; };

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB>
struct DmmaShape {
    static constexpr int WGM = BM / WM, WGN = BN / WN, NT = WGM * WGN * 32;
    static constexpr int MT = WM / 8, NTI = WN / 8;  // 8 x 8 tiles per warp tile
    static constexpr int A_ROWS = TA ? BK : BM, A_COLS = TA ? BM : BK;
    static constexpr int B_ROWS = TB ? BN : BK, B_COLS = TB ? BK : BN;
    static constexpr int A_LD = A_COLS + 4, B_LD = B_COLS + 4;
    static constexpr int A_STAGE = A_ROWS * A_LD, B_STAGE = B_ROWS * B_LD;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 8;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 8 == 0 && WN % 8 == 0, "tile shapes");
    static_assert(BK % 8 == 0 && BM % 8 == 0 && BN % 8 == 0, "padding keeps rows 4 or 12 mod 16");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
};

// D = A * B + D for one 8 x 8 x 4 tile (fragments as above).
__device__ __forceinline__ void dmma884(double& c0, double& c1, double a, double b) {
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
        : "+d"(c0), "+d"(c1) : "d"(a), "d"(b));
}

// sm_90 adds m16n8k16 (PTX ISA 7.8): 8 times the work of m8n8k4 per instruction; on sm_90
// m8n8k4 kernels plateau at about half of cuBLAS DGEMM (bench/NOTES.md). Fragments, with
// g = lane / 4, t = lane % 4: a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1], b[v] = B[t + 4 v][g],
// c0, c1 = C[g][2t], C[g][2t + 1]; c2, c3 = C[g + 8][2t], C[g + 8][2t + 1].
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DISTMM_DMMA16 1
__device__ __forceinline__ void dmma16816(double& c0, double& c1, double& c2, double& c3,
                                          const double* a, const double* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
        : "+d"(c0), "+d"(c1), "+d"(c2), "+d"(c3)
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
          "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}
#else
#define DISTMM_DMMA16 0
#endif

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void dmma_body(int M, int N, int K, double alpha, const double* __restrict__ A,
                                          long long lda, const double* __restrict__ B, long long ldb,
                                          double beta, double* __restrict__ C, long long ldc, int flags) {
    typedef DmmaShape<BM, BN, BK, WM, WN, STAGES, TA, TB> S;
    constexpr int NT = S::NT, MT = S::MT, NTI = S::NTI;
    extern __shared__ __align__(16) unsigned char distmm_smem[];
    double* As = reinterpret_cast<double*>(distmm_smem);
    double* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;

    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4;
    const int row_w = wm * WM + g, col_w = wn * WN + g;  // this lane's fragment row / column

    const bool a_rows_in = vec_a && m0 + BM <= M, b_cols_in = vec_b && n0 + BN <= N;
    auto load_tile = [&](int kt, int stage) {
        ab_tile<double, BM, BN, BK, S::A_LD, S::B_LD, NT, TA, TB>(
            As + stage * S::A_STAGE, Bs + stage * S::B_STAGE, A, lda, B, ldb, m0, n0, kt * BK,
            M, N, K, a_rows_in, b_cols_in, vec_a, vec_b, tid);
    };

    double acc[MT][NTI][2];
    zero_acc(acc);

    // Offsets (in doubles, within a stage) of this lane's fragment elements at k-step 0;
    // k-step kk adds kk * (stride of k).
    const int a_off = TA ? t * S::A_LD + row_w : row_w * S::A_LD + t;
    const int b_off = TB ? col_w * S::B_LD + t : t * S::B_LD + col_w;
    constexpr int A_KSTEP = TA ? S::A_LD : 1, A_ISTEP = TA ? 8 : 8 * S::A_LD;
    constexpr int B_KSTEP = TB ? 1 : S::B_LD, B_JSTEP = TB ? 8 * S::B_LD : 8;
#if DISTMM_DMMA16
    // m16n8k16 where the warp tile and the k tile allow it (sm_90), else m8n8k4.
    constexpr bool BIG = WM % 16 == 0 && BK % 16 == 0;
#endif

    const int KT = (K + BK - 1) / BK;
    cp_async_prologue<STAGES>(KT, load_tile);
    int read_stage = 0, write_stage = STAGES - 1;
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
        const double* as = As + read_stage * S::A_STAGE + a_off;
        const double* bs = Bs + read_stage * S::B_STAGE + b_off;
#if DISTMM_DMMA16
        if constexpr (BIG) {
#pragma unroll
            for (int kk = 0; kk < BK; kk += 16) {
                double af[MT / 2][8];
#pragma unroll
                for (int i = 0; i < MT / 2; ++i)
#pragma unroll
                    for (int v = 0; v < 8; ++v)  // row g + 8 (v % 2), k t + 4 (v / 2)
                        af[i][v] = as[(kk + 4 * (v / 2)) * A_KSTEP + (2 * i + v % 2) * A_ISTEP];
#pragma unroll
                for (int j = 0; j < NTI; ++j) {
                    double bf[4];
#pragma unroll
                    for (int v = 0; v < 4; ++v) bf[v] = bs[(kk + 4 * v) * B_KSTEP + j * B_JSTEP];
#pragma unroll
                    for (int i = 0; i < MT / 2; ++i)
                        dmma16816(acc[2 * i][j][0], acc[2 * i][j][1], acc[2 * i + 1][j][0],
                                  acc[2 * i + 1][j][1], af[i], bf);
                }
            }
        } else
#endif
        {
#pragma unroll
            for (int kk = 0; kk < BK; kk += 4) {
                double af[MT], bf[NTI];
#pragma unroll
                for (int i = 0; i < MT; ++i) af[i] = as[kk * A_KSTEP + i * A_ISTEP];
#pragma unroll
                for (int j = 0; j < NTI; ++j) bf[j] = bs[kk * B_KSTEP + j * B_JSTEP];
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NTI; ++j) dmma884(acc[i][j][0], acc[i][j][1], af[i], bf[j]);
            }
        }
        read_stage = next_stage<STAGES>(read_stage);
        write_stage = next_stage<STAGES>(write_stage);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int row = m0 + wm * WM + i * 8 + g;
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < NTI; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = n0 + wn * WN + j * 8 + 2 * t + e;
                if (col < N) store_c(C, (long long)row * ldc + col, acc[i][j][e], alpha, beta);
            }
        }
    }
}

}  // namespace distmm

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          int MINB, bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_dmma(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                 const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                 long long ldc, int flags) {
    if constexpr (distmm::is_f64<T>::value) {
        static_assert(TM * TN * 32 == WM * WN, "TM x TN counts a thread's accumulators");
        distmm::dmma_body<BM, BN, BK, WM, WN, STAGES, TA, TB>(M, N, K, alpha, A, lda, B, ldb,
                                                               beta, C, ldc, flags);
    } else {
        static_assert((WM / TM) * (WN / TN) == 32, "a warp tile is one warp");
        distmm::pipelined_body<T, BM, BN, BK, WM, WN, TM, TN, STAGES, TA, TB>(
            M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
    }
}

#ifndef DISTMM_NVRTC
// The default configurations of distmm/registry.py, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, TA, TB)                              \
    template __global__ void distmm_gemm_dmma<T, BM, BN, BK, WM, WN, TM, TN, ST, 1, TA, TB>( \
        int, int, int, T, const T*, long long, const T*, long long, T, T*, long long, int);
#define DISTMM_INST(T, BM, BN, BK, WM, WN, TM, TN, ST)                 \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, true, true)
DISTMM_INST(float, 128, 256, 32, 64, 64, 16, 8, 2)
DISTMM_INST(int, 128, 128, 16, 32, 64, 8, 8, 3)
DISTMM_INST(double, 64, 64, 16, 32, 32, 8, 4, 3)
DISTMM_INST(double, 128, 128, 8, 32, 64, 8, 8, 3)
DISTMM_INST(long long, 128, 64, 16, 32, 32, 8, 4, 3)
#endif
