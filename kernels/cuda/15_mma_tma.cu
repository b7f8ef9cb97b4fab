// Step 15: step 12's mma.sync (m16n8k16, BF16/FP16 in, fp32 accumulate) fed by the tensor
// memory accelerator (TMA), as step 14 feeds wgmma; and step 11's TF32 mma.sync (m16n8k8) fed
// the same way. In step 12 every thread computed the
// shared and global address of each 16-byte chunk it copied with cp.async, and at the tile
// boundary those address instructions waited on the copies before them; here one thread
// (an elected lane of warp 0) asks the copy engine for whole boxes
// (cp.async.bulk.tensor), which land already in the 128-byte swizzled layout, zero-filled
// outside the matrix, and count their bytes on the stage's "full" mbarrier. The other
// threads keep only mma and ldmatrix in the k loop.
//
// TF32 (float32 operands the loader has rounded, as step 11's): a 128-byte row holds 32 values
// instead of 64, a k step is 8 of them instead of 16, the same 32 bytes; both operands are
// k-major (the loader rounds an mn-major one into a transposed copy), so every fragment is
// read with ldmatrix, as step 11 reads its k-contiguous tiles, from byte for byte the layout
// of a k-major 16-bit stage.
//
// Shared memory per stage, in 128-byte rows of BK elements, each 1024-byte group of 8 rows
// swizzled by the copy engine (chunk c of row r stored at chunk c ^ (r & 7)):
//   a k-major operand (A stored M x K, B stored N x K): one box of BM (BN) rows by 64 k,
//     exactly step 12's SWZ_ROW8 tile with BK = 64, read with the same ldsm_offsets;
//   an mn-major operand (A stored K x M, B stored K x N): BM / 64 (BN / 64) boxes of 64 k
//     rows by 64 m (n), 8192 bytes each; ldmatrix.trans reads it, each lane's address a box,
//     a row of 128 bytes and a swizzled chunk (ldsm_offsets_boxed).
// The tensor maps are step 14's (distmm.executor.tma.box_for).
//
// The main loop is step 12's (mma_mainloop's order) with the copies handed to the copy
// engine: at each tile boundary, once every warp has read tile kt's stage into registers,
// one lane of warp 0 queues tile kt + STAGES into that stage (after a proxy fence: the
// warps' ldmatrix reads and the copy engine's writes are ordered by nothing else), and every
// warp waits on the next stage's full mbarrier before reading its first fragments, which tile
// kt's last mma hide. How a stage is handed back (SYNC): 0, the block's barrier; 1, an
// "empty" mbarrier each stage, on which each warp arrives once it has read the stage, so
// that only warp 0 waits for the slowest. With 0 and 1 no warp is set apart as a producer:
// two blocks of four warps share an SM as in step 12.
//
// SYNC 2 sets a producer warpgroup apart, as step 14 does: 128 threads more a block, one
// lane of which issues every copy, waiting on a stage's empty mbarrier (one arrival a
// computing warp) before it refills the stage; the computing warps wait only on the full
// mbarriers, never on one another. The producer gives its registers to the computing warps
// (setmaxnreg, sm_90a: 40 for the producer, 216 for the others, so that two blocks of 256
// threads still fit an SM's 64K registers with 64 x 64 warp tiles). A plain sm_90 build (CI's
// compile check) has no setmaxnreg, and its SYNC 2 code spills; the registry builds step 15
// for sm_90a only.
// wgmma.cuh for DISTMM_WGMMA: built for sm_90a, where setmaxnreg exists
#include "tma.cuh"
#include "wgmma.cuh"

namespace distmm {

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int ES, int SYNC = 0>
struct MmaTmaShape {
    // NC computing threads, + a producer warpgroup with SYNC 2
    static constexpr int WGM = BM / WM, WGN = BN / WN, NC = WGM * WGN * 32;
    static constexpr int NT = NC + (SYNC == 2 ? 128 : 0);
    // k steps a tile: 32 bytes of k each (16 BF16/FP16 values, 8 TF32)
    static constexpr int MI = WM / 16, NI = WN / 8, KS = BK * ES / 32;
    static constexpr int A_BYTES = BM * BK * ES, B_BYTES = BN * BK * ES;
    static constexpr int BOX_BYTES = 64 * BK * ES;  // an mn-major box: 64 k rows of 64 m or n
    // + 1024 to align the stages to the swizzle pattern's 1024 bytes, + a full and an empty
    // mbarrier each
    static constexpr int SMEM_BYTES = 1024 + STAGES * (A_BYTES + B_BYTES) + STAGES * 16;
    static_assert(BK * ES == 128, "a k tile is one 128-byte swizzle row");
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "tile shapes");
    static_assert(BM % 64 == 0 && BN % 64 == 0 && BM <= 256 && BN <= 256, "boxes of 64, at most 256 rows");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
    static_assert(SYNC != 2 || NC % 128 == 0, "SYNC 2: whole warpgroups of computing warps");
};

// The lane's ldmatrix.x4 addresses in an mn-major stage of 64-column boxes (BOX bytes each,
// rows of 128 bytes): as ldsm_offsets' m/n-contiguous case, whose 16-byte chunk e of k row
// r sat at r * COLS * 2 + ((e ^ x) << 4), with chunk e now in box e / 8 at chunk (e ^ x) % 8.
// A k step of 16 rows adds 16 * 128 bytes.
template <int N_OFF, int BOX>
__device__ __forceinline__ void ldsm_offsets_boxed(unsigned (&off)[N_OFF], int base, int lane,
                                                   int rsel, int csel) {
    const int lr = lane % 8, x = csel ^ lr;
#pragma unroll
    for (int q = 0; q < N_OFF; ++q) {
        const int e = (base + 16 * q) / 8;
        off[q] = (unsigned)((e / 8) * BOX + (lr + 8 * rsel) * 128 + (((e ^ x) & 7) << 4));
    }
}

#if DISTMM_TMA
template <typename Tin, int BM, int BN, int BK, int WM, int WN, int STAGES, int SYNC, bool TA, bool TB>
__device__ __forceinline__ void mma_tma_body(int M, int N, int K, float alpha,
                                             const distmm_tmap* mapA, const distmm_tmap* mapB,
                                             float beta, float* __restrict__ C, long long ldc) {
    typedef MmaTmaShape<BM, BN, BK, WM, WN, STAGES, sizeof(Tin), SYNC> S;
    constexpr int MI = S::MI, NI = S::NI, KS = S::KS;
    constexpr bool TF32 = same_type<Tin, float>::value;
    static_assert(!TF32 || (!TA && TB), "TF32: both operands k-major");
    constexpr int BK16 = BK * sizeof(Tin) / 2;  // a row's bytes in 16-bit elements
    extern __shared__ unsigned char distmm_smem[];
    // Everything a branch below needs is computed inside it: a value held across setmaxnreg
    // (SYNC 2) is spilled, and reloaded in the k loop.
    auto smem0 = [&]() { return (smem_addr(distmm_smem) + 1023u) & ~1023u; };
    constexpr unsigned B_OFF = STAGES * S::A_BYTES, FULL_OFF = B_OFF + STAGES * S::B_BYTES,
                       EMPTY_OFF = FULL_OFF + 8 * STAGES;

    if (threadIdx.x < 32 && elect_one()) {
        const unsigned s0 = smem0();
        prefetch_tensormap(mapA);
        prefetch_tensormap(mapB);
        init_stage_barriers<STAGES, SYNC != 0>(s0 + FULL_OFF, s0 + EMPTY_OFF, 1, S::NC / 32);
    }
    __syncthreads();

    if (SYNC == 2 && threadIdx.x >= S::NC) {  // the producer warpgroup
#if DISTMM_WGMMA
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
        if (threadIdx.x / 32 == S::NC / 32 && elect_one()) {
            const unsigned as0 = smem0(), bs0 = as0 + B_OFF, full0 = as0 + FULL_OFF,
                           empty0 = as0 + EMPTY_OFF;
            int m0, n0;
            grouped_tile_origin<BM, BN>(M, N, m0, n0);
            const int KT = (K + BK - 1) / BK;
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt) {
                const int st = kt % STAGES;
                if (kt >= STAGES) {
                    mbar_wait(empty0 + 8 * st, ((kt / STAGES) - 1) & 1);
                    fence_proxy_async();  // the warps' reads of the stage before the copy
                }
                tma_load_tile<BM, BN, S::BOX_BYTES, TA, TB>(
                    as0 + st * S::A_BYTES, bs0 + st * S::B_BYTES, mapA, mapB, full0 + 8 * st,
                    S::A_BYTES + S::B_BYTES, kt * BK, m0, n0);
            }
        }
        return;
    }
#if DISTMM_WGMMA
    if (SYNC == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
#endif
    const unsigned as0 = smem0(), bs0 = as0 + B_OFF, full0 = as0 + FULL_OFF,
                   empty0 = as0 + EMPTY_OFF;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const int KT = (K + BK - 1) / BK;
    // the warp's index through a shuffle: the compiler then knows it is warp-uniform
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0), lane = threadIdx.x % 32;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int g = lane / 4, t = lane % 4, lj = lane / 8;

    // one elected lane of warp 0 only: tile kt's boxes of A and B into stage `stage`
    auto load_tile = [&](int kt, int stage) {
        tma_load_tile<BM, BN, S::BOX_BYTES, TA, TB>(
            as0 + stage * S::A_BYTES, bs0 + stage * S::B_BYTES, mapA, mapB, full0 + 8 * stage,
            S::A_BYTES + S::B_BYTES, kt * BK, m0, n0);
    };

    // shared -> registers: A's fragment i of k step s, B's pair jp (two n tiles) of step s
    constexpr bool AK = !TA, BKC = TB;
    constexpr int AN = AK ? KS : MI, BNO = BKC ? KS : NI / 2;
    unsigned a_off[AN], b_off[BNO];
    if (AK) ldsm_offsets<true, AN, BK16, BM, 2>(a_off, wm * WM, lane, lj % 2, lj / 2);
    else    ldsm_offsets_boxed<AN, S::BOX_BYTES>(a_off, wm * WM, lane, lj / 2, lj % 2);
    if (BKC) ldsm_offsets<true, BNO, BK16, BN, 2>(b_off, wn * WN, lane, lj / 2, lj % 2);
    else     ldsm_offsets_boxed<BNO, S::BOX_BYTES>(b_off, wn * WN, lane, lj % 2, lj / 2);
    constexpr unsigned KSTEP_MN = 16 * 128;  // bytes a k step of 16 moves in an mn-major box

    float acc[MI][NI][4];
    zero_acc(acc);
    unsigned af[2][MI][4], bf[2][NI][2];
    auto load_frags = [&](int stage, int s, int buf) {
        mma16_load_frags<TA, TB, BK16, KSTEP_MN, KSTEP_MN>(af[buf], bf[buf], as0 + stage * S::A_BYTES,
                                                         bs0 + stage * S::B_BYTES, a_off, b_off, s);
    };
    auto mma_step = [&](int buf) { mma16_step<Tin>(acc, af[buf], bf[buf]); };

    if (SYNC != 2 && warp == 0) {
        if (elect_one()) {
#pragma unroll 1
            for (int st = 0; st < STAGES && st < KT; ++st) load_tile(st, st);
        }
        __syncwarp();
    }
    int stage = 0;
    if (KT > 0) {
        mbar_wait(full0, 0);
        load_frags(0, 0, 0);
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            if (s == KS - 1) {  // every warp has read tile kt's stage: it may be refilled
                if (SYNC == 0) {
                    __syncthreads();
                } else {
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty0 + 8 * stage);
                    if (SYNC == 1 && warp == 0 && kt + STAGES < KT)
                        mbar_wait(empty0 + 8 * stage, (kt / STAGES) & 1);
                }
                if (SYNC != 2 && warp == 0 && kt + STAGES < KT) {
                    if (elect_one()) {
                        fence_proxy_async();  // the warps' reads of the stage before the copy
                        load_tile(kt + STAGES, stage);
                    }
                    __syncwarp();
                }
                stage = next_stage<STAGES>(stage);
                if (kt + 1 < KT) {
                    mbar_wait(full0 + 8 * stage, ((kt + 1) / STAGES) & 1);
                    load_frags(stage, 0, 0);
                }
            } else {
                load_frags(stage, s + 1, (s + 1) % 2);
            }
            mma_step(s % 2);
        }
    }
    store_mma_fragments<MI, NI>(acc, C, ldc, M, N, m0 + wm * WM, n0 + wn * WN, g, t, alpha, beta);
}
#endif  // DISTMM_TMA

}  // namespace distmm

// Tin: distmm_bf16, distmm_fp16 or float (TF32 values; TA false and TB true only); C, alpha
// and beta are float32. mapA / mapB describe A and
// B as stored (TA: A stored K x M; TB: B stored N x K), with step 14's boxes
// (distmm.executor.tma.box_for).
template <typename Tin, int BM, int BN, int BK, int WM, int WN, int STAGES, int MINB, int SYNC,
          bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32 + (SYNC == 2 ? 128 : 0), MINB)
distmm_gemm_mma_tma(int M, int N, int K, float alpha, const __grid_constant__ distmm_tmap mapA,
                    const __grid_constant__ distmm_tmap mapB, float beta, float* __restrict__ C,
                    long long ldc) {
    static_assert(distmm::mma16<Tin>::valid || distmm::same_type<Tin, float>::value,
                  "inputs are distmm_bf16, distmm_fp16 or float");
    static_assert(SYNC >= 0 && SYNC <= 2,
                  "SYNC: 0 (block barrier), 1 (empty mbarriers) or 2 (a producer warpgroup)");
    (void)distmm::MmaTmaShape<BM, BN, BK, WM, WN, STAGES, sizeof(Tin), SYNC>::SMEM_BYTES;
#if DISTMM_TMA
    distmm::mma_tma_body<Tin, BM, BN, BK, WM, WN, STAGES, SYNC, TA, TB>(M, N, K, alpha, &mapA, &mapB,
                                                                 beta, C, ldc);
#else
    __trap();  // no TMA below compute capability 9.0: the registry never launches this build
#endif
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, SY, TA, TB)                             \
    template __global__ void distmm_gemm_mma_tma<T, BM, BN, BK, WM, WN, ST, MINB, SY, TA, TB>(\
        int, int, int, float, const __grid_constant__ distmm_tmap,                            \
        const __grid_constant__ distmm_tmap, float, float*, long long);
#define DISTMM_INST(T, BM, BN, BK, WM, WN, ST, MINB, SY)                 \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, SY, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, SY, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, SY, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, ST, MINB, SY, true, true)
DISTMM_INST(distmm_bf16, 128, 128, 64, 64, 64, 3, 1, 0)
DISTMM_INST(distmm_fp16, 128, 128, 64, 64, 64, 3, 1, 0)
DISTMM_INST(distmm_bf16, 128, 128, 64, 64, 64, 3, 1, 1)
DISTMM_INST(distmm_bf16, 128, 128, 64, 64, 64, 3, 2, 2)
DISTMM_INST2(float, 256, 128, 32, 64, 64, 3, 1, 0, false, true)
DISTMM_INST2(float, 256, 128, 32, 64, 64, 3, 1, 2, false, true)
#endif
