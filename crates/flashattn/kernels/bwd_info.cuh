// The backward kernels' parameters: the forward's (q, k, v, out, lse, score options) plus dout, the
// gradients, D = rowsum(dO∘O) and the f32 dQ accumulator, and where a row of each lies.

// Mirrors `BwdParams` in src/cuda/backward/params.rs field by field (8-byte fields first, then
// 4-byte ones). `f.o` points at the forward's output (read only).
struct BwdParams {
    FlashParams f;
    const elem_t* dout;
    elem_t* dq;
    elem_t* dk;
    elem_t* dv;
    float* dbias;     // f32, contiguous in the bias' shape
    float* delta;     // D per query row, indexed like the LSE
    float* dq_accum;  // f32 [query rows][heads_q][accum_pitch] (rows packed like q's)
    i64 dout_batch, dout_row, dout_head;
    i64 dq_batch, dq_row, dq_head;
    i64 dk_batch, dk_row, dk_head;
    i64 dv_batch, dv_row, dv_head;
    i64 dbias_batch, dbias_head, dbias_row, dbias_col;  // 0 along the bias' broadcast dims
    i64 accum_batch;   // dq_accum elements between sequences (0 when packed)
    i64 accum_len;     // elements of dq_accum
    i64 dbias_len;     // elements of dbias (0 without a bias)
    // Deterministic mode with a bias broadcast over query rows: dq_accum holds its partial sums
    // [batch or 1][heads or 1][query block][seqlen_k or 1], per query block of the dQ pass.
    i64 part_batch, part_head, part_block;  // strides (0 along the bias' broadcast dims)
    i64 part_blocks;                        // query blocks
    i64 dbias_heads, dbias_cols;            // the bias' head and key dims (1 when broadcast)
    float* drel_bias;  // f32 [heads_q][2 rel_radius + 1]
    // Deterministic mode: the dQ pass's partial table gradients [batch][heads_q][query block][width].
    float* drel_part;
    i64 drel_len, drel_part_len, drel_blocks;  // elements of drel_bias and drel_part, query blocks
    i64 accum_pitch;  // elements of a dq_accum row: head_dim rounded up to 4 (16 bytes, for TMA)
};

// Row `i` of this (batch, head) in dout, dq, and its f32 dQ accumulator.
__device__ __forceinline__ const elem_t* dout_row(const BwdParams& bp, const SeqInfo& s, int i) {
    return bp.dout + s.b * bp.dout_batch + (i64)(s.q_row0 + i) * bp.dout_row + s.h * bp.dout_head;
}
__device__ __forceinline__ elem_t* dq_row(const BwdParams& bp, const SeqInfo& s, int i) {
    return bp.dq + s.b * bp.dq_batch + (i64)(s.q_row0 + i) * bp.dq_row + s.h * bp.dq_head;
}
__device__ __forceinline__ float* accum_row(const BwdParams& bp, const SeqInfo& s, int i) {
    const FlashParams& p = bp.f;
    return bp.dq_accum + s.b * bp.accum_batch + ((i64)(s.q_row0 + i) * p.heads_q + s.h) * bp.accum_pitch;
}

// The first dK and dV rows of this sequence's key/value head.
__device__ __forceinline__ elem_t* dk_rows(const BwdParams& bp, const SeqInfo& s) {
    return bp.dk + s.b * bp.dk_batch + (i64)s.k_row0 * bp.dk_row + s.hk * bp.dk_head;
}
__device__ __forceinline__ elem_t* dv_rows(const BwdParams& bp, const SeqInfo& s) {
    return bp.dv + s.b * bp.dv_batch + (i64)s.k_row0 * bp.dv_row + s.hk * bp.dv_head;
}

// D of query row `i` of this (batch, head), where the LSE of that row is.
__device__ __forceinline__ i64 lse_index(const FlashParams& p, const SeqInfo& s, int i) {
    return s.b * p.lse_batch + s.h * p.lse_head + s.q_row0 + i;
}

// Where the gradient of bias[b, h, i, j] is summed (broadcast dims have stride 0).
__device__ __forceinline__ float* dbias_at(const BwdParams& bp, const SeqInfo& s, int i, int j) {
    return bp.dbias + s.b * bp.dbias_batch + s.h * bp.dbias_head + (i64)i * bp.dbias_row + (i64)j * bp.dbias_col;
}

// Where the gradient of the table entry that query `i`, key `j` read is summed.
__device__ __forceinline__ float* drel_at(const BwdParams& bp, const SeqInfo& s, int i, int j) {
    const int r = bp.f.rel_radius;
    return bp.drel_bias + (i64)s.h * (2 * r + 1) + rel_column(r, j - (i + s.diag));
}

// The deterministic dQ pass's partial table gradient of query block `blk` (its row of entries).
__device__ __forceinline__ float* drel_part_at(const BwdParams& bp, const SeqInfo& s, int blk) {
    const i64 width = 2 * bp.f.rel_radius + 1;
    return bp.drel_part + (((i64)s.b * bp.f.heads_q + s.h) * bp.drel_blocks + blk) * width;
}

// `*addr += v` in global memory, atomically, nothing returned.
__device__ __forceinline__ void atomic_add_f32(float* addr, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr), "f"(v));
}

// Adds dS of query `i`, key `j` to the biases' gradients (those the variant has), by atomics.
__device__ __forceinline__ void add_bias_grads(const BwdParams& bp, const SeqInfo& s, int i, int j, float ds) {
#if HAS_BIAS
    atomic_add_f32(dbias_at(bp, s, i, j), ds);
#endif
#if HAS_REL_BIAS
    atomic_add_f32(drel_at(bp, s, i, j), ds);
#endif
}

// P of query `i`, key `j` from the raw dot product, the row's LSE·log2(e) `lse2` and the score
// mods, into *pr; returns dS = P∘(dP − D) times the softcap's factor. An element the mask hides
// (`seen` false) gets 0 for both, computed without a branch (so the compiler keeps a step's
// elements in straight-line code) except where a bias would be read outside the problem. The
// biases' gradients (dS before the softcap's factor) are summed here by atomics unless the
// deterministic pass does it.
__device__ __forceinline__ float bwd_p_ds(const BwdParams& bp, const SeqInfo& s, bool seen, float dot, float dp,
                                          int i, int j, float lse2, float delta, float slope, float* pr) {
    const FlashParams& p = bp.f;
#if HAS_BIAS || HAS_REL_BIAS
    if (!seen) {
        *pr = 0.f;
        return 0.f;
    }
#endif
#if HAS_SOFTCAP
    // One tanh for the score and the softcap's factor 1 - tanh^2.
    const float th = tanhf(dot * p.scale / p.softcap);
    const float x = score_bias(p, s, p.softcap * th, i, j, slope, bias_row_ptr(p, s, i)) * LOG2E;
    const float grad = 1.f - th * th;
#elif SCORE_MODS
    const float x = score_mods(p, s, dot, i, j, slope, bias_row_ptr(p, s, i)) * LOG2E, grad = 1.f;
#else
    const float x = dot * p.scale_log2, grad = 1.f;
#endif
    const float e = fast_exp2(x - lse2);
    const float ds = e * (dp - delta);
#if !DETERMINISTIC
    if (seen) add_bias_grads(bp, s, i, j, ds);
#endif
    *pr = seen ? e : 0.f;
    return seen ? ds * grad : 0.f;
}

// The deterministic dQ pass's partial bias gradient of query block `blk`, key `j`.
__device__ __forceinline__ float* part_at(const BwdParams& bp, const SeqInfo& s, int blk, int j) {
    return bp.dq_accum + s.b * bp.part_batch + s.h * bp.part_head + (i64)blk * bp.part_block + (i64)j * bp.dbias_col;
}

// Loads `rows` x `cols` elements (row stride `stride`) as f32 into a ROWS x pitch tile in shared
// memory, zero-filling the rest of its ROWS x width part, by the NT threads of the block.
template <int ROWS, int NT>
__device__ __forceinline__ void load_rows_f32(float* dst, int pitch, int width, const elem_t* src,
                                              i64 stride, int rows, int cols) {
    for (int idx = threadIdx.x; idx < ROWS * width; idx += NT) {
        const int r = idx / width, c = idx - r * width;
        dst[r * pitch + c] = (r < rows && c < cols) ? to_f32(src[r * stride + c]) : 0.f;
    }
}
