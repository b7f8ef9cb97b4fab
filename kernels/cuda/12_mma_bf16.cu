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
// Addresses are computed once per thread: the copies of interior tiles are cp.async at fixed
// strides (SwzInterior; edge tiles zero-fill, element copies when an operand is not 16-byte
// aligned), and each ldmatrix address is a register plus an immediate (ldsm_offsets), so
// the k loop is mostly mma and ldmatrix. The main loop (mma_mainloop) reads k step s + 1's
// fragments while step s's mma issue.
#include "tensorcore.cuh"

namespace distmm {

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
    constexpr int NT = S::NT, MI = S::MI, NI = S::NI, KS = BK / 16;
    extern __shared__ __align__(128) unsigned char distmm_smem[];
    Tin* As = reinterpret_cast<Tin*>(distmm_smem);
    Tin* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4, lj = lane / 8;

    // global -> shared: A is k-contiguous unless TA, B unless !TB (stored k x n)
    constexpr bool AK = !TA, BKC = TB;
    typedef SwzInterior<Tin, AK ? BM : BK, AK ? BK : BM, NT, SWZ_ROW8> AF;
    typedef SwzInterior<Tin, BKC ? BN : BK, BKC ? BK : BN, NT, SWZ_ROW8> BF;
    const bool a_fast = vec_a && m0 + BM <= M, b_fast = vec_b && n0 + BN <= N;
    const Tin* a_src = swz_operand_src<Tin, BM, BK, NT, SWZ_ROW8, AK>(A, lda, m0, tid);
    const Tin* b_src = swz_operand_src<Tin, BN, BK, NT, SWZ_ROW8, BKC>(B, ldb, n0, tid);
    const unsigned a_dst = AF::dst(tid), b_dst = BF::dst(tid);
    const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
    auto load_tile = [&](int kt, int stage) {
        swz_operand_tile<Tin, BM, BK, NT, SWZ_ROW8, AK>(As + stage * S::A_STAGE, as0 + stage * S::A_STAGE * 2,
                                                         A, lda, m0, M, kt * BK, K, vec_a, a_fast,
                                                         a_src, a_dst, tid);
        swz_operand_tile<Tin, BN, BK, NT, SWZ_ROW8, BKC>(Bs + stage * S::B_STAGE, bs0 + stage * S::B_STAGE * 2,
                                                          B, ldb, n0, N, kt * BK, K, vec_b, b_fast,
                                                          b_src, b_dst, tid);
    };

    // shared -> registers: A's fragment i of k step s, B's pair jp (two n tiles) of step s
    constexpr int AN = AK ? KS : MI, BNO = BKC ? KS : NI / 2;
    unsigned a_off[AN], b_off[BNO];
    if (AK) ldsm_offsets<true, AN, BK, BM, 2>(a_off, wm * WM, lane, lj % 2, lj / 2);
    else    ldsm_offsets<false, AN, BK, BM, 2>(a_off, wm * WM, lane, lj / 2, lj % 2);
    if (BKC) ldsm_offsets<true, BNO, BK, BN, 2>(b_off, wn * WN, lane, lj / 2, lj % 2);
    else     ldsm_offsets<false, BNO, BK, BN, 2>(b_off, wn * WN, lane, lj % 2, lj / 2);

    float acc[MI][NI][4];
    zero_acc(acc);
    unsigned af[2][MI][4], bf[2][NI][2];
    auto load_frags = [&](int stage, int s, int buf) {
        mma16_load_frags<TA, TB, BK, 16 * BM * 2, 16 * BN * 2>(
            af[buf], bf[buf], as0 + stage * S::A_STAGE * 2, bs0 + stage * S::B_STAGE * 2, a_off,
            b_off, s);
    };
    auto mma_step = [&](int buf) { mma16_step<Tin>(acc, af[buf], bf[buf]); };
    mma_mainloop<STAGES, KS>((K + BK - 1) / BK, load_tile, load_frags, mma_step);
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
DISTMM_INST(distmm_bf16, 128, 128, 64, 64, 64, 3, 1)
DISTMM_INST(distmm_fp16, 128, 128, 64, 64, 64, 3, 1)
#endif
