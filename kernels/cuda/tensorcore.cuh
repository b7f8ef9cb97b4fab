// Pieces shared by the mma.sync tensor-core steps (11: TF32, 12: BF16/FP16) and the Hopper
// step (13: wgmma): the 16-bit storage types, swizzled shared-memory tiles and the copy that
// fills them with cp.async. Included by 11_mma_tf32.cu and 12_mma_bf16.cu; not a kernel by
// itself. Step 13 keeps wgmma's own core-matrix layout and uses only the storage types.
//
// Shared memory keeps each operand in the layout it has in global memory (cp.async cannot
// transpose), in rows of a multiple of 128 bytes (8 chunks of 16 bytes; the registry checks
// the tile shapes). The 16-byte chunk c of row r is stored at chunk c ^ s(r) of that row, an
// XOR swizzle of the chunk's low three bits, so that the 8 (or 32) addresses a fragment load
// presents fall in distinct banks:
//   SWZ_ROW8 (s = r & 7): a phase reads one chunk column of 8 consecutive rows (ldmatrix
//       rows, or the TF32 fragments of a k-contiguous tile: lane (g, t) reads row g, word t);
//   SWZ_ROW4 (s = 2 (r & 3)): the TF32 fragments of an m- or n-contiguous tile: lane (g, t)
//       reads row t (k) and word g (m or n), i.e. chunks c, c + 1 (c even) of 4 rows.
#pragma once
#include "pipelined.cuh"

// 16-bit floating-point storage (the bits only: no arithmetic happens in these types, so no
// cuda_bf16.h / cuda_fp16.h is needed and NVRTC compiles the file without include paths).
struct distmm_bf16 { unsigned short bits; };
struct distmm_fp16 { unsigned short bits; };

namespace distmm {

enum { SWZ_ROW8 = 0, SWZ_ROW4 = 1 };

template <int SWZ>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) {
    return SWZ == SWZ_ROW8 ? chunk ^ (row & 7) : chunk ^ ((row & 3) << 1);
}

// Element offset of (row, col) in a swizzled tile with COLS elements a row, V a chunk.
template <int COLS, int V, int SWZ>
__device__ __forceinline__ int swz_offset(int row, int col) {
    return row * COLS + swizzle_chunk<SWZ>(row, col / V) * V + col % V;
}

// A ROWS x COLS tile (COLS contiguous in global memory, element (r, c) at
// g[(row0 + r) * ld + col0 + c], present when row0 + r < row_lim and col0 + c < col_lim)
// into a swizzled shared tile. With vec (16-byte aligned base and rows) each thread copies
// 16-byte chunks with cp.async, zero-filling what lies outside the matrix; otherwise
// elements go through registers (plain loads and shared stores, zeros outside), which the
// barrier before the stage is read orders like the cp.async copies.
template <typename T, int ROWS, int COLS, int NT, int SWZ>
__device__ __forceinline__ void swz_tile_copy(T* __restrict__ s, const T* __restrict__ g,
                                              long long ld, int row0, int col0, int row_lim,
                                              int col_lim, bool vec, int tid) {
    constexpr int V = 16 / (int)sizeof(T);
    constexpr int CH = COLS / V;
    static_assert(COLS % V == 0 && CH % 8 == 0, "shared rows are multiples of 128 bytes");
    constexpr int CHUNKS = ROWS * CH;
    constexpr int ITERS = (CHUNKS + NT - 1) / NT;
    if (vec) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int ch = tid + it * NT;
            if (CHUNKS % NT == 0 || ch < CHUNKS) {
                const int r = ch / CH, c = ch % CH;
                const int gr = row0 + r, gc = col0 + c * V;
                int n = gr < row_lim ? col_lim - gc : 0;
                n = n < 0 ? 0 : (n > V ? V : n);
                const T* src = n ? g + (long long)gr * ld + gc : g;
                cp_async16(s + r * COLS + swizzle_chunk<SWZ>(r, c) * V, src, n * (int)sizeof(T));
            }
        }
    } else {
#pragma unroll 1
        for (int it = 0; it < ITERS; ++it) {
            const int ch = tid + it * NT;
            if (CHUNKS % NT == 0 || ch < CHUNKS) {
                const int r = ch / CH, c = ch % CH;
                const int gr = row0 + r;
                T* dst = s + r * COLS + swizzle_chunk<SWZ>(r, c) * V;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const int gc = col0 + c * V + e;
                    T x;
                    if (gr < row_lim && gc < col_lim) x = g[(long long)gr * ld + gc];
                    else x = T{};
                    dst[e] = x;
                }
            }
        }
    }
}

// Both operands' k tile at k0 into one stage: op(A) is BM x BK (stored BK x BM when TA),
// op(B) is BK x BN (stored BN x BK when TB). K_SWZ, MN_SWZ: the swizzles of the
// k-contiguous and the m/n-contiguous layouts.
template <typename T, int BM, int BN, int BK, int NT, bool TA, bool TB, int K_SWZ, int MN_SWZ>
__device__ __forceinline__ void swz_ab_tile(T* as, T* bs, const T* A, long long lda, const T* B,
                                            long long ldb, int m0, int n0, int k0, int M, int N,
                                            int K, bool vec_a, bool vec_b, int tid) {
    if (!TA) swz_tile_copy<T, BM, BK, NT, K_SWZ>(as, A, lda, m0, k0, M, K, vec_a, tid);
    else     swz_tile_copy<T, BK, BM, NT, MN_SWZ>(as, A, lda, k0, m0, K, M, vec_a, tid);
    if (!TB) swz_tile_copy<T, BK, BN, NT, MN_SWZ>(bs, B, ldb, k0, n0, K, N, vec_b, tid);
    else     swz_tile_copy<T, BN, BK, NT, K_SWZ>(bs, B, ldb, n0, k0, N, K, vec_b, tid);
}

// A warp's m16n8 accumulator fragments into C: fragment (i, j) covers rows r0 + 16 i + g and
// + 8, columns c0 + 8 j + 2 t and + 1 (g = lane / 4, t = lane % 4); rows and columns outside
// M x N are skipped. C = alpha acc + beta C (common.cuh's store_c).
template <int MI, int NI, typename T>
__device__ __forceinline__ void store_mma_fragments(const float (&acc)[MI][NI][4], T* C,
                                                    long long ldc, int M, int N, int r0, int c0,
                                                    int g, int t, T alpha, T beta) {
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + i * 16 + g + 8 * h;
            if (row >= M) continue;
#pragma unroll
            for (int j = 0; j < NI; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = c0 + j * 8 + 2 * t + e;
                    if (col < N) store_c(C, (long long)row * ldc + col, acc[i][j][2 * h + e], alpha, beta);
                }
            }
        }
    }
}

}  // namespace distmm

