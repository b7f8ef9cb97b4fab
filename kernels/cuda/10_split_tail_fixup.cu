// Step 10's split tail, second half (the fix-up launched after 10_simt_fp64.cu's split
// launch, see distmm/executor/cuda_loader.py: launch and split_tail_plan).
//
// The last, partly filled wave of C tiles was computed as s partial BM x BN sums, each over
// one range of k, into a workspace w[s][r][BM*BN]. This kernel adds them in ascending k:
//   C tile t (origin m0[t], n0[t]) = alpha * (sum over z of w[z][t]) + beta * C,
// one thread per element; C is not read when beta == 0. The order of the sum is fixed, so
// the result is the same on every run.
//
// Plain extern "C" names (no templates), one per element type, so that CuPy caches the
// module on disk and the loader needs no lowered names.

#define DISTMM_FIXUP(NAME, T)                                                                  \
extern "C" __global__ void NAME(const T* __restrict__ w, const long long* __restrict__ m0,   \
                                const long long* __restrict__ n0, int r, int s, int bm, int bn, \
                                int M, int N, T alpha, T beta, T* __restrict__ c, long long ldc) { \
    const long long tile_elems = (long long)bm * bn;                                           \
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (i >= tile_elems * r) return;                                                           \
    const long long t = i / tile_elems, e = i % tile_elems;                                    \
    const long long row = m0[t] + e / bn, col = n0[t] + e % bn;                                \
    if (row >= M || col >= N) return;                                                          \
    T acc = 0;                                                                                 \
    for (int z = 0; z < s; ++z) acc += w[((long long)z * r + t) * tile_elems + e];             \
    const long long idx = row * ldc + col;                                                     \
    T v = alpha * acc;                                                                         \
    if (beta != T(0)) v = v + beta * c[idx];                                                   \
    c[idx] = v;                                                                                \
}

DISTMM_FIXUP(distmm_split_tail_fixup_float, float)
DISTMM_FIXUP(distmm_split_tail_fixup_double, double)
