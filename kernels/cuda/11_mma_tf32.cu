// Step 11: TF32 tensor cores for float32. Each warp computes its WM x WN warp tile as
// (WM/16) x (WN/8) tiles of 16 x 8 with mma.sync.m16n8k8 (tf32 inputs, fp32 accumulate,
// sm_80+) instead of step 8's SIMT FFMA. The operands stay fp32 in global and shared memory,
// already rounded to TF32 (10 explicit mantissa bits; round to nearest, ties away from zero,
// as cuBLAS rounds for CUBLAS_COMPUTE_32F_FAST_TF32): launch_tc rounds them in one
// elementwise pass before the launch, as step 12's operands are converted, so the k loop has
// no conversion (the tensor cores ignore the 13 low bits, which the rounding zeroed). This is
// a lower-precision kernel: precision "tf32" only, never the float32 "highest" path (steps
// 8-9 keep that).
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

template <int BM, int BN, int BK, int WM, int WN, int STAGES>
struct Tf32Shape {
    static constexpr int WGM = BM / WM, WGN = BN / WN, NT = WGM * WGN * 32;
    static constexpr int MI = WM / 16, NI = WN / 8;  // mma tiles per warp tile
    static constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 4;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "tile shapes");
    static_assert(BK % 32 == 0 && BM % 32 == 0 && BN % 32 == 0, "shared rows of 128-byte multiples");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
};

// The lane's 32-bit ld.shared offsets (bytes within a SWZ_ROW4 stage) in an m- or
// n-contiguous tile (rows k, COLS floats): lane (g, t) reads column base + 8 q + g of row
// kk + t (and kk + t + 4); that column's chunk c is stored at c ^ 2t (row & 3 = t). Column
// groups q and q + 4 are 8 chunks apart, which the swizzle (bits 1-2 of c) leaves alone when
// base is a multiple of 32: then 4 registers serve every q (at() adds 128 bytes per 4), and
// the k rows are immediates.
template <int NQ, int WIDTH>
struct LdsOffsets {
    static constexpr int NR = (NQ > 4 && WIDTH % 32 == 0) ? 4 : NQ;
    unsigned off[NR];
    template <int COLS>
    __device__ __forceinline__ void init(int base, int g, int t) {
#pragma unroll
        for (int q = 0; q < NR; ++q) {
            const int col = base + 8 * q + g;
            off[q] = (unsigned)((t * COLS + (((col / 4) ^ (2 * t)) * 4 + col % 4)) * 4);
        }
    }
    __device__ __forceinline__ unsigned at(int q) const { return off[q % NR] + (q / NR) * 128; }
};

__device__ __forceinline__ unsigned lds32(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int LOOP, bool TA, bool TB>
__device__ __forceinline__ void tf32_body(int M, int N, int K, float alpha, const float* __restrict__ A,
                                          long long lda, const float* __restrict__ B, long long ldb,
                                          float beta, float* __restrict__ C, long long ldc, int flags) {
    typedef Tf32Shape<BM, BN, BK, WM, WN, STAGES> S;
    constexpr int NT = S::NT, MI = S::MI, NI = S::NI, KS = BK / 8;
    extern __shared__ __align__(128) unsigned char distmm_smem[];
    float* As = reinterpret_cast<float*>(distmm_smem);
    float* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4, lj = lane / 8;

    // global -> shared: k-contiguous tiles SWZ_ROW8, m/n-contiguous ones SWZ_ROW4
    constexpr bool AK = !TA, BKC = TB;
    constexpr int ASWZ = AK ? SWZ_ROW8 : SWZ_ROW4, BSWZ = BKC ? SWZ_ROW8 : SWZ_ROW4;
    typedef SwzInterior<float, AK ? BM : BK, AK ? BK : BM, NT, ASWZ> AF;
    typedef SwzInterior<float, BKC ? BN : BK, BKC ? BK : BN, NT, BSWZ> BF;
    const bool a_fast = vec_a && m0 + BM <= M, b_fast = vec_b && n0 + BN <= N;
    const float* a_src = swz_operand_src<float, BM, BK, NT, ASWZ, AK>(A, lda, m0, tid);
    const float* b_src = swz_operand_src<float, BN, BK, NT, BSWZ, BKC>(B, ldb, n0, tid);
    const unsigned a_dst = AF::dst(tid), b_dst = BF::dst(tid);
    const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
    auto load_tile = [&](int kt, int stage) {
        swz_operand_tile<float, BM, BK, NT, ASWZ, AK>(As + stage * S::A_STAGE, as0 + stage * S::A_STAGE * 4,
                                                       A, lda, m0, M, kt * BK, K, vec_a, a_fast,
                                                       a_src, a_dst, tid);
        swz_operand_tile<float, BN, BK, NT, BSWZ, BKC>(Bs + stage * S::B_STAGE, bs0 + stage * S::B_STAGE * 4,
                                                        B, ldb, n0, N, kt * BK, K, vec_b, b_fast,
                                                        b_src, b_dst, tid);
    };

    // shared -> registers. k-contiguous tiles: ldmatrix.x4 (non-transposed; a 16-byte row
    // of 4 floats is 8 16-bit elements, and lane (g, t) receives word t of row g, the tf32
    // fragment's element); m/n-contiguous tiles: one ld.shared.b32 per element.
    unsigned a_off[KS], b_off[KS];  // ldmatrix: a register per k step
    LdsOffsets<2 * MI, WM> a_lds;      // ld.shared: column groups of 8
    LdsOffsets<NI, WN> b_lds;
    if (AK) ldsm_offsets<true, KS, BK, BM, 4>(a_off, wm * WM, lane, lj % 2, lj / 2);
    else    a_lds.template init<BM>(wm * WM, g, t);
    if (BKC) ldsm_offsets<true, KS, BK, BN, 4>(b_off, wn * WN, lane, lj / 2, lj % 2);
    else     b_lds.template init<BN>(wn * WN, g, t);

    float acc[MI][NI][4];
    zero_acc(acc);
    constexpr int NB = LOOP ? 2 : 1;  // fragment buffers (mma_mainloop alternates two)
    unsigned af[NB][MI][4], bf[NB][NI][2];
    auto load_frags = [&](int stage, int s, int buf) {
        const unsigned sa = as0 + stage * S::A_STAGE * 4, sb = bs0 + stage * S::B_STAGE * 4;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
            if (AK) {
                ldmatrix_x4<false>(af[buf][i], sa + a_off[s] + i * 16 * BK * 4);
            } else {  // rows k = 8 s + t (+ 4), columns m = wm WM + 16 i + g (+ 8)
                af[buf][i][0] = lds32(sa + a_lds.at(2 * i) + s * 8 * BM * 4);
                af[buf][i][1] = lds32(sa + a_lds.at(2 * i + 1) + s * 8 * BM * 4);
                af[buf][i][2] = lds32(sa + a_lds.at(2 * i) + (s * 8 + 4) * BM * 4);
                af[buf][i][3] = lds32(sa + a_lds.at(2 * i + 1) + (s * 8 + 4) * BM * 4);
            }
        }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
            if (BKC) {
                if (j % 2 == 0) {
                    unsigned r[4];
                    ldmatrix_x4<false>(r, sb + b_off[s] + (j / 2) * 16 * BK * 4);
                    bf[buf][j][0] = r[0]; bf[buf][j][1] = r[1];
                    bf[buf][j + 1][0] = r[2]; bf[buf][j + 1][1] = r[3];
                }
            } else {  // rows k = 8 s + t (+ 4), column n = wn WN + 8 j + g
                bf[buf][j][0] = lds32(sb + b_lds.at(j) + s * 8 * BN * 4);
                bf[buf][j][1] = lds32(sb + b_lds.at(j) + (s * 8 + 4) * BN * 4);
            }
        }
    };
    auto mma_step = [&](int buf) {
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j) mma_tf32_16x8x8(acc[i][j], af[buf][i], bf[buf][j]);
    };
    const int KT = (K + BK - 1) / BK;
    if (LOOP) {
        mma_mainloop<STAGES, KS>(KT, load_tile, load_frags, mma_step);
    } else {
        cp_async_prologue<STAGES>(KT, load_tile);
        int read_stage = 0, write_stage = STAGES - 1;
        for (int kt = 0; kt < KT; ++kt) {
            cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                load_frags(read_stage, s, 0);
                mma_step(0);
            }
            read_stage = next_stage<STAGES>(read_stage);
            write_stage = next_stage<STAGES>(write_stage);
        }
        cp_async_wait<0>();
    }
    store_mma_fragments<MI, NI>(acc, C, ldc, M, N, m0 + wm * WM, n0 + wn * WN, g, t, alpha, beta);
}

}  // namespace distmm

// T is float (the registry's only dtype for this step); the template keeps distmm's one
// kernel signature and name mangling.
template <typename T, int BM, int BN, int BK, int WM, int WN, int STAGES, int MINB, int LOOP, bool TA,
          bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_mma_tf32(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                     const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                     long long ldc, int flags) {
    static_assert(distmm::same_type<T, float>::value, "TF32 tensor cores take float32 operands");
    distmm::tf32_body<BM, BN, BK, WM, WN, STAGES, LOOP, TA, TB>(M, N, K, alpha, A, lda, B, ldb,
                                                                beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, LOOP, TA, TB)                                    \
    template __global__ void distmm_gemm_mma_tf32<float, BM, BN, BK, WM, WN, ST, MINB, LOOP, TA, TB>( \
        int, int, int, float, const float*, long long, const float*, long long, float, float*, \
        long long, int);
#define DISTMM_INST(BM, BN, BK, WM, WN, ST, MINB, LOOP)                 \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, LOOP, false, false)      \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, LOOP, false, true)       \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, LOOP, true, false)       \
    DISTMM_INST2(BM, BN, BK, WM, WN, ST, MINB, LOOP, true, true)
DISTMM_INST(128, 128, 32, 64, 64, 3, 1, 1)
#endif
