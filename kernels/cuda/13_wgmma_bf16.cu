// Step 13: Hopper (sm_90a) warpgroup MMA for BF16 and FP16. A warpgroup (4 warps, 128
// threads) issues wgmma.mma_async m64nNk16 (N = BN, fp32 accumulate), whose operands the
// tensor cores read straight from shared memory through 64-bit matrix descriptors, so no
// fragment passes through registers; the instruction is asynchronous and a warpgroup keeps
// issuing while earlier ones run.
//
// Warp specialisation: warpgroup 0 is the producer, which only copies k tiles of op(A)
// (BM x BK) and op(B) (BK x BN) into a ring of STAGES shared-memory stages; warpgroups
// 1 .. BM/64 are consumers, each computing 64 rows of the BM x BN block tile. Two mbarriers
// per stage hand the stage back and forth: "full" (the producer's 128 threads arrive, each
// once its cp.async copies have landed: cp.async.mbarrier.arrive.noinc) and "empty" (every
// consumer thread arrives once its wgmma reading the stage has completed).
//
// Copies: cp.async (16 bytes a thread, zero-filled at the matrix edges, so any m, n, k),
// not TMA: step 14 takes that step (tensor maps made by the driver through ctypes, the
// copy engine's 128-byte swizzle). Operands that are not 16-byte aligned are copied element
// by element.
//
// Shared-memory layout: wgmma's "interleaved" (no swizzle) canonical layout. The tile is cut
// into core matrices of 8 rows x 16 bytes, 128 contiguous bytes each; a k-major operand
// (A stored M x K, B stored N x K) has rows along m (n) and 8 k a row, an mn-major operand
// (A stored K x M, B stored K x N) has rows along k and 8 m (n) a row, read with the
// descriptor's transpose bit (imm-trans-a / -b). In both, the core matrix (mn / 8, k / 8)
// lies at (mn / 8 * BK / 8 + k / 8) * 128 bytes: the descriptor's leading byte offset (next
// core matrix along k) is 128 and its stride byte offset (next along m or n) BK / 8 * 128.
//
// Built only for sm_90a (wgmma is in the architecture-specific feature set, not in sm_90):
// the registry chooses it on compute capability 9.0 alone and the loader compiles it with
// nvcc -arch=sm_90a. Other targets (CI's -arch=sm_90
// and sm_80 checks) compile a body that traps.
#include "wgmma.cuh"

namespace distmm {

template <int BM, int BN, int BK, int STAGES>
struct WgmmaShape {
    static constexpr int CONSUMERS = BM / 64, NT = 128 * (CONSUMERS + 1);
    static constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements
    static constexpr int STAGE_BYTES = (A_STAGE + B_STAGE) * 2;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGES * 16;  // + the mbarriers
    static constexpr unsigned LBO = 128, SBO = BK / 8 * 128;
    static_assert(BM % 64 == 0 && BM <= 256 && BK % 16 == 0, "tile shapes");
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N: 64, 128 or 256");
    static_assert(STAGES >= 2, "stages");
};

#if DISTMM_WGMMA
// Element offset of the 16-byte chunk at (row, chunk) of a stored tile in the core-matrix
// layout: KMAJOR rows run along m (n) and chunks along k; otherwise rows run along k and
// chunks along m (n).
template <bool KMAJOR, int BK>
__device__ __forceinline__ int core_offset(int row, int chunk) {
    return KMAJOR ? ((row / 8) * (BK / 8) + chunk) * 64 + (row % 8) * 8
                  : (chunk * (BK / 8) + row / 8) * 64 + (row % 8) * 8;
}

// The producer's share of one stored ROWS x COLS tile (COLS contiguous in global memory).
template <typename T, int ROWS, int COLS, bool KMAJOR, int BK>
__device__ __forceinline__ void core_tile_copy(T* __restrict__ s, const T* __restrict__ g, long long ld,
                                               int row0, int col0, int row_lim, int col_lim,
                                               bool vec, int ptid) {
    constexpr int CH = COLS / 8, CHUNKS = ROWS * CH, ITERS = (CHUNKS + 127) / 128;
#pragma unroll 4
    for (int it = 0; it < ITERS; ++it) {
        const int ch = ptid + it * 128;
        if (CHUNKS % 128 != 0 && ch >= CHUNKS) break;
        const int r = ch / CH, c = ch % CH;
        const int gr = row0 + r, gc = col0 + c * 8;
        T* dst = s + core_offset<KMAJOR, BK>(r, c);
        if (vec) {
            int n = gr < row_lim ? col_lim - gc : 0;
            n = n < 0 ? 0 : (n > 8 ? 8 : n);
            cp_async16(dst, n ? g + (long long)gr * ld + gc : g, n * 2);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                T x;
                if (gr < row_lim && gc + e < col_lim) x = g[(long long)gr * ld + gc + e];
                else x = T{};
                dst[e] = x;
            }
        }
    }
}

template <typename Tin, int BM, int BN, int BK, int STAGES, int INFLIGHT, bool TA, bool TB>
__device__ __forceinline__ void wgmma_body(int M, int N, int K, float alpha, const Tin* __restrict__ A,
                                           long long lda, const Tin* __restrict__ B, long long ldb,
                                           float beta, float* __restrict__ C, long long ldc, int flags) {
    typedef WgmmaShape<BM, BN, BK, STAGES> S;
    extern __shared__ __align__(1024) unsigned char distmm_smem[];
    Tin* As = reinterpret_cast<Tin*>(distmm_smem);
    Tin* Bs = As + STAGES * S::A_STAGE;
    const unsigned smem0 = smem_addr(distmm_smem);
    const unsigned a0 = smem0, b0 = smem0 + STAGES * S::A_STAGE * 2;
    const unsigned full0 = smem0 + STAGES * S::STAGE_BYTES, empty0 = full0 + STAGES * 8;

    const int tid = threadIdx.x, wg = tid / 128;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const int KT = (K + BK - 1) / BK;

    // full: the producer's threads arrive; empty: every consumer thread
    if (tid == 0) init_stage_barriers<STAGES>(full0, empty0, 128, 128 * S::CONSUMERS);
    __syncthreads();

    if (wg == 0) {  // producer
        const int ptid = tid;
        const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
            const int k0 = kt * BK;
            Tin* as = As + s * S::A_STAGE;
            Tin* bs = Bs + s * S::B_STAGE;
            if (!TA) core_tile_copy<Tin, BM, BK, true, BK>(as, A, lda, m0, k0, M, K, vec_a, ptid);
            else     core_tile_copy<Tin, BK, BM, false, BK>(as, A, lda, k0, m0, K, M, vec_a, ptid);
            if (TB)  core_tile_copy<Tin, BN, BK, true, BK>(bs, B, ldb, n0, k0, N, K, vec_b, ptid);
            else     core_tile_copy<Tin, BK, BN, false, BK>(bs, B, ldb, k0, n0, K, N, vec_b, ptid);
            if (vec_a && vec_b) {
                mbar_arrive_cp_async(full0 + 8 * s);
            } else {  // element stores too: wait for the copies, then a releasing arrive
                asm volatile("cp.async.wait_all;\n" ::: "memory");
                mbar_arrive(full0 + 8 * s);
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // consumers: warpgroup wg computes rows (wg - 1) * 64 .. + 63 of the block tile
    constexpr int R = BN / 2;  // accumulators a thread: 64 x BN over 128 threads
    float d[R];
#pragma unroll
    for (int i = 0; i < R; ++i) d[i] = 0.0f;
    const unsigned a_rows = (unsigned)(wg - 1) * 64 / 8 * S::SBO;  // this warpgroup's 64 rows
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        // the stage was written by the generic proxy (cp.async, stores); wgmma reads it
        // through the async proxy
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        fence_operands<R>(d);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        const unsigned as = a0 + s * S::A_STAGE * 2 + a_rows, bs = b0 + s * S::B_STAGE * 2;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {  // a k step of 16 is 2 core matrices along k
            const unsigned long long da = wgmma_desc(as + kk * 2 * S::LBO, S::LBO, S::SBO);
            const unsigned long long db = wgmma_desc(bs + kk * 2 * S::LBO, S::LBO, S::SBO);
            Wgmma<BN>::template mma<Tin, TA ? 1 : 0, TB ? 0 : 1>(d, da, db, 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (INFLIGHT) {
            // leave this k tile's group running while the next stage is awaited and issued:
            // wait only for the previous group, then hand its stage back
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            fence_operands<R>(d);
            if (kt > 0) mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
        } else {
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            fence_operands<R>(d);
            mbar_arrive(empty0 + 8 * s);
        }
    }
    if (INFLIGHT) {  // the last group: the producer has issued its last stage already
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_operands<R>(d);
    }

    // d[4j + 2h + e] = C[16 w + g + 8h][8j + 2t + e] of the warpgroup's 64 x BN tile
    const int w = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + (wg - 1) * 64 + 16 * w + g + 8 * h;
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = n0 + 8 * j + 2 * t + e;
                if (col < N) store_c(C, (long long)row * ldc + col, d[4 * j + 2 * h + e], alpha, beta);
            }
        }
    }
}
#endif  // DISTMM_WGMMA

}  // namespace distmm

// Tin: distmm_bf16 or distmm_fp16; C, alpha and beta are float32. INFLIGHT: 0, each
// consumer waits for its k tile's wgmma group before it hands the stage back and takes the
// next; 1, one group stays in flight while the next is issued (a stage goes back one k tile
// later).
template <typename Tin, int BM, int BN, int BK, int STAGES, int INFLIGHT, bool TA, bool TB>
__global__ void __launch_bounds__(128 * (BM / 64 + 1), 1)
distmm_gemm_wgmma_bf16(int M, int N, int K, float alpha, const Tin* __restrict__ A, long long lda,
                       const Tin* __restrict__ B, long long ldb, float beta, float* __restrict__ C,
                       long long ldc, int flags) {
    static_assert(distmm::wgmma_input<Tin>::valid && !distmm::wgmma_input<Tin>::kmajor_only,
                  "inputs are distmm_bf16 or distmm_fp16");
    static_assert(INFLIGHT == 0 || INFLIGHT == 1, "INFLIGHT: 0 or 1 wgmma group left running");
    (void)distmm::WgmmaShape<BM, BN, BK, STAGES>::SMEM_BYTES;
#if DISTMM_WGMMA
    distmm::wgmma_body<Tin, BM, BN, BK, STAGES, INFLIGHT, TA, TB>(M, N, K, alpha, A, lda, B, ldb,
                                                                  beta, C, ldc, flags);
#else
    __trap();  // not built for sm_90a: the registry never launches this build
#endif
}

#ifndef DISTMM_NVRTC
// The registry's default configuration, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, ST, IF, TA, TB)                                      \
    template __global__ void distmm_gemm_wgmma_bf16<T, BM, BN, BK, ST, IF, TA, TB>(      \
        int, int, int, float, const T*, long long, const T*, long long, float, float*,  \
        long long, int);
#define DISTMM_INST(T, BM, BN, BK, ST, IF)                 \
    DISTMM_INST2(T, BM, BN, BK, ST, IF, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, ST, IF, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, ST, IF, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, ST, IF, true, true)
DISTMM_INST(distmm_bf16, 128, 128, 64, 4, 0)
DISTMM_INST(distmm_fp16, 128, 128, 64, 4, 0)
DISTMM_INST(distmm_bf16, 128, 128, 64, 4, 1)
DISTMM_INST(distmm_fp16, 128, 128, 64, 4, 1)
#endif
