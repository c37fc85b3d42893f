// Which keys a query sees and what turns a dot product into a score. A variant sets
//   HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS   score mods (each 0 or 1)
//   HAS_MASK                           a window (causal included) that hides some keys (0 or 1)

// ---- the mask: causal is the window (left = inf, right = 0), aligned bottom-right --------------

// Whether query `i` sees key `j`.
__device__ __forceinline__ bool visible(const FlashParams& p, const SeqInfo& s, int i, int j) {
    int d = j - (i + s.diag);
    return j < s.nk && -p.window_left <= d && d <= p.window_right;
}

// The key blocks that queries [i0, i1) see at all: [*first, *end) in units of `bc` keys.
__device__ __forceinline__ void key_blocks(const FlashParams& p, const SeqInfo& s, int i0, int i1,
                                           int bc, int* first, int* end) {
    i64 lo = (i64)i0 + s.diag - p.window_left;
    i64 hi = (i64)(i1 - 1) + s.diag + p.window_right + 1;
    lo = lo < 0 ? 0 : lo;
    hi = hi > s.nk ? s.nk : hi;
    if (i1 <= i0 || hi <= lo) {
        *first = 0;
        *end = 0;
        return;
    }
    *first = (int)(lo / bc);
    *end = (int)((hi + bc - 1) / bc);
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

// ---- score mods, in the fixed order: s = q.k * scale -> softcap -> alibi + bias -> mask ----------

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
#if HAS_ALIBI
    x -= (T)slope * (T)abs(i + s.diag - j);
#endif
#if HAS_BIAS
    if (i < s.nq && j < s.nk) x += (T)bias_row[(i64)j * p.bias_col];
#endif
    return x;
}

// d score / d (q.k * scale) at raw dot product `dot`: the softcap's 1 - tanh^2, else 1 (ALiBi and
// the bias add terms that do not depend on the dot product).
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
