// Step 12: BF16 and FP16 tensor cores. The operands are 16-bit arrays in device memory
// (bfloat16 or float16 bits; the caller converts fp32 inputs first, as cuBLAS's
// cublasGemmEx takes them), C is float32 and the accumulation is fp32. Each warp computes
// its WM x WN warp tile as (WM/16) x (WN/8) tiles of 16 x 8 with mma.sync.m16n8k16
// (.bf16 or .f16 inputs, sm_80+), twice step 11's k per instruction.
//
// Fragments move from shared memory with ldmatrix.x4 (four 8 x 8 matrices of 16-bit
// elements per instruction, one 16-byte row address per lane): a k-contiguous tile
// (A stored M x K, B stored N x K) is read as stored; an m- or n-contiguous tile (A stored
// K x M, B stored K x N) with ldmatrix.trans, which hands every lane the transposed
// elements the mma fragment wants. With g = lane / 4, t = lane % 4:
//   a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; C as in step 11.
// One ldmatrix.x4 loads an A fragment (16 x 16), or the B fragments of two n tiles (16 x 16).
// Each 8 x 8 matrix is 8 consecutive rows of one 16-byte chunk column, which the SWZ_ROW8
// swizzle of tensorcore.cuh spreads over all 32 banks, in all four layouts.
//
// Pipeline and edges as in step 11 (cp.async, zero fill; element copies when an operand is
// not 16-byte aligned).
#include "tensorcore.cuh"

namespace distmm {

template <typename T> struct mma16 { static constexpr bool valid = false; };
template <> struct mma16<distmm_bf16> { static constexpr bool valid = true; };
template <> struct mma16<distmm_fp16> { static constexpr bool valid = true; };

template <typename Tin>
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b);

template <>
__device__ __forceinline__ void mma_16x8x16<distmm_bf16>(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8x16<distmm_fp16>(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES>
struct Mma16Shape {
    static constexpr int WGM = BM / WM, WGN = BN / WN, NT = WGM * WGN * 32;
    static constexpr int MI = WM / 16, NI = WN / 8;  // mma tiles per warp tile
    static constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 2;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "tile shapes");
    static_assert(BK % 64 == 0 && BM % 64 == 0 && BN % 64 == 0, "shared rows of 128-byte multiples");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
};

template <typename Tin, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void mma16_body(int M, int N, int K, float alpha, const Tin* __restrict__ A,
                                           long long lda, const Tin* __restrict__ B, long long ldb,
                                           float beta, float* __restrict__ C, long long ldc, int flags) {
    typedef Mma16Shape<BM, BN, BK, WM, WN, STAGES> S;
    constexpr int NT = S::NT, MI = S::MI, NI = S::NI;
    extern __shared__ __align__(128) unsigned char distmm_smem[];
    Tin* As = reinterpret_cast<Tin*>(distmm_smem);
    Tin* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4;
    const int lr = lane % 8, lj = lane / 8;  // ldmatrix: the row this lane addresses, of matrix lj

    auto load_tile = [&](int kt, int stage) {
        swz_ab_tile<Tin, BM, BN, BK, NT, TA, TB, SWZ_ROW8, SWZ_ROW8>(
            As + stage * S::A_STAGE, Bs + stage * S::B_STAGE, A, lda, B, ldb, m0, n0, kt * BK,
            M, N, K, vec_a, vec_b, tid);
    };

    float acc[MI][NI][4];
    zero_acc(acc);

    const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
    const int KT = (K + BK - 1) / BK;
    cp_async_prologue<STAGES>(KT, load_tile);
    int read_stage = 0, write_stage = STAGES - 1;
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
        const unsigned as = as0 + read_stage * S::A_STAGE * 2;
        const unsigned bs = bs0 + read_stage * S::B_STAGE * 2;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned af[MI][4], bf[NI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int mb = wm * WM + i * 16;
                // matrix lj: rows mb + 8 (lj % 2), k kk + 8 (lj / 2)
                const int off = TA ? swz_offset<BM, 8, SWZ_ROW8>(kk + lr + 8 * (lj / 2), mb + 8 * (lj % 2))
                                   : swz_offset<BK, 8, SWZ_ROW8>(mb + lr + 8 * (lj % 2), kk + 8 * (lj / 2));
                ldmatrix_x4<TA>(af[i], as + off * 2);
            }
#pragma unroll
            for (int jp = 0; jp < NI / 2; ++jp) {
                const int nb = wn * WN + jp * 16;
                // matrix lj: columns nb + 8 (lj / 2), k kk + 8 (lj % 2)
                const int off = TB ? swz_offset<BK, 8, SWZ_ROW8>(nb + lr + 8 * (lj / 2), kk + 8 * (lj % 2))
                                   : swz_offset<BN, 8, SWZ_ROW8>(kk + lr + 8 * (lj % 2), nb + 8 * (lj / 2));
                unsigned r[4];
                ldmatrix_x4<!TB>(r, bs + off * 2);
                bf[2 * jp][0] = r[0]; bf[2 * jp][1] = r[1];
                bf[2 * jp + 1][0] = r[2]; bf[2 * jp + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j) mma_16x8x16<Tin>(acc[i][j], af[i], bf[j]);
        }
        read_stage = next_stage<STAGES>(read_stage);
        write_stage = next_stage<STAGES>(write_stage);
    }
    cp_async_wait<0>();
    store_mma_fragments<MI, NI>(acc, C, ldc, M, N, m0 + wm * WM, n0 + wn * WN, g, t, alpha, beta);
}

}  // namespace distmm

// Tin: distmm_bf16 or distmm_fp16 (the input format); C, alpha and beta are float32.
template <typename Tin, int BM, int BN, int BK, int WM, int WN, int STAGES, int MINB, bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_mma_bf16(int M, int N, int K, float alpha, const Tin* __restrict__ A, long long lda,
                     const Tin* __restrict__ B, long long ldb, float beta, float* __restrict__ C,
                     long long ldc, int flags) {
    static_assert(distmm::mma16<Tin>::valid, "inputs are distmm_bf16 or distmm_fp16");
    distmm::mma16_body<Tin, BM, BN, BK, WM, WN, STAGES, TA, TB>(M, N, K, alpha, A, lda, B, ldb,
                                                               beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, TA, TB)                                 \
    template __global__ void distmm_gemm_mma_bf16<T, BM, BN, BK, WM, WN, ST, MINB, TA, TB>(   \
        int, int, int, float, const T*, long long, const T*, long long, float, float*,       \
        long long, int);
#define DISTMM_INST(T, BM, BN, BK, WM, WN, ST, MINB)                 \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, true, true)
DISTMM_INST(distmm_bf16, 128, 128, 64, 64, 32, 3, 1)
DISTMM_INST(distmm_fp16, 128, 128, 64, 64, 32, 3, 1)
#endif
