// Pieces shared by the steps whose shared-memory stages are handed over with mbarriers and
// filled by the tensor memory accelerator (TMA): 13 and 14 (wgmma) and 15 (mma.sync fed by
// TMA). The mbarrier operations, the copy of one box of a tensor map into shared memory, and
// the tensor map's 128 opaque bytes. Not a kernel by itself.
//
// mbarrier.try_wait, expect_tx and cp.async.bulk.tensor are sm_90 instructions: their bodies
// are compiled only where DISTMM_TMA is 1 (device code for compute capability 9.0 and later);
// elsewhere (CI's sm_80 check, the host pass) the kernels that use them compile a body that
// traps, which the registry never launches.
#pragma once
#include "tensorcore.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DISTMM_TMA 1
#else
#define DISTMM_TMA 0
#endif

// A CUtensorMap's 128 opaque bytes (cuda.h's type, without needing cuda.h)
struct __align__(64) distmm_tmap { unsigned long long bits[16]; };

namespace distmm {

#if DISTMM_TMA
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

// One thread makes each stage's "full" and "empty" mbarriers (8 bytes each, consecutive from
// full0 and from empty0) ready for the arrival counts given; the block's barrier follows.
// EMPTY false: full barriers only (step 15, whose block barrier hands stages back).
template <int STAGES, bool EMPTY = true>
__device__ __forceinline__ void init_stage_barriers(unsigned full0, unsigned empty0,
                                                    unsigned full_count, unsigned empty_count) {
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(full0 + 8 * s, full_count);
        if (EMPTY) mbar_init(empty0 + 8 * s, empty_count);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void prefetch_tensormap(const distmm_tmap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Orders this thread's view of shared memory, as the block barrier or an mbarrier handed it
// over, before what the async proxy (the copy engine) writes next: the fragments other warps
// read with ldmatrix before handing a stage back must not be overwritten by the next copy
// into it (a write-after-read across proxies, which neither barrier orders by itself).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// True in one lane of the converged warp (elect.sync), false in the others. A copy issued
// under it (in a warp-uniform branch) needs no loop over the active lanes to move its
// operands into uniform registers, as one under `threadIdx.x == 0` does.
__device__ __forceinline__ bool elect_one() {
    unsigned pred = 0;
    asm volatile("{ .reg .b32 rx; .reg .pred px; elect.sync rx|px, %1; @px mov.s32 %0, 1; }\n"
                 : "+r"(pred) : "r"(0xffffffffu));
    return pred != 0;
}

// The box of map at coordinates (c0 innermost, c1) into shared memory at dst; its bytes
// complete the transaction count of mbarrier bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const distmm_tmap* map, unsigned bar,
                                            int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
// One k tile of A and B as boxes of their tensor maps (steps 14 and 15), counted on mbarrier
// full (expect_tx of the stage's bytes): a k-major operand (A stored M x K, B stored N x K) as
// one box of BM (BN) rows by 64 k at as (bs), an mn-major one as BM / 64 (BN / 64) boxes of 64
// k rows by 64 m (n), BOX bytes apart.
template <int BM, int BN, int BOX, bool TA, bool TB>
__device__ __forceinline__ void tma_load_tile(unsigned as, unsigned bs, const distmm_tmap* mapA,
                                              const distmm_tmap* mapB, unsigned full,
                                              unsigned bytes, int k0, int m0, int n0) {
    mbar_expect_tx(full, bytes);
    if (!TA) {
        tma_load_2d(as, mapA, full, k0, m0);
    } else {
#pragma unroll
        for (int j = 0; j < BM / 64; ++j) tma_load_2d(as + j * BOX, mapA, full, m0 + 64 * j, k0);
    }
    if (TB) {
        tma_load_2d(bs, mapB, full, k0, n0);
    } else {
#pragma unroll
        for (int j = 0; j < BN / 64; ++j) tma_load_2d(bs + j * BOX, mapB, full, n0 + 64 * j, k0);
    }
}
#endif  // DISTMM_TMA

}  // namespace distmm
