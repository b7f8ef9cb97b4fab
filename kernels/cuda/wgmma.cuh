// Pieces shared by the Hopper steps (13: wgmma with cp.async copies, 14: wgmma with TMA
// copies): the wgmma instruction for each tile width and the fence that keeps the
// accumulators in registers across asynchronous wgmma (the mbarriers that hand stages
// between a producer and consumers are in tma.cuh). Not a kernel by itself.
//
// wgmma, setmaxnreg and the rest are in sm_90a's architecture-specific feature set: the
// bodies that use them are compiled only where DISTMM_WGMMA is 1 (nvcc -arch=sm_90a); other
// targets (CI's sm_90 and sm_80 checks) see the declarations and compile a body that traps.
#pragma once
#include "tma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DISTMM_WGMMA 1
#else
#define DISTMM_WGMMA 0
#endif

namespace distmm {


// wgmma's inputs: BF16 and FP16 (k 16 an instruction, either operand k- or mn-major in shared
// memory), and TF32 as float32 bits (k 8 an instruction, both operands k-major: PTX has no
// transposed form for 32-bit inputs). Either way an instruction's k is 32 bytes of a row.
template <typename T> struct wgmma_input { static constexpr bool valid = false; };
template <> struct wgmma_input<distmm_bf16> { static constexpr bool valid = true, kmajor_only = false; static constexpr int k = 16; };
template <> struct wgmma_input<distmm_fp16> { static constexpr bool valid = true, kmajor_only = false; static constexpr int k = 16; };
template <> struct wgmma_input<float> { static constexpr bool valid = true, kmajor_only = true; static constexpr int k = 8; };

#if DISTMM_WGMMA
// One wgmma per tile width N, for every input type: KAB is the instruction's k and types
// ("k16.f32.bf16.bf16", "k16.f32.f16.f16", "k8.f32.tf32.tf32"), TR the transpose immediates
// of the 16-bit forms (the TF32 form has none; its operands stay in the list, unused).
#define DISTMM_WGMMA_M64N64(KAB, TR) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64" KAB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
            "}, %32, %33, p, 1, 1" TR "; }\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
              "+f"(d[30]), "+f"(d[31]) \
            : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_A), "n"(TNSP_B))

#define DISTMM_WGMMA_M64N128(KAB, TR) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128" KAB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
            "}, %64, %65, p, 1, 1" TR "; }\n" \
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

#define DISTMM_WGMMA_M64N256(KAB, TR) \
        asm volatile( \
            "{ .reg .pred p; setp.ne.b32 p, %130, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n256" KAB " {" \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
            "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
            "}, %128, %129, p, 1, 1" TR "; }\n" \
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
    template <typename Tin, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if constexpr (same_type<Tin, distmm_bf16>::value)
            DISTMM_WGMMA_M64N64("k16.f32.bf16.bf16", ", %35, %36");
        else if constexpr (same_type<Tin, distmm_fp16>::value)
            DISTMM_WGMMA_M64N64("k16.f32.f16.f16", ", %35, %36");
        else
            DISTMM_WGMMA_M64N64("k8.f32.tf32.tf32", "");
    }
};
template <> struct Wgmma<128> {
    template <typename Tin, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if constexpr (same_type<Tin, distmm_bf16>::value)
            DISTMM_WGMMA_M64N128("k16.f32.bf16.bf16", ", %67, %68");
        else if constexpr (same_type<Tin, distmm_fp16>::value)
            DISTMM_WGMMA_M64N128("k16.f32.f16.f16", ", %67, %68");
        else
            DISTMM_WGMMA_M64N128("k8.f32.tf32.tf32", "");
    }
};
template <> struct Wgmma<256> {
    template <typename Tin, int TNSP_A, int TNSP_B>
    static __device__ __forceinline__ void mma(float* d, unsigned long long da,
                                                  unsigned long long db, int scale_d) {
        if constexpr (same_type<Tin, distmm_bf16>::value)
            DISTMM_WGMMA_M64N256("k16.f32.bf16.bf16", ", %131, %132");
        else if constexpr (same_type<Tin, distmm_fp16>::value)
            DISTMM_WGMMA_M64N256("k16.f32.f16.f16", ", %131, %132");
        else
            DISTMM_WGMMA_M64N256("k8.f32.tf32.tf32", "");
    }
};

template <int R>
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// Matrix descriptor of a shared-memory operand (wgmma's 64-bit "matrix descriptor"): start
// address, leading and stride byte offsets (each in 16-byte units) and the layout type in
// bits 62-63 (0: interleaved, no swizzle; 1: 128-byte swizzle). Base offset 0: the tiles
// start on 1024-byte boundaries.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo,
                                                         unsigned layout = 0) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | ((unsigned long long)layout << 62);
}
#endif  // DISTMM_WGMMA

}  // namespace distmm
