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
// not TMA. A TMA load (cp.async.bulk.tensor, which would also zero-fill out of bounds) needs
// a CUtensorMap made on the host by cuTensorMapEncodeTiled and passed by value as a
// __grid_constant__ parameter; cupy's driver module has no binding for that call (only
// ctypes on libcuda or cuda-python's bindings reach it, neither a distmm dependency). The
// bulk copy without a tensor map (cp.async.bulk) moves one contiguous range per instruction
// and cannot zero-fill, so the ragged edges and transposes would need a second path.
// Operands that are not 16-byte aligned are copied element by element.
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
#include "tensorcore.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DISTMM_WGMMA 1
#else
#define DISTMM_WGMMA 0
#endif

namespace distmm {

template <typename T> struct wgmma_input { static constexpr bool valid = false, bf16 = false; };
template <> struct wgmma_input<distmm_bf16> { static constexpr bool valid = true, bf16 = true; };
template <> struct wgmma_input<distmm_fp16> { static constexpr bool valid = true, bf16 = false; };

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
// One wgmma per tile width N, for both input types: AB is ".bf16.bf16" or ".f16.f16"
// (the asm strings differ only there).
#define DISTMM_WGMMA_M64N64K16(AB) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32" AB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
            "}, %32, %33, p, 1, 1, %35, %36; }\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
              "+f"(d[30]), "+f"(d[31]) \
            : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_A), "n"(TNSP_B))

#define DISTMM_WGMMA_M64N128K16(AB) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32" AB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
            "}, %64, %65, p, 1, 1, %67, %68; }\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
              "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
              "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
              "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
              "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_A), "n"(TNSP_B))

#define DISTMM_WGMMA_M64N256K16(AB) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %130, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32" AB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
            "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
            "}, %128, %129, p, 1, 1, %131, %132; }\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
              "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
              "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
              "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
              "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), \
              "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
              "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
              "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), \
              "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), \
              "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), \
              "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), \
              "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), \
              "+f"(d[126]), "+f"(d[127]) \
            : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_A), "n"(TNSP_B))

template <int N> struct Wgmma;
template <> struct Wgmma<64> {
    template <bool BF16, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if (BF16)
            DISTMM_WGMMA_M64N64K16(".bf16.bf16");
        else
            DISTMM_WGMMA_M64N64K16(".f16.f16");
    }
};
template <> struct Wgmma<128> {
    template <bool BF16, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if (BF16)
            DISTMM_WGMMA_M64N128K16(".bf16.bf16");
        else
            DISTMM_WGMMA_M64N128K16(".f16.f16");
    }
};
template <> struct Wgmma<256> {
    template <bool BF16, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if (BF16)
            DISTMM_WGMMA_M64N256K16(".bf16.bf16");
        else
            DISTMM_WGMMA_M64N256K16(".f16.f16");
    }
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }\n" :: "r"(bar) : "memory");
}
// Arrive once this thread's cp.async copies issued so far have completed (the barrier's
// count includes this arrival: .noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// Matrix descriptor of a shared-memory operand in the interleaved layout (no swizzle):
// start address, leading and stride byte offsets, each in 16-byte units.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

template <int R>
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

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

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 128);                    // the producer's threads
            mbar_init(empty0 + 8 * s, 128 * S::CONSUMERS);    // every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
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
            Wgmma<BN>::template mma<wgmma_input<Tin>::bf16, TA ? 1 : 0, TB ? 0 : 1>(d, da, db, 1);
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
    static_assert(distmm::wgmma_input<Tin>::valid, "inputs are distmm_bf16 or distmm_fp16");
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
