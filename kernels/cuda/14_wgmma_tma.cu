// Step 14: Hopper (sm_90a) wgmma fed by the tensor memory accelerator (TMA), for BF16, FP16
// and TF32 with fp32 accumulation. Step 13 copied every 16 bytes of a k tile with a cp.async
// issued by one of 128 producer threads, into the interleaved (unswizzled) layout; here one
// producer thread asks the copy engine for whole boxes of a matrix (cp.async.bulk.tensor),
// which lands them in shared memory already in the 128-byte swizzled layout wgmma reads,
// zero-fills what lies outside the matrix, and counts the bytes on the stage's mbarrier.
//
// Tensor maps: each operand is described on the host by a CUtensorMap (the driver's
// cuTensorMapEncodeTiled, distmm.executor.tma), 2-D, box inner dimension one 128-byte
// swizzle row (64 16-bit elements, or 32 TF32 values stored as float32), passed by value as a __grid_constant__ parameter
// (the copy instruction takes its address in parameter space). The map needs a 16-byte
// aligned base and a row stride that is a multiple of 16 bytes; the loader copies an operand
// without them into an aligned buffer with padded rows first.
//
// TF32 (float32 operands the loader has rounded, ties away from zero, as step 11's): one
// instruction takes k = 8, 32 bytes of a row as 16 16-bit elements are, so the descriptors and
// their k steps below are the same bytes; PTX gives 32-bit inputs no transposed form, so both
// operands are k-major (the loader rounds an mn-major one into a transposed copy).
//
// Shared memory, per stage, in 128-byte rows of BK elements:
//   a k-major operand (A stored M x K, or B stored N x K): one box of BM (BN) rows by 64 k;
//     the wgmma descriptor's stride byte offset is 8 rows = 1024 bytes, an instruction's k
//     step (16, or 8 for TF32) adds 32 bytes to the start address (the swizzle is applied to
//     the address bits);
//   an mn-major operand (A stored K x M, B stored K x N): BM / 64 (BN / 64) boxes of 64 k
//     rows by 64 m (n); the descriptor's leading byte offset is one box (8192 bytes: the next
//     64 m or n), its stride byte offset 8 k rows (1024 bytes), a k step of 16 adds 2048
//     bytes; wgmma reads it transposed (imm-trans-a / -b).
//
// Warp specialisation as in step 13: warpgroup 0 produces (one thread issues the copies),
// warpgroups 1 .. BM/64 consume; with two consumers the producer gives registers back
// (setmaxnreg.dec) and the consumers take them (setmaxnreg.inc) for their 64 x BN
// accumulators. "full" mbarriers
// complete when a stage's bytes have landed (expect_tx), "empty" ones when every consumer
// warpgroup's wgmma reading the stage has finished; a consumer leaves one wgmma group in
// flight and hands back the stage of the group before it.
//
// The epilogue writes C (float32) from the accumulators: C = alpha acc + beta C (common.cuh's
// store_c), two neighbouring columns per 8-byte store (store_c_pair) where C allows.
#include "wgmma.cuh"

namespace distmm {

template <int BM, int BN, int BK, int STAGES, int EB>
struct TmaShape {
    static_assert(BK * EB == 128, "a k tile is one 128-byte swizzle row (EB bytes an element)");
    static constexpr int CONSUMERS = BM / 64, NT = 128 * (CONSUMERS + 1);
    static constexpr int A_BYTES = BM * BK * EB, B_BYTES = BN * BK * EB;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int BOX_BYTES = 64 * BK * EB;  // an mn-major box: 64 k rows of 64 m or n
    // + 1024 to align the stages to the swizzle pattern's 1024 bytes, + the mbarriers
    static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + STAGES * 16;
    static_assert(BM % 64 == 0 && BM >= 64 && BM <= 128, "one or two consumer warpgroups");
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N: 64, 128 or 256");
    static_assert(STAGES >= 2, "stages");
};

#if DISTMM_WGMMA
template <typename Tin, int BM, int BN, int BK, int STAGES, bool TA, bool TB>
__device__ __forceinline__ void tma_body(int M, int N, int K, float alpha, const distmm_tmap* mapA,
                                         const distmm_tmap* mapB, float beta,
                                         float* __restrict__ C, long long ldc) {
    typedef TmaShape<BM, BN, BK, STAGES, sizeof(Tin)> S;
    constexpr int KI = wgmma_input<Tin>::k;  // an instruction's k
    static_assert(!wgmma_input<Tin>::kmajor_only || (!TA && TB), "TF32: both operands k-major");
    extern __shared__ unsigned char distmm_smem[];
    const unsigned raw = smem_addr(distmm_smem);
    const unsigned a0 = (raw + 1023u) & ~1023u, b0 = a0 + STAGES * S::A_BYTES;
    const unsigned full0 = a0 + STAGES * S::STAGE_BYTES, empty0 = full0 + STAGES * 8;

    const int tid = threadIdx.x, wg = tid / 128;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const int KT = (K + BK - 1) / BK;

    if (tid == 0) {
        prefetch_tensormap(mapA);
        prefetch_tensormap(mapB);
        // full: the producer's expect_tx; empty: one thread per consumer warpgroup
        init_stage_barriers<STAGES>(full0, empty0, 1, S::CONSUMERS);
    }
    __syncthreads();

    if (wg == 0) {  // producer: one thread issues every copy
        // two consumers: their 128 accumulators a thread take the producer's registers
        if (S::CONSUMERS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            for (int kt = 0; kt < KT; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
                tma_load_tile<BM, BN, S::BOX_BYTES, TA, TB>(
                    a0 + s * S::A_BYTES, b0 + s * S::B_BYTES, mapA, mapB, full0 + 8 * s,
                    S::STAGE_BYTES, kt * BK, m0, n0);
            }
        }
    } else {  // consumers: warpgroup wg computes rows (wg - 1) * 64 .. + 63 of the block tile
        if (S::CONSUMERS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        constexpr int R = BN / 2;  // accumulators a thread: 64 x BN over 128 threads
        float d[R];
#pragma unroll
        for (int i = 0; i < R; ++i) d[i] = 0.0f;
        const int c = wg - 1;
        // this warpgroup's 64 rows of A: 64 rows of 128 bytes (k-major) or the c-th box
        const unsigned a_part = TA ? c * S::BOX_BYTES : c * 64 * 128;
        constexpr unsigned KSTEP_K = 32, KSTEP_MN = KI * 128;  // bytes an instruction's k moves
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
            fence_operands<R>(d);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            const unsigned as = a0 + s * S::A_BYTES + a_part, bs = b0 + s * S::B_BYTES;
#pragma unroll
            for (int kk = 0; kk < BK / KI; ++kk) {
                const unsigned long long da = TA
                    ? wgmma_desc(as + kk * KSTEP_MN, S::BOX_BYTES, 1024, 1)
                    : wgmma_desc(as + kk * KSTEP_K, 16, 1024, 1);
                const unsigned long long db = TB
                    ? wgmma_desc(bs + kk * KSTEP_K, 16, 1024, 1)
                    : wgmma_desc(bs + kk * KSTEP_MN, S::BOX_BYTES, 1024, 1);
                Wgmma<BN>::template mma<Tin, TA ? 1 : 0, TB ? 0 : 1>(d, da, db, 1);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            // one group left running; the one before it has read its stage: hand that back
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            fence_operands<R>(d);
            if (kt > 0 && tid % 128 == 0) mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands<R>(d);

        // d[4j + 2h + e] = C[16 w + g + 8h][8j + 2t + e] of the warpgroup's 64 x BN tile
        const int w = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
        const bool pairs = ((reinterpret_cast<unsigned long long>(C) & 7) == 0) && (ldc % 2 == 0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + c * 64 + 16 * w + g + 8 * h;
            if (row >= M) continue;
            float* crow = C + (long long)row * ldc;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = n0 + 8 * j + 2 * t;
                if (pairs && col + 1 < N) {
                    store_c_pair(crow, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], alpha, beta);
                } else {
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (col + e < N) store_c(crow, col + e, d[4 * j + 2 * h + e], alpha, beta);
                }
            }
        }
    }
}
#endif  // DISTMM_WGMMA

}  // namespace distmm

// Tin: distmm_bf16, distmm_fp16 or float (TF32 values, TA false and TB true only); C, alpha
// and beta are float32. mapA / mapB describe A and
// B as stored (TA: A stored K x M; TB: B stored N x K), with the boxes the loader sets
// (distmm.executor.tma.box_for).
template <typename Tin, int BM, int BN, int BK, int STAGES, bool TA, bool TB>
__global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)
distmm_gemm_wgmma_tma(int M, int N, int K, float alpha, const __grid_constant__ distmm_tmap mapA,
                      const __grid_constant__ distmm_tmap mapB, float beta, float* __restrict__ C,
                      long long ldc) {
    static_assert(distmm::wgmma_input<Tin>::valid, "inputs are distmm_bf16, distmm_fp16 or float");
    (void)distmm::TmaShape<BM, BN, BK, STAGES, sizeof(Tin)>::SMEM_BYTES;
#if DISTMM_WGMMA
    distmm::tma_body<Tin, BM, BN, BK, STAGES, TA, TB>(M, N, K, alpha, &mapA, &mapB, beta, C, ldc);
#else
    __trap();  // not built for sm_90a: the registry never launches this build
#endif
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, ST, TA, TB)                                                 \
    template __global__ void distmm_gemm_wgmma_tma<T, BM, BN, BK, ST, TA, TB>(                  \
        int, int, int, float, const __grid_constant__ distmm_tmap,                              \
        const __grid_constant__ distmm_tmap, float, float*, long long);
#define DISTMM_INST(T, BM, BN, BK, ST)                 \
    DISTMM_INST2(T, BM, BN, BK, ST, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, ST, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, ST, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, ST, true, true)
DISTMM_INST(distmm_bf16, 128, 256, 64, 4)
DISTMM_INST(distmm_fp16, 128, 256, 64, 4)
DISTMM_INST2(float, 128, 256, 32, 4, false, true)
#endif
