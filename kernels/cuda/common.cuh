// distmm CUDA GEMM kernels: pieces every step shares.
//
// Every kernel computes C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major,
// with leading dimensions in elements. op(A) = A when (flags & TRANS_A) == 0 (A stored
// M x K, A[m*lda + k]) and A^T otherwise (A stored K x M, A[k*lda + m]); likewise B.
// As in BLAS, beta == 0 means C is not read.
//
// Element types: float, double, int (int32) and long long (int64). Integers accumulate in
// the unsigned type of the same width, so sums wrap modulo 2^w exactly as numpy's do,
// without signed-overflow undefined behaviour.
//
// No standard headers: the file must compile under NVRTC (CuPy RawModule) and nvcc alike.
#pragma once

#define DISTMM_TRANS_A 1
#define DISTMM_TRANS_B 2
#define DISTMM_VEC_A 4   // A's base is 16-byte aligned and lda is a multiple of 16 bytes
#define DISTMM_VEC_B 8   // the same for B
#define DISTMM_SPLIT_TAIL 16  // step 10: this launch is the split tail (see 10_simt_fp64.cu)

namespace distmm {

template <typename T> struct acc_type { typedef T type; };
template <> struct acc_type<int> { typedef unsigned int type; };
template <> struct acc_type<long long> { typedef unsigned long long type; };

template <typename T>
__device__ __forceinline__ typename acc_type<T>::type to_acc(T x) {
    return (typename acc_type<T>::type)x;
}

// acc + a * b in the accumulation type; fused for floating point.
// float: explicit PTX without .ftz. CuPy compiles every NVRTC module with -ftz=true,
// which would flush subnormal operands and results to zero; numpy and cuBLAS keep them.
__device__ __forceinline__ float madd(float a, float b, float c) {
    float d;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}
__device__ __forceinline__ float mul_keep_subnormal(float a, float b) {
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
__device__ __forceinline__ double madd(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ unsigned int madd(int a, int b, unsigned int c) {
    return (unsigned int)a * (unsigned int)b + c;
}
__device__ __forceinline__ unsigned long long madd(long long a, long long b, unsigned long long c) {
    return (unsigned long long)a * (unsigned long long)b + c;
}

// Element (r, c) of op(X) for a row-major X with leading dimension ld.
template <typename T>
__device__ __forceinline__ T op_at(const T* __restrict__ x, long long ld, bool trans, int r, int c) {
    return trans ? x[(long long)c * ld + r] : x[(long long)r * ld + c];
}

// C[idx] = alpha * acc + beta * C[idx]; C is not read when beta == 0.
template <typename T>
__device__ __forceinline__ void store_c(T* __restrict__ c, long long idx,
                                        typename acc_type<T>::type acc, T alpha, T beta) {
    typedef typename acc_type<T>::type A;
    A r = to_acc(alpha) * acc;
    if (beta != T(0)) r = r + to_acc(beta) * to_acc(c[idx]);
    c[idx] = (T)r;
}

// float: alpha * acc, then one fused beta * old + that, with no flush of subnormals (see
// madd); old (C's element before the write) counts only when beta != 0. Every float32 C
// that a kernel writes takes its value here.
__device__ __forceinline__ float c_value(float acc, float alpha, float beta, float old) {
    const float r = alpha == 1.0f ? acc : mul_keep_subnormal(alpha, acc);
    return beta != 0.0f ? madd(beta, old, r) : r;
}

__device__ __forceinline__ void store_c(float* __restrict__ c, long long idx, float acc,
                                        float alpha, float beta) {
    c[idx] = c_value(acc, alpha, beta, beta != 0.0f ? c[idx] : 0.0f);
}

// Two adjacent elements of a float32 C at idx (8-byte aligned) in one 8-byte store, each
// as store_c computes it; other types never take this path (store_mma_fragments' pairs).
__device__ __forceinline__ void store_c_pair(float* __restrict__ c, long long idx, float acc0,
                                             float acc1, float alpha, float beta) {
    float2 old = {0.0f, 0.0f}, r;
    if (beta != 0.0f) old = *reinterpret_cast<const float2*>(c + idx);
    r.x = c_value(acc0, alpha, beta, old.x);
    r.y = c_value(acc1, alpha, beta, old.y);
    *reinterpret_cast<float2*>(c + idx) = r;
}
template <typename T>
__device__ __forceinline__ void store_c_pair(T* c, long long idx, float acc0, float acc1, T alpha, T beta) {
    store_c(c, idx, acc0, alpha, beta);
    store_c(c, idx + 1, acc1, alpha, beta);
}

// 16-byte vectors: VEC elements of T.
template <typename T> struct vec16 { static constexpr int n = 16 / sizeof(T); };

__device__ __forceinline__ void ld16(const float* p, float* o) {
    float4 v = *reinterpret_cast<const float4*>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void ld16(const int* p, int* o) {
    int4 v = *reinterpret_cast<const int4*>(p);
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void ld16(const double* p, double* o) {
    double2 v = *reinterpret_cast<const double2*>(p);
    o[0] = v.x; o[1] = v.y;
}
__device__ __forceinline__ void ld16(const long long* p, long long* o) {
    longlong2 v = *reinterpret_cast<const longlong2*>(p);
    o[0] = v.x; o[1] = v.y;
}
// (Aggregate stores rather than make_float4 & co., which NVRTC need not declare.)
__device__ __forceinline__ void st16(float* p, const float* o) {
    float4 v; v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
    *reinterpret_cast<float4*>(p) = v;
}
__device__ __forceinline__ void st16(int* p, const int* o) {
    int4 v; v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
    *reinterpret_cast<int4*>(p) = v;
}
__device__ __forceinline__ void st16(double* p, const double* o) {
    double2 v; v.x = o[0]; v.y = o[1];
    *reinterpret_cast<double2*>(p) = v;
}
__device__ __forceinline__ void st16(long long* p, const long long* o) {
    longlong2 v; v.x = o[0]; v.y = o[1];
    *reinterpret_cast<longlong2*>(p) = v;
}

// ---- cp.async (sm_80+): global -> shared without a trip through registers ----------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 u; cvta.to.shared.u64 u, %1; cvt.u32.u64 %0, u; }"
                 : "=r"(a) : "l"(p));
    return a;
}

// Copy 16 bytes; only the first src_bytes are read, the rest of the 16 are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}
// Copy 16 bytes to a shared-space address (as from smem_addr).
__device__ __forceinline__ void cp_async16_shared(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}
// Copy one element of 4 or 8 bytes (src_bytes 0 zero-fills it).
template <int BYTES>
__device__ __forceinline__ void cp_async_elem(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "n"(BYTES), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Copy a ROWS x COLS tile (COLS contiguous in global memory) into shared memory with
// row stride SLD, through cp.async. Global element (r, c) of the tile is
// g[(row0 + r) * ld + col0 + c] and exists when row0 + r < row_lim and col0 + c < col_lim;
// missing elements are zero-filled. With vec (16-byte aligned rows) each thread copies
// 16-byte chunks; otherwise single elements.
template <typename T, int ROWS, int COLS, int SLD, int NT>
__device__ __forceinline__ void tile_to_smem_async(T* __restrict__ s, const T* __restrict__ g,
                                                   long long ld, int row0, int col0, int row_lim,
                                                   int col_lim, bool vec, int tid) {
    constexpr int V = vec16<T>::n;
    static_assert(COLS % V == 0, "tile columns must be a multiple of the 16-byte vector");
    constexpr int CHUNKS_PER_ROW = COLS / V;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    constexpr int ITERS = (CHUNKS + NT - 1) / NT;
    // Only edge tiles come here. An opaque copy of tid keeps the compiler from hoisting
    // this path's per-chunk addresses out of the k loop, where they would hold registers
    // (and spill) for the whole kernel; recomputing them per edge tile costs little.
    asm volatile("" : "+r"(tid));
    if (vec) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            int ch = tid + it * NT;
            if (CHUNKS % NT == 0 || ch < CHUNKS) {
                int r = ch / CHUNKS_PER_ROW, c = (ch % CHUNKS_PER_ROW) * V;
                int gr = row0 + r, gc = col0 + c;
                int n = (gr < row_lim) ? col_lim - gc : 0;
                n = n < 0 ? 0 : (n > V ? V : n);
                const T* src = n ? g + (long long)gr * ld + gc : g;
                cp_async16(s + r * SLD + c, src, n * (int)sizeof(T));
            }
        }
    } else {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            int ch = tid + it * NT;
            if (CHUNKS % NT == 0 || ch < CHUNKS) {
                int r = ch / CHUNKS_PER_ROW, c = (ch % CHUNKS_PER_ROW) * V;
                int gr = row0 + r;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    int gc = col0 + c + e;
                    bool ok = gr < row_lim && gc < col_lim;
                    const T* src = ok ? g + (long long)gr * ld + gc : g;
                    cp_async_elem<sizeof(T)>(s + r * SLD + c + e, src, ok ? (int)sizeof(T) : 0);
                }
            }
        }
    }
}

// The interior copy of step 10: the thread's source pointer and shared-memory offset are
// computed once (constructor) and the pointer is advanced by the caller between tiles.
// Only for tiles wholly inside the matrix with 16-byte aligned rows; a pointer advanced
// past the matrix is never dereferenced (edge tiles take tile_to_smem_async).
template <typename T, int ROWS, int COLS, int SLD, int NT>
struct IncrementalTileCopy {
    static constexpr int V = vec16<T>::n;
    static constexpr int CHUNKS_PER_ROW = COLS / V;
    static constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static constexpr int ITERS = (CHUNKS + NT - 1) / NT;
    static constexpr int ROW_STEP = NT / CHUNKS_PER_ROW;
    static_assert(NT % CHUNKS_PER_ROW == 0 || CHUNKS <= NT, "thread rows must not wrap");
    const T* src;
    unsigned dst;  // byte offset of the thread's first chunk in a stage
    bool active;   // false only for threads beyond the last chunk of a small tile
    __device__ __forceinline__ IncrementalTileCopy(const T* g, long long ld, int row0, int col0, int tid) {
        const int r = tid / CHUNKS_PER_ROW, c = (tid % CHUNKS_PER_ROW) * V;
        src = g + (long long)(row0 + r) * ld + col0 + c;
        dst = (unsigned)((r * SLD + c) * sizeof(T));
        active = tid < CHUNKS;
    }
    // stage: the shared-space address (smem_addr) of the stage; the chunk offsets are
    // compile-time constants, so each copy is one LDGSTS with an immediate offset.
    __device__ __forceinline__ void copy(unsigned stage, long long ld) const {
        const long long step = (long long)ROW_STEP * ld;
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            if (CHUNKS % NT == 0 || (active && dst + it * ROW_STEP * SLD * sizeof(T) < ROWS * SLD * sizeof(T)))
                cp_async16_shared(stage + dst + it * ROW_STEP * SLD * (unsigned)sizeof(T), src + it * step);
        }
    }
    __device__ __forceinline__ void advance(long long elems) { src += elems; }
};

// The same copy for a tile that lies wholly inside the matrix with 16-byte aligned rows
// (every block's tile except those on the matrix edge): no bounds checks, no zero-fill,
// one pointer per thread advanced by a fixed stride between its chunks.
template <typename T, int ROWS, int COLS, int SLD, int NT>
__device__ __forceinline__ void tile_to_smem_async_interior(T* __restrict__ s, const T* __restrict__ g,
                                                            long long ld, int row0, int col0, int tid) {
    constexpr int V = vec16<T>::n;
    constexpr int CHUNKS_PER_ROW = COLS / V;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    constexpr int ITERS = (CHUNKS + NT - 1) / NT;
    static_assert(NT % CHUNKS_PER_ROW == 0 || CHUNKS <= NT, "thread rows must not wrap");
    constexpr int ROW_STEP = NT / CHUNKS_PER_ROW;  // rows between a thread's chunks
    const int r = tid / CHUNKS_PER_ROW, c = (tid % CHUNKS_PER_ROW) * V;
    const T* src = g + (long long)(row0 + r) * ld + col0 + c;
    T* dst = s + r * SLD + c;
    const long long step = (long long)ROW_STEP * ld;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        if (CHUNKS % NT == 0 || tid + it * NT < CHUNKS)
            cp_async16(dst + it * ROW_STEP * SLD, src + it * step, 16);
    }
}

}  // namespace distmm
