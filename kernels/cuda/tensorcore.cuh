// Pieces shared by the mma.sync tensor-core steps (11: TF32, 12 and 15: BF16/FP16) and the
// Hopper steps (13, 14: wgmma): the 16-bit storage types, the m16n8k16 instruction, swizzled
// shared-memory tiles and the copy that fills them with cp.async. Included by 11_mma_tf32.cu,
// 12_mma_bf16.cu and, through tma.cuh, steps 13-15; not a kernel by itself. Steps 13 and 14
// keep wgmma's own layouts and use only the storage types.
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
        // not unrolled: this is the edge tiles' path beside SwzInterior's, and unrolled its
        // per-chunk addresses were hoisted out of the k loop into registers the mma need
#pragma unroll 1
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

// The interior copy of one operand's k tile (ROWS x COLS, COLS contiguous in global memory)
// into a swizzled stage, for tiles wholly inside the matrix with 16-byte aligned rows: each
// thread's source pointer and shared offset are computed once (row(), col(), dst()), and its
// ITERS chunks lie RSTEP rows apart, a fixed pointer stride and an immediate shared offset,
// with the same swizzle (RSTEP a multiple of the swizzle's period). OK is false for tiles
// whose chunks do not split so (few threads, wide rows); those take swz_tile_copy.
template <typename T, int ROWS, int COLS, int NT, int SWZ>
struct SwzInterior {
    static constexpr int V = 16 / (int)sizeof(T), CH = COLS / V, CHUNKS = ROWS * CH;
    static constexpr int RSTEP = NT >= CH ? NT / CH : 1, ITERS = CHUNKS / NT;
    static constexpr bool OK = CHUNKS % NT == 0 && NT % CH == 0 &&
                               RSTEP % (SWZ == SWZ_ROW8 ? 8 : 4) == 0;
    __device__ __forceinline__ static int row(int tid) { return tid / CH; }
    __device__ __forceinline__ static int col(int tid) { return (tid % CH) * V; }
    __device__ __forceinline__ static unsigned dst(int tid) {
        return (unsigned)((row(tid) * COLS + swizzle_chunk<SWZ>(row(tid), tid % CH) * V) * (int)sizeof(T));
    }
    // stage: the stage's shared-space address; src: the thread's first chunk in this k tile
    __device__ __forceinline__ static void copy(unsigned stage, unsigned dst, const T* src, long long ld) {
        const long long step = (long long)RSTEP * ld;
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
            cp_async16_shared(stage + dst + it * RSTEP * COLS * (unsigned)sizeof(T), src + it * step);
    }
};

// One operand's k tile at k0 into a stage: the interior copy when fast (the block's rows of
// the operand inside the matrix, aligned) and the tile's k inside K, else swz_tile_copy.
// KCONT: the operand is stored k-contiguous (tile MN x BK), else k rows (tile BK x MN).
// src: the thread's first chunk at k = 0 (SwzInterior's row/col from the block's origin).
template <typename T, int MN, int BK, int NT, int SWZ, bool KCONT>
__device__ __forceinline__ void swz_operand_tile(T* s, unsigned s_addr, const T* g, long long ld,
                                                 int mn0, int MNLIM, int k0, int K, bool vec,
                                                 bool fast, const T* src, unsigned dst, int tid) {
    typedef SwzInterior<T, KCONT ? MN : BK, KCONT ? BK : MN, NT, SWZ> F;
    if (F::OK && fast && k0 + BK <= K)
        F::copy(s_addr, dst, src + (KCONT ? (long long)k0 : (long long)k0 * ld), ld);
    else if (KCONT)
        swz_tile_copy<T, MN, BK, NT, SWZ>(s, g, ld, mn0, k0, MNLIM, K, vec, tid);
    else
        swz_tile_copy<T, BK, MN, NT, SWZ>(s, g, ld, k0, mn0, K, MNLIM, vec, tid);
}

// The thread's first chunk of an operand's interior copy at k = 0 (see swz_operand_tile).
template <typename T, int MN, int BK, int NT, int SWZ, bool KCONT>
__device__ __forceinline__ const T* swz_operand_src(const T* g, long long ld, int mn0, int tid) {
    typedef SwzInterior<T, KCONT ? MN : BK, KCONT ? BK : MN, NT, SWZ> F;
    return KCONT ? g + (long long)(mn0 + F::row(tid)) * ld + F::col(tid)
                 : g + (long long)F::row(tid) * ld + mn0 + F::col(tid);
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

// The lane's ldmatrix.x4 addresses (bytes within a SWZ_ROW8 stage of ES-byte elements),
// computed once. Lane l gives the row address of row l % 8 of matrix l / 8; rsel and csel say
// which of the fragment's two row halves and two chunk columns that matrix is. A k step (16
// bf16/fp16 or 8 tf32 elements) is two 16-byte chunks. Both layouts reduce to a register per
// k step or per tile and an immediate for the other index:
//   k-contiguous tile (rows m or n, BK columns): lane row r = base + l % 8 + 8 rsel, chunk
//     2 s + csel of k step s, stored at (2 s + csel) ^ (r & 7) = 2 s ^ x with x = csel ^ (l % 8):
//     off[s] = r * BK * ES + ((2 s ^ x) << 4); a tile of 16 rows further adds 16 * BK * ES;
//   m/n-contiguous tile (rows k, COLS 16-bit columns): lane row k = l % 8 + 8 rsel, chunk
//     e + csel (e even: the 16-wide tile's first column / 8), stored at e ^ x: off[q] =
//     k * COLS * 2 + ((e_q ^ x) << 4); k step s adds s * 16 * COLS * 2.
template <bool KCONT, int N_OFF, int BK, int COLS, int ES>
__device__ __forceinline__ void ldsm_offsets(unsigned (&off)[N_OFF], int base, int lane, int rsel,
                                             int csel) {
    const int lr = lane % 8, x = csel ^ lr;
#pragma unroll
    for (int q = 0; q < N_OFF; ++q) {
        if (KCONT)  // q = k step, base = the warp tile's first row
            off[q] = (unsigned)((base + lr + 8 * rsel) * BK * ES + (((2 * q) ^ x) << 4));
        else        // q = 16-wide tile, base = the warp tile's first column (16-bit elements)
            off[q] = (unsigned)((lr + 8 * rsel) * COLS * 2 + ((((base + 16 * q) / 8) ^ x) << 4));
    }
}


template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// TF32 inputs of mma.sync m16n8k8 (steps 11 and 15), fp32 accumulators. Fragments, g =
// lane / 4, t = lane % 4: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4];
// b0 = B[t][g], b1 = B[t + 4][g].
__device__ __forceinline__ void mma_tf32_16x8x8(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// BF16 and FP16 inputs of mma.sync m16n8k16 (steps 12 and 15), fp32 accumulators.
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

// Steps 12 and 15: one k step's fragments from a stage at sa (A) and sb (B) into af (the MI
// A fragments) and bf (the NI B fragments, two n tiles an ldmatrix.x4), at the lane's
// ldsm_offsets (or ldsm_offsets_boxed): a k-contiguous operand's offset is per k step s, a
// tile of 16 rows further adding 16 * BK * 2 bytes (BK: a row's 16-bit elements; TF32
// fragments of k-contiguous rows are read the same way, a 16-byte row of an 8 x 8 matrix
// being 4 TF32 values, lane (g, t) receiving value t of row g); an m/n-contiguous one's is per 16-wide
// tile, k step s adding s * A_KSTEP (B_KSTEP) bytes.
template <bool TA, bool TB, int BK, unsigned A_KSTEP, unsigned B_KSTEP, int MI, int NI, int AN,
          int BNO>
__device__ __forceinline__ void mma16_load_frags(unsigned (&af)[MI][4], unsigned (&bf)[NI][2],
                                                 unsigned sa, unsigned sb,
                                                 const unsigned (&a_off)[AN],
                                                 const unsigned (&b_off)[BNO], int s) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
        ldmatrix_x4<TA>(af[i], sa + (!TA ? a_off[s] + i * 16 * BK * 2 : a_off[i] + s * A_KSTEP));
#pragma unroll
    for (int jp = 0; jp < NI / 2; ++jp) {
        unsigned r[4];
        ldmatrix_x4<!TB>(r, sb + (TB ? b_off[s] + jp * 16 * BK * 2 : b_off[jp] + s * B_KSTEP));
        bf[2 * jp][0] = r[0]; bf[2 * jp][1] = r[1];
        bf[2 * jp + 1][0] = r[2]; bf[2 * jp + 1][1] = r[3];
    }
}

// A warp's mma for one k step (32 bytes of k: 16 BF16/FP16 values, or 8 TF32 ones as float):
// every (A fragment, B fragment) pair into its accumulators.
template <typename Tin, int MI, int NI>
__device__ __forceinline__ void mma16_step(float (&acc)[MI][NI][4], const unsigned (&af)[MI][4],
                                           const unsigned (&bf)[NI][2]) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) {
            if constexpr (same_type<Tin, float>::value) mma_tf32_16x8x8(acc[i][j], af[i], bf[j]);
            else mma_16x8x16<Tin>(acc[i][j], af[i], bf[j]);
        }
}

// The mma.sync steps' main loop over KT k tiles of KS k steps (step 11 with LOOP = 1). STAGES shared stages all hold
// tiles in flight (cp.async groups, one a tile); fragments come in two register buffers, so
// step s + 1's are read while step s's mma run. The tile boundary sits before the last
// step's mma: wait for tile kt + 1, one barrier (every warp has then read all of tile kt, and
// tile kt + 1 is visible), queue tile kt + STAGES into tile kt's stage, read tile kt + 1's
// first fragments, then issue tile kt's last mma, which hide those reads.
//   load_tile(kt, stage): queue tile kt's copies; load_frags(stage, s, buf): k step s of the
//   tile in stage into buffer buf; mma_step(buf): the warp's mma on buffer buf.
template <int STAGES, int KS, typename Load, typename Frags, typename Mma>
__device__ __forceinline__ void mma_mainloop(int KT, Load& load_tile, Frags& load_frags, Mma& mma_step) {
    static_assert(KS % 2 == 0, "an even number of k steps a tile (the buffers alternate)");
    static_assert(STAGES >= 2, "at least 2 stages");
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
        if (st < KT) load_tile(st, st);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    int stage = 0;
    load_frags(stage, 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            if (s == KS - 1) {
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                if (kt + STAGES < KT) load_tile(kt + STAGES, stage);
                cp_async_commit();
                stage = next_stage<STAGES>(stage);
                if (kt + 1 < KT) load_frags(stage, 0, 0);
            } else {
                load_frags(stage, s + 1, (s + 1) % 2);
            }
            mma_step(s % 2);
        }
    }
    cp_async_wait<0>();
}

// A warp's m16n8 accumulator fragments into C: fragment (i, j) covers rows r0 + 16 i + g and
// + 8, columns c0 + 8 j + 2 t and + 1 (g = lane / 4, t = lane % 4); rows and columns outside
// M x N are skipped. C = alpha acc + beta C (common.cuh's store_c), a lane's two columns in
// one 8-byte store where a float32 C's pointer and ldc allow it.
template <int MI, int NI, typename T>
__device__ __forceinline__ void store_mma_fragments(const float (&acc)[MI][NI][4], T* C,
                                                    long long ldc, int M, int N, int r0, int c0,
                                                    int g, int t, T alpha, T beta) {
    const bool pairs = same_type<T, float>::value &&
                       (reinterpret_cast<unsigned long long>(C) & 7) == 0 && ldc % 2 == 0;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + i * 16 + g + 8 * h;
            if (row >= M) continue;
#pragma unroll
            for (int j = 0; j < NI; ++j) {
                const int col = c0 + j * 8 + 2 * t;
                const long long idx = (long long)row * ldc + col;
                if (pairs && col + 1 < N) {
                    store_c_pair(C, idx, acc[i][j][2 * h], acc[i][j][2 * h + 1], alpha, beta);
                    continue;
                }
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (col + e < N) store_c(C, idx + e, acc[i][j][2 * h + e], alpha, beta);
            }
        }
    }
}

}  // namespace distmm

