// Which keys a query sees and what turns a dot product into a score. A variant sets
//   HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_REL_BIAS   score mods (each 0 or 1)
//   HAS_MASK                           a window (causal included) that hides some keys (0 or 1)
// and the tensor-core kernels NONPOS_SCALE (scale <= 0); SCORE_MODS says whether any score mod is on.

#define SCORE_MODS (HAS_SOFTCAP || HAS_ALIBI || HAS_BIAS || HAS_REL_BIAS || NONPOS_SCALE)

// ---- the mask: causal is the window (left = inf, right = 0) around query i's key i + diag -------

// Whether query `i` sees key `j`.
__device__ __forceinline__ bool visible(const FlashParams& p, const SeqInfo& s, int i, int j) {
    int d = j - (i + s.diag);
    return j < s.nk && -p.window_left <= d && d <= p.window_right;
}

// The key blocks that queries [i0, i1) see at all: [*first, *end) in units of `bc` keys. In 32 bits:
// i + diag lies in (-2^31, nk) for a row i of the sequence under the default diag = nk - nq and
// within ±2^30 under a given one (src/cuda/diagonal.rs), and the window edges are at most 2^30,
// so each edge is clamped to [0, nk] before it could overflow.
__device__ __forceinline__ void key_blocks(const FlashParams& p, const SeqInfo& s, int i0, int i1,
                                           int bc, int* first, int* end) {
    const int a = i0 + s.diag, b = i1 - 1 + s.diag;
    const int lo = a > p.window_left ? a - p.window_left : 0;
    const int hi = b < s.nk - 1 - p.window_right ? b + p.window_right + 1 : s.nk;
    if (i1 <= i0 || hi <= lo) {
        *first = 0;
        *end = 0;
        return;
    }
    *first = lo / bc;
    *end = (hi + bc - 1) / bc;
}

// The query rows that see any key of [j0, j1): [*first, *end), the mirror of key_blocks (a key
// block of the backward walks only these rows).
__device__ __forceinline__ void query_rows(const FlashParams& p, const SeqInfo& s, int j0, int j1,
                                           int* first, int* end) {
    j1 = min(j1, s.nk);
    i64 lo = (i64)j0 - s.diag - p.window_right;
    i64 hi = (i64)(j1 - 1) - s.diag + p.window_left + 1;
    lo = lo < 0 ? 0 : lo;
    hi = hi > s.nq ? s.nq : hi;
    if (j1 <= j0 || hi <= lo) {
        *first = 0;
        *end = 0;
        return;
    }
    *first = (int)lo;
    *end = (int)hi;
}

// True when every query in [i0, i1) sees every key in [j0, j0 + bc): such a block needs no mask.
__device__ __forceinline__ bool block_is_full(const FlashParams& p, const SeqInfo& s, int i0, int i1,
                                              int j0, int bc) {
    if (j0 + bc > s.nk) return false;
#if HAS_MASK
    i64 lo = (i64)(i1 - 1) + s.diag - p.window_left;
    i64 hi = (i64)i0 + s.diag + p.window_right + 1;
    return lo <= j0 && (i64)j0 + bc <= hi;
#else
    return true;
#endif
}

// ---- score mods, in the fixed order: s = q.k * scale -> softcap -> alibi + biases -> mask --------

// The column of the relative-position table that a pair at distance d = j - (i + diag) from the
// diagonal reads: d clamped to [-r, r], plus r.
template <typename I>
__device__ __forceinline__ int rel_column(int r, I d) { return (int)(d < -r ? 0 : d > r ? 2 * r : d + r); }

// The relative-position table's entry of query `i`, key `j` of this head (always in the table);
// the distance in 32 bits, as `visible` takes it.
__device__ __forceinline__ float rel_bias_of(const FlashParams& p, const SeqInfo& s, int i, int j) {
    const int r = p.rel_radius;
    return p.rel_bias[(i64)s.h * (2 * r + 1) + rel_column(r, j - (i + s.diag))];
}

// The mods after the softcap (ALiBi and the biases) on a softcapped score `x`.
template <typename T>
__device__ __forceinline__ T score_bias(const FlashParams& p, const SeqInfo& s, T x, int i, int j, float slope,
                                        const float* bias_row) {
#if HAS_ALIBI
    x -= (T)slope * (T)abs(i + s.diag - j);
#endif
#if HAS_BIAS
    if (i < s.nq && j < s.nk) x += (T)bias_row[(i64)j * p.bias_col];
#endif
#if HAS_REL_BIAS
    x += (T)rel_bias_of(p, s, i, j);
#endif
    return x;
}

// Score of query `i`, key `j` (both within the sequence) from the raw dot product, in natural units.
// `slope` is the ALiBi slope of this (batch, head); `bias_row` points at bias[b, h, i, 0].
// T is float (tensor-core kernel) or double (CUDA-core kernel, see flash_fwd_general.cu).
template <typename T>
__device__ __forceinline__ T score_mods(const FlashParams& p, const SeqInfo& s, T dot, int i, int j,
                                        float slope, const float* bias_row) {
    T x = dot * (T)p.scale;
#if HAS_SOFTCAP
    x = (T)p.softcap * tanh(x / (T)p.softcap);
#endif
    return score_bias(p, s, x, i, j, slope, bias_row);
}

// d score / d (q.k * scale) at raw dot product `dot`: the softcap's 1 - tanh^2, else 1 (ALiBi and
// the biases add terms that do not depend on the dot product).
__device__ __forceinline__ float score_mods_grad(const FlashParams& p, float dot) {
#if HAS_SOFTCAP
    const float t = tanhf(dot * p.scale / p.softcap);
    return 1.f - t * t;
#else
    return 1.f;
#endif
}

__device__ __forceinline__ float alibi_slope(const FlashParams& p, const SeqInfo& s) {
#if HAS_ALIBI
    return p.alibi[s.b * p.heads_q + s.h];
#else
    return 0.f;
#endif
}

__device__ __forceinline__ const float* bias_row_ptr(const FlashParams& p, const SeqInfo& s, int i) {
#if HAS_BIAS
    return p.bias + s.b * p.bias_batch + s.h * p.bias_head + (i64)i * p.bias_row;
#else
    return 0;
#endif
}

// ---- on the tensor cores' accumulators ------------------------------------------------------

// Score mods and the mask on MT slices of 16 rows of scores in the m16n8 C-fragment layout, CHUNKS
// chunks of 8 keys each: c[4 (CHUNKS m + n) + 2h + e] is row i + 16m + 8h, key j0 + 8n + 2t + e
// (t = lane % 4). `full`: the block needs no mask. Without score mods only a partial block is touched.
template <int MT, int CHUNKS>
__device__ __forceinline__ void mods_and_mask(const FlashParams& p, const SeqInfo& s, float* c, int i, int j0,
                                              int t, bool full, float slope) {
#if SCORE_MODS
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {  // r = 2m + h: row i + 8r
        const float* brow = bias_row_ptr(p, s, i + 8 * r);
#pragma unroll
        for (int n = 0; n < CHUNKS; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = c[4 * (CHUNKS * (r >> 1) + n) + 2 * (r & 1) + e];
                const int j = j0 + n * 8 + 2 * t + e;
                x = score_mods(p, s, x, i + 8 * r, j, slope, brow);
                if (!full && !visible(p, s, i + 8 * r, j)) x = NEG_INF;
            }
    }
#else
    if (full) return;
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r)
#pragma unroll
        for (int n = 0; n < CHUNKS; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (!visible(p, s, i + 8 * r, j0 + n * 8 + 2 * t + e))
                    c[4 * (CHUNKS * (r >> 1) + n) + 2 * (r & 1) + e] = NEG_INF;
#endif
}
