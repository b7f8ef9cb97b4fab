// Step 10: a SIMT (DFMA/FFMA on the CUDA cores, no mma) kernel shaped for float64 on Hopper.
//
// It keeps step 8's cp.async multi-stage global -> shared pipeline, shared layouts and
// thread mapping (pipelined.cuh: operands kept in their global layout, rows padded so that
// fragment reads are broadcasts or conflict-free) and changes the inner loop:
//
// - the float64 default: 64 x 128 blocks of 4 warps of 64 x 32, 8 x 8 accumulators a thread
//   (128 registers of them), 2 blocks per SM (bench/simt64.py searched the 8 x 8 shapes; the
//   8 x 4 / 4-warps-per-scheduler shape of the first version ran slower: fewer FMAs per
//   shared load);
// - fragments of ONE k at a time, explicitly double-buffered in registers: the fragments of
//   k + 1 are read from shared memory while the TM x TN FMAs of k issue;
// - the prefetch crosses the k-tile boundary: in the last k of a tile the thread waits for
//   the next tile's cp.async group, passes the (only) barrier of the tile and reads the
//   next tile's first fragments before issuing the FMAs of the tile's last k, so the
//   barrier and the load latency overlap the FMAs; the cp.async copies refilling the freed
//   stage are issued after those FMAs;
// - the k loop runs one pair of k per iteration and each k's FMAs go row by row in zig-zag
//   order: fully unrolled, ptxas interleaved the FMAs of many k and rows and lost most of
//   the operand reuse (bench/NOTES.md, "pair of k");
// - m- (n-) contiguous operands are read as 16-byte vectors (LDS.128: double2), k-contiguous
//   ones one element per row (NN: 8 LDS.64 + 4 LDS.128 per 64 DFMA);
// - the last, partly filled wave of tiles can be split along k (DISTMM_SPLIT_TAIL below).
//
// On boards with a power cap the kernel can run at the cap, where the clock sets its speed;
// see bench/NOTES.md.
// Parameters as step 8 (see distmm/executor/registry.py); BK must be even (the two fragment buffers
// alternate within and across tiles). All four element types instantiate the same code.
#include "pipelined.cuh"

// Compile-time variants of the inner loop for A/B runs (bench/simt64_variants.py); the
// defaults are the fastest variants (bench/NOTES.md, step 10).
#ifndef DISTMM_SIMT_KPAIRS
#define DISTMM_SIMT_KPAIRS 1
#endif
#ifndef DISTMM_SIMT_ORDER
#define DISTMM_SIMT_ORDER 0
#endif
#define DISTMM_DO_PRAGMA(x) _Pragma(#x)
#define DISTMM_PRAGMA_UNROLL(n) DISTMM_DO_PRAGMA(unroll n)

namespace distmm {

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          bool TA, bool TB>
__device__ __forceinline__ void simt_fp64_body(int M, int N, int K, T alpha, const T* __restrict__ A,
                                               long long lda, const T* __restrict__ B, long long ldb,
                                               T beta, T* __restrict__ C, long long ldc, int flags) {
    typedef PipelinedShape<T, BM, BN, BK, WM, WN, TM, TN, STAGES, TA, TB> S;
    typedef typename acc_type<T>::type Acc;
    constexpr int V = S::V, LM = S::LM, LN = S::LN, NT = S::NT;
    static_assert(BK % 2 == 0, "BK must be even: two fragment buffers alternate");
    extern __shared__ __align__(16) unsigned char distmm_smem[];
    T* As = reinterpret_cast<T*>(distmm_smem);
    T* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    // Split tail (flags & DISTMM_SPLIT_TAIL, see distmm.executor.cuda_loader): this launch
    // computes the last gridDim.x tiles of the grouped order, each split into gridDim.y
    // ranges of k tiles, and writes raw partial sums (no alpha, beta) to C as a workspace
    // of gridDim.y x gridDim.x BM x BN tiles; a fix-up sums them in ascending k.
    const bool tail = flags & DISTMM_SPLIT_TAIL;
    const int KT_ALL = (K + BK - 1) / BK;
    int bid = blockIdx.x, kt_begin = 0, KT = KT_ALL;
    if (tail) {
        bid = ((M + BM - 1) / BM) * ((N + BN - 1) / BN) - (int)gridDim.x + (int)blockIdx.x;
        kt_begin = (int)(((long long)blockIdx.y * KT_ALL) / gridDim.y);
        KT = (int)(((long long)(blockIdx.y + 1) * KT_ALL) / gridDim.y) - kt_begin;
    }
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0, bid);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;

    const int warp = tid / S::LANES, lane = tid % S::LANES;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int lm = lane / LN, ln = lane % LN;
    const int row_base = wm * WM + (TA ? lm * V : lm);
    const int col_base = wn * WN + (TB ? ln : ln * V);
#define DISTMM_ROW(i) (row_base + (TA ? ((i) / V) * (LM * V) + (i) % V : (i) * LM))
#define DISTMM_COL(j) (col_base + (TB ? (j) * LN : ((j) / V) * (LN * V) + (j) % V))

    const bool a_rows_in = vec_a && m0 + BM <= M, b_cols_in = vec_b && n0 + BN <= N;
    // Interior tiles: each thread's source pointers are set once here and advanced by one
    // k tile per load (the tiles are loaded in order 0, 1, 2, ...), so a tile's copies
    // cost one 64-bit add per chunk instead of recomputing every address (ncu: ~140
    // integer instructions per k tile per warp before, next to 1024 DFMA).
    typedef IncrementalTileCopy<T, (TA ? BK : BM), (TA ? BM : BK), S::A_LD, NT> CopyA;
    typedef IncrementalTileCopy<T, (TB ? BN : BK), (TB ? BK : BN), S::B_LD, NT> CopyB;
    const int kb = kt_begin * BK;
    CopyA copy_a(A, lda, TA ? kb : m0, TA ? m0 : kb, tid);
    CopyB copy_b(B, ldb, TB ? n0 : kb, TB ? kb : n0, tid);
    const unsigned as_base = smem_addr(As), bs_base = smem_addr(Bs);
    const long long a_tile_step = TA ? (long long)BK * lda : BK;
    const long long b_tile_step = TB ? BK : (long long)BK * ldb;
    auto load_tile = [&](int kt, int stage) {
        const int k0 = (kt_begin + kt) * BK;
        const bool k_in = k0 + BK <= K;
        T* as = As + stage * S::A_STAGE;
        T* bs = Bs + stage * S::B_STAGE;
        if (a_rows_in && k_in) {
            copy_a.copy(as_base + stage * (unsigned)(S::A_STAGE * sizeof(T)), lda);
        } else {
            a_tile_edge<T, BM, BK, S::A_LD, NT, TA>(as, A, lda, m0, k0, M, K, vec_a, tid);
        }
        if (b_cols_in && k_in) {
            copy_b.copy(bs_base + stage * (unsigned)(S::B_STAGE * sizeof(T)), ldb);
        } else {
            b_tile_edge<T, BK, BN, S::B_LD, NT, TB>(bs, B, ldb, k0, n0, K, N, vec_b, tid);
        }
        copy_a.advance(a_tile_step);
        copy_b.advance(b_tile_step);
    };

    // This thread's fragment base offsets inside a stage (element (row, k) / (k, col)).
    const int a_off = TA ? DISTMM_ROW(0) : DISTMM_ROW(0) * S::A_LD;
    const int b_off = TB ? DISTMM_COL(0) * S::B_LD : DISTMM_COL(0);
    // Fragments of one k: a[i] = op(A)(row i, k), b[j] = op(B)(k, col j).
    auto load_frag = [&](T (&a)[TM], T (&b)[TN], const T* as, const T* bs, int kk) {
        if (!TA) {
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = as[a_off + i * LM * S::A_LD + kk];
        } else {
#pragma unroll
            for (int i = 0; i < TM; i += V) ld16(as + a_off + kk * S::A_LD + (i / V) * (LM * V), &a[i]);
        }
        if (TB) {
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = bs[b_off + j * LN * S::B_LD + kk];
        } else {
#pragma unroll
            for (int j = 0; j < TN; j += V) ld16(bs + b_off + kk * S::B_LD + (j / V) * (LN * V), &b[j]);
        }
    };

    Acc acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_tile(s, s);
        cp_async_commit();
    }
    // Tile 0's boundary (as every later one below): wait for the tile, one barrier, then
    // refill the stage that the previous tile used (here: the last, still empty, stage).
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (STAGES - 1 < KT) load_tile(STAGES - 1, STAGES - 1);
    cp_async_commit();
    int read_stage = 0, write_stage = 0;

    // One k's TM x TN FMAs. Rows alternate direction (zig-zag): the last b of a row is the
    // first of the next, which the DFMA probes ran at 80.7% of the DFMA rate against 78.8%
    // row by row (bench/dfma_probe.py --orders); DISTMM_SIMT_ORDER=1 walks columns the same
    // way. The order of independent FMAs leaves every accumulator's k order, and so the
    // result, unchanged.
    auto fma_k = [&](const T (&a)[TM], const T (&b)[TN]) {
        if (DISTMM_SIMT_ORDER == 0) {
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int jj = 0; jj < TN; ++jj) {
                    const int j = (i & 1) ? TN - 1 - jj : jj;
                    acc[i][j] = madd(a[i], b[j], acc[i][j]);
                }
        } else {
#pragma unroll
            for (int j = 0; j < TN; ++j)
#pragma unroll
                for (int ii = 0; ii < TM; ++ii) {
                    const int i = (j & 1) ? TM - 1 - ii : ii;
                    acc[i][j] = madd(a[i], b[j], acc[i][j]);
                }
        }
    };

    // Fragments of k live in fa/fb[k & 1]; those of k + 1 are read while k's FMAs issue.
    T fa[2][TM], fb[2][TN];
    if (KT > 0) load_frag(fa[0], fb[0], As, Bs, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const T* as = As + read_stage * S::A_STAGE;
        const T* bs = Bs + read_stage * S::B_STAGE;
        // k = 0 .. BK - 3 in pairs, one pair per loop iteration (DISTMM_SIMT_KPAIRS): with
        // the whole tile unrolled (KPAIRS >= BK / 2) ptxas interleaves the FMAs of many k
        // and rows, losing operand reuse, and the kernel runs slower (bench/NOTES.md).
        DISTMM_PRAGMA_UNROLL(DISTMM_SIMT_KPAIRS)
        for (int kk = 0; kk < BK - 2; kk += 2) {
            load_frag(fa[1], fb[1], as, bs, kk + 1);
            fma_k(fa[0], fb[0]);
            load_frag(fa[0], fb[0], as, bs, kk + 2);
            fma_k(fa[1], fb[1]);
        }
        load_frag(fa[1], fb[1], as, bs, BK - 1);
        fma_k(fa[0], fb[0]);
        if (kt + 1 < KT) {
            // Every fragment of tile kt is in registers: wait for tile kt + 1, pass the
            // barrier (after which no thread reads tile kt's stage) and read tile kt + 1's
            // first fragments; the FMAs of the tile's last k follow and cover the latency.
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
            load_frag(fa[0], fb[0], As + read_stage * S::A_STAGE, Bs + read_stage * S::B_STAGE, 0);
        }
        fma_k(fa[1], fb[1]);
        if (kt + 1 < KT) {
            // The cp.async copies refilling the freed stage are issued after those FMAs,
            // when this k's fragments are dead: the loader's addresses do not compete with
            // them for registers.
            if (kt + STAGES < KT) load_tile(kt + STAGES, write_stage);
            cp_async_commit();
            write_stage = write_stage + 1 == STAGES ? 0 : write_stage + 1;
        }
    }
    cp_async_wait<0>();

    if (tail) {
        T* w = C + ((long long)blockIdx.y * gridDim.x + blockIdx.x) * (BM * BN);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) w[DISTMM_ROW(i) * BN + DISTMM_COL(j)] = (T)acc[i][j];
        return;
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + DISTMM_ROW(i);
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = n0 + DISTMM_COL(j);
            if (col < N) store_c(C, (long long)row * ldc + col, acc[i][j], alpha, beta);
        }
    }
#undef DISTMM_ROW
#undef DISTMM_COL
}

}  // namespace distmm

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          int MINB, bool TA, bool TB>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)
distmm_gemm_simt_fp64(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda,
                      const T* __restrict__ B, long long ldb, T beta, T* __restrict__ C,
                      long long ldc, int flags) {
    static_assert((WM / TM) * (WN / TN) == 32, "a warp tile is one warp");
    distmm::simt_fp64_body<T, BM, BN, BK, WM, WN, TM, TN, STAGES, TA, TB>(
        M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, flags);
}

#ifndef DISTMM_NVRTC
// The default configurations of distmm/registry.py, for standalone compile checks.
#define DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, MB, TA, TB)                                  \
    template __global__ void distmm_gemm_simt_fp64<T, BM, BN, BK, WM, WN, TM, TN, ST, MB, TA, TB>( \
        int, int, int, T, const T*, long long, const T*, long long, T, T*, long long, int);
#define DISTMM_INST(T, BM, BN, BK, WM, WN, TM, TN, ST, MB)                 \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, MB, false, false)      \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, MB, false, true)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, MB, true, false)       \
    DISTMM_INST2(T, BM, BN, BK, WM, WN, TM, TN, ST, MB, true, true)
DISTMM_INST(double, 64, 128, 16, 64, 32, 8, 8, 4, 1)
DISTMM_INST(float, 128, 64, 16, 32, 32, 8, 4, 3, 1)
DISTMM_INST(int, 128, 64, 16, 32, 32, 8, 4, 3, 1)
DISTMM_INST(long long, 128, 64, 16, 32, 32, 8, 4, 3, 1)
#endif
