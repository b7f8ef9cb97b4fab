// The cp.async pipelined main loop shared by step 7 (double buffering, block-wide thread
// grid) and step 8 (warp tiling, 2-4 stages), and the pipeline's pieces (accumulator
// zeroing, prologue, stage rotation) that steps 9, 11 and 12 use around their own k loops.
// Included by steps 7-10 and by tensorcore.cuh (steps 11-14); not a kernel by itself.
//
// Shared memory keeps each operand in the layout it has in global memory, so every copy is
// a 16-byte cp.async with no trip through registers (a transpose cannot be done by
// cp.async):
//   op(A): A stored M x K (TA = false) -> As[m][k] (k contiguous), padded so that a row is
//          an odd number of 16-byte chunks; A stored K x M (TA) -> As[k][m].
//   op(B): B stored K x N (TB = false) -> Bs[k][n];  B stored N x K (TB) -> Bs[n][k], padded.
// The inner loop reads V = 16/sizeof(T) consecutive k of a row at once in the k-contiguous
// layouts and V consecutive m (n) in the others, always as 16-byte shared loads.
//
// Threads: the block's BM x BN tile is split into (BM/WM) x (BN/WN) "warp tiles", each
// computed by LM x LN = (WM/TM) x (WN/TN) threads that own TM x TN accumulators. With
// LM * LN == 32 a warp tile is a warp (step 8); step 7 uses one warp tile for the whole block.
// A thread's rows and columns are interleaved so that, in every quarter warp, lanes either
// read the same 16 bytes (broadcast) or consecutive 16-byte chunks: no bank conflicts.
#pragma once
#include "common.cuh"

namespace distmm {

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          bool TA, bool TB>
struct PipelinedShape {
    static constexpr int V = vec16<T>::n;
    static constexpr int LM = WM / TM, LN = WN / TN, LANES = LM * LN;
    static constexpr int WGM = BM / WM, WGN = BN / WN;
    static constexpr int NT = WGM * WGN * LANES;
    static constexpr int A_ROWS = TA ? BK : BM, A_COLS = TA ? BM : BK;
    static constexpr int A_LD = A_COLS + ((!TA && (BK / V) % 2 == 0) ? V : 0);
    static constexpr int B_ROWS = TB ? BN : BK, B_COLS = TB ? BK : BN;
    static constexpr int B_LD = B_COLS + ((TB && (BK / V) % 2 == 0) ? V : 0);
    static constexpr int A_STAGE = A_ROWS * A_LD, B_STAGE = B_ROWS * B_LD;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * (int)sizeof(T);
    static_assert(WM % TM == 0 && WN % TN == 0 && BM % WM == 0 && BN % WN == 0, "tile shapes");
    static_assert(TM % V == 0 && TN % V == 0 && BK % V == 0, "16-byte vectors");
    static_assert(NT <= 1024 && STAGES >= 2, "threads and stages");
};

// Grouped tile order (steps 8-10): GROUP row-tiles of C are swept together so the B panels
// they read stay in L2. Sets the block's C tile origin (m0, n0) from blockIdx.x.
// (bid: the tile's index in that order; step 10's split tail passes its own.) Mirrored by
// distmm.executor.cuda_loader.grouped_tile_origins for the split tail's fix-up.
template <int BM, int BN>
__device__ __forceinline__ void grouped_tile_origin(int M, int N, int& m0, int& n0,
                                                    int bid = blockIdx.x) {
    const int grid_m = (M + BM - 1) / BM, grid_n = (N + BN - 1) / BN;
    constexpr int GROUP = 8;
    const int width = GROUP * grid_n;
    const int first_m = (bid / width) * GROUP;
    const int gsize = min(grid_m - first_m, GROUP);
    m0 = (first_m + (bid % width) % gsize) * BM;
    n0 = ((bid % width) / gsize) * BN;
}

// The k tile at k0 of op(A) (BM x BK, stored BK x BM when TA) and of op(B) (BK x BN, stored
// BN x BK when TB) into one stage, with bounds checks (edge tiles).
template <typename T, int BM, int BK, int A_LD, int NT, bool TA>
__device__ __forceinline__ void a_tile_edge(T* as, const T* A, long long lda, int m0, int k0,
                                            int M, int K, bool vec, int tid) {
    if (!TA) tile_to_smem_async<T, BM, BK, A_LD, NT>(as, A, lda, m0, k0, M, K, vec, tid);
    else     tile_to_smem_async<T, BK, BM, A_LD, NT>(as, A, lda, k0, m0, K, M, vec, tid);
}

template <typename T, int BK, int BN, int B_LD, int NT, bool TB>
__device__ __forceinline__ void b_tile_edge(T* bs, const T* B, long long ldb, int k0, int n0,
                                            int K, int N, bool vec, int tid) {
    if (!TB) tile_to_smem_async<T, BK, BN, B_LD, NT>(bs, B, ldb, k0, n0, K, N, vec, tid);
    else     tile_to_smem_async<T, BN, BK, B_LD, NT>(bs, B, ldb, n0, k0, N, K, vec, tid);
}

// Both operands' k tile at k0 (steps 8 and 9): an interior tile (the whole block tile inside
// C, 16-byte aligned operands, a full k tile) is copied without bounds checks.
template <typename T, int BM, int BN, int BK, int A_LD, int B_LD, int NT, bool TA, bool TB>
__device__ __forceinline__ void ab_tile(T* as, T* bs, const T* A, long long lda, const T* B,
                                        long long ldb, int m0, int n0, int k0, int M, int N, int K,
                                        bool a_rows_in, bool b_cols_in, bool vec_a, bool vec_b,
                                        int tid) {
    const bool k_in = k0 + BK <= K;
    if (a_rows_in && k_in) {
        if (!TA) tile_to_smem_async_interior<T, BM, BK, A_LD, NT>(as, A, lda, m0, k0, tid);
        else     tile_to_smem_async_interior<T, BK, BM, A_LD, NT>(as, A, lda, k0, m0, tid);
    } else {
        a_tile_edge<T, BM, BK, A_LD, NT, TA>(as, A, lda, m0, k0, M, K, vec_a, tid);
    }
    if (b_cols_in && k_in) {
        if (!TB) tile_to_smem_async_interior<T, BK, BN, B_LD, NT>(bs, B, ldb, k0, n0, tid);
        else     tile_to_smem_async_interior<T, BN, BK, B_LD, NT>(bs, B, ldb, n0, k0, tid);
    } else {
        b_tile_edge<T, BK, BN, B_LD, NT, TB>(bs, B, ldb, k0, n0, K, N, vec_b, tid);
    }
}

// Accumulators (a scalar, or an array of any rank) set to zero (steps 7-9, 11, 12).
template <typename X>
__device__ __forceinline__ void zero_acc(X& x) { x = X(0); }

template <typename X, int N>
__device__ __forceinline__ void zero_acc(X (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) zero_acc(a[i]);
}

// The cp.async multi-stage pipeline (steps 7-9, 11, 12), in pieces around the caller's k
// loop; load_tile(kt, stage) issues the copies of k tile kt into a stage:
//   cp_async_prologue<STAGES>(KT, load_tile);
//   int read_stage = 0, write_stage = STAGES - 1;
//   for (int kt = 0; kt < KT; ++kt) {
//       cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
//       ... compute on stage read_stage ...
//       read_stage = next_stage<STAGES>(read_stage);
//       write_stage = next_stage<STAGES>(write_stage);
//   }
//   cp_async_wait<0>();
// Prologue: the first STAGES - 1 k tiles, one commit group each (empty past KT).
template <int STAGES, typename Load>
__device__ __forceinline__ void cp_async_prologue(int KT, Load& load_tile) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_tile(s, s);
        cp_async_commit();
    }
}

// Start of iteration kt: wait for tile kt, pass the barrier, issue tile kt + STAGES - 1.
template <int STAGES, typename Load>
__device__ __forceinline__ void cp_async_next_tile(int kt, int KT, int write_stage, Load& load_tile) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt is visible to all; stage write_stage is no longer read
    if (kt + STAGES - 1 < KT) load_tile(kt + STAGES - 1, write_stage);
    cp_async_commit();
}

// The stage after stage s, around the ring.
template <int STAGES>
__device__ __forceinline__ int next_stage(int s) {
    return s + 1 == STAGES ? 0 : s + 1;
}

template <typename T, int BM, int BN, int BK, int WM, int WN, int TM, int TN, int STAGES,
          bool TA, bool TB>
__device__ __forceinline__ void pipelined_body(int M, int N, int K, T alpha, const T* __restrict__ A,
                                               long long lda, const T* __restrict__ B, long long ldb,
                                               T beta, T* __restrict__ C, long long ldc, int flags) {
    typedef PipelinedShape<T, BM, BN, BK, WM, WN, TM, TN, STAGES, TA, TB> S;
    typedef typename acc_type<T>::type Acc;
    constexpr int V = S::V, LM = S::LM, LN = S::LN, NT = S::NT;
    extern __shared__ __align__(16) unsigned char distmm_smem[];
    T* As = reinterpret_cast<T*>(distmm_smem);
    T* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x;
    int m0, n0;
    grouped_tile_origin<BM, BN>(M, N, m0, n0);
    const bool vec_a = flags & DISTMM_VEC_A, vec_b = flags & DISTMM_VEC_B;

    const int warp = tid / S::LANES, lane = tid % S::LANES;
    const int wm = warp / S::WGN, wn = warp % S::WGN;
    const int lm = lane / LN, ln = lane % LN;
    // Row of C (within the block tile) of a thread's accumulator row i, column of column j.
    const int row_base = wm * WM + (TA ? lm * V : lm);
    const int col_base = wn * WN + (TB ? ln : ln * V);
#define DISTMM_ROW(i) (row_base + (TA ? ((i) / V) * (LM * V) + (i) % V : (i) * LM))
#define DISTMM_COL(j) (col_base + (TB ? (j) * LN : ((j) / V) * (LN * V) + (j) % V))

    const bool a_rows_in = vec_a && m0 + BM <= M, b_cols_in = vec_b && n0 + BN <= N;
    auto load_tile = [&](int kt, int stage) {
        ab_tile<T, BM, BN, BK, S::A_LD, S::B_LD, NT, TA, TB>(
            As + stage * S::A_STAGE, Bs + stage * S::B_STAGE, A, lda, B, ldb, m0, n0, kt * BK,
            M, N, K, a_rows_in, b_cols_in, vec_a, vec_b, tid);
    };

    Acc acc[TM][TN];
    zero_acc(acc);

    const int KT = (K + BK - 1) / BK;
    cp_async_prologue<STAGES>(KT, load_tile);
    int read_stage = 0, write_stage = STAGES - 1;
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_next_tile<STAGES>(kt, KT, write_stage, load_tile);
        const T* as = As + read_stage * S::A_STAGE;
        const T* bs = Bs + read_stage * S::B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += V) {
            // Fragments: a k-contiguous layout gives all V k-steps of a row in one 16-byte
            // read, so those are loaded up front; the other layouts are loaded one k-step
            // at a time, which keeps fewer registers live.
            T a[TA ? 1 : V][TM], b[TB ? V : 1][TN];
            if (!TA) {
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    T t[V];
                    ld16(as + DISTMM_ROW(i) * S::A_LD + kk, t);
#pragma unroll
                    for (int v = 0; v < V; ++v) a[v][i] = t[v];
                }
            }
            if (TB) {
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    T t[V];
                    ld16(bs + DISTMM_COL(j) * S::B_LD + kk, t);
#pragma unroll
                    for (int v = 0; v < V; ++v) b[v][j] = t[v];
                }
            }
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const int ai = TA ? 0 : v, bi = TB ? v : 0;
                if (TA) {
#pragma unroll
                    for (int i = 0; i < TM; i += V) ld16(as + (kk + v) * S::A_LD + DISTMM_ROW(i), &a[0][i]);
                }
                if (!TB) {
#pragma unroll
                    for (int j = 0; j < TN; j += V) ld16(bs + (kk + v) * S::B_LD + DISTMM_COL(j), &b[0][j]);
                }
#pragma unroll
                for (int i = 0; i < TM; ++i)
#pragma unroll
                    for (int j = 0; j < TN; ++j) acc[i][j] = madd(a[ai][i], b[bi][j], acc[i][j]);
            }
        }
        read_stage = next_stage<STAGES>(read_stage);
        write_stage = next_stage<STAGES>(write_stage);
    }
    cp_async_wait<0>();

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
