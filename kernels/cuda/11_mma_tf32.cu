// Step 11: TF32 tensor cores for float32. Each warp computes its WM x WN warp tile as
// (WM/16) x (WN/8) tiles of 16 x 8 with mma.sync.m16n8k8 (tf32 inputs, fp32 accumulate,
// sm_80+) instead of step 8's SIMT FFMA. The operands stay fp32 in global and shared memory;
// each fragment element is rounded to TF32 (10 explicit mantissa bits) with cvt.rna.tf32.f32
// (round to nearest, ties away from zero, as cuBLAS rounds for CUBLAS_COMPUTE_32F_FAST_TF32)
// as it leaves shared memory. This is a lower-precision kernel: precision "tf32" only, never
// the float32 "highest" path (steps 8-9 keep that).
//
// Fragments (PTX ISA, mma.m16n8k8 .tf32), g = lane / 4, t = lane % 4:
//   a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//   b0 = B[t][g], b1 = B[t + 4][g]
//   c0, c1 = C[g][2t], C[g][2t + 1]; c2, c3 = C[g + 8][2t], C[g + 8][2t + 1].
// ldmatrix moves 16-bit elements, so TF32 fragments are read with 32-bit ld.shared, one
// word each; the swizzles of tensorcore.cuh make every such warp-wide read conflict free
// (k-contiguous tiles: SWZ_ROW8, m/n-contiguous tiles: SWZ_ROW4).
//
// Pipeline: STAGES k tiles in flight through cp.async (global -> shared, zero-filled at the
// matrix edges, so any m, n, k), one barrier per k tile, the grouped tile order of step 8.
#include "tensorcore.cuh"

namespace distmm {

template <typename T> struct is_f32 { static constexpr bool value = false; };
template <> struct is_f32<float> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32_16x8x8(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES>
struct Tf32Shape {
    static constexpr int WGM = BM / WM, WGN = BN / WN, NT = WGM * WGN * 32;
    static constexpr int MI = WM / 16, NI = WN / 8;  // mma tiles per warp tile
    static constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 4;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 8 == 0, "tile shapes");
    static_assert(BK % 32 == 0 && BM % 32 == 0 && BN % 32 == 0, "shared rows of 128-byte multiples");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
};

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void tf32_body(int M, int N, int K, float alpha, const float* __restrict__ A,
                                          long long lda, const float* __restrict__ B, long long ldb,
                                          float beta, float* __restrict__ C, long long ldc, int flags) {
    typedef Tf32Shape<BM, BN, BK, WM, WN, STAGES> S;
    constexpr int NT = S::NT, MI = S::MI, NI = S::NI;
    extern __shared__ __align__(128) unsigned char distmm_smem[];
    float* As = reinterpret_cast<float*>(distmm_smem);
    float* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4;

    auto load_tile = [&](int kt, int stage) {
        swz_ab_tile<float, BM, BN, BK, NT, TA, TB, SWZ_ROW8, SWZ_ROW4>(
            As + stage * S::A_STAGE, Bs + stage * S::B_STAGE, A, lda, B, ldb, m0, n0, kt * BK,
            M, N, K, vec_a, vec_b, tid);
    };
    // op(A)(m, k) and op(B)(k, n) of a stage, m and n within the block tile
    auto a_at = [&](const float* as, int m, int k) -> float {
        return TA ? as[swz_offset<BM, 4, SWZ_ROW4>(k, m)] : as[swz_offset<BK, 4, SWZ_ROW8>(m, k)];
    };
    auto b_at = [&](const float* bs, int k, int n) -> float {
        return TB ? bs[swz_offset<BK, 4, SWZ_ROW8>(n, k)] : bs[swz_offset<BN, 4, SWZ_ROW4>(k, n)];
    };

    float acc[MI][NI][4];
    zero_acc(acc);

    const int KT = (K + BK - 1) / BK;
    cp_async_prologue<STAGES>(KT, load_tile);
    int read_stage = 0, write_stage = STAGES - 1;
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
        const float* as = As + read_stage * S::A_STAGE;
        const float* bs = Bs + read_stage * S::B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            unsigned af[MI][4], bf[NI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = wm * WM + i * 16 + g;
                af[i][0] = to_tf32(a_at(as, r, kk + t));
                af[i][1] = to_tf32(a_at(as, r + 8, kk + t));
                af[i][2] = to_tf32(a_at(as, r, kk + t + 4));
                af[i][3] = to_tf32(a_at(as, r + 8, kk + t + 4));
            }
#pragma unroll
            for (int j = 0; j < NI; ++j) {
                const int c = wn * WN + j * 8 + g;
                bf[j][0] = to_tf32(b_at(bs, kk + t, c));
                bf[j][1] = to_tf32(b_at(bs, kk + t + 4, c));
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j) mma_tf32_16x8x8(acc[i][j], af[i], bf[j]);
        }
        read_stage = next_stage<STAGES>(read_stage);
        write_stage = next_stage<STAGES>(write_stage);
    }
    cp_async_wait<0>();
    store_mma_fragments<MI, NI>(acc, C, ldc, M, N, m0 + wm * WM, n0 + wn * WN, g, t, alpha, beta);
}

}  // namespace distmm

// T is float (the registry's only dtype for this step); the template keeps distmm's one
// kernel signature and name mangling.
template <typename T, int BM, int BN, int BK, int WM, int WN, int STAGES, int MINB, bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_mma_tf32(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                     const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                     long long ldc, int flags) {
    static_assert(distmm::is_f32<T>::value, "TF32 tensor cores take float32 operands");
    distmm::tf32_body<BM, BN, BK, WM, WN, STAGES, TA, TB>(M, N, K, alpha, A, lda, B, ldb, beta,
                                                          C, ldc, flags);
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, TA, TB)                                    \
    template __global__ void distmm_gemm_mma_tf32<float, BM, BN, BK, WM, WN, ST, MINB, TA, TB>( \
        int, int, int, float, const float*, long long, const float*, long long, float, float*, \
        long long, int);
#define DISTMM_INST(BM, BN, BK, WM, WN, ST, MINB)                 \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, false, false)      \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, false, true)       \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, true, false)       \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, true, true)
DISTMM_INST(128, 128, 32, 64, 32, 3, 1)
#endif
