// The shared vocabulary of every forward kernel: scalar types, dtype conversions (inline PTX, so
// NVRTC needs no CUDA headers), the parameter struct, the mask predicate and the score mods.
//
// A variant is selected by `#define`s pasted before this file:
//   ELEM_F32 | ELEM_F16 | ELEM_BF16   the dtype of q, k, v and out
//   HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS   score mods (each 0 or 1)
//   HAS_MASK                           a window (causal included) that hides some keys (0 or 1)

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (-__int_as_float(0x7f800000))

// ---- dtype conversions -------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two f32 rounded into one register: `lo` at the lower address (the first element of a pair).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#if defined(ELEM_F32)
typedef float elem_t;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float from_f32(float x) { return x; }
#elif defined(ELEM_F16)
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return f16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_f16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_f16x2(lo, hi); }
#elif defined(ELEM_BF16)
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return bf16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_bf16x2(lo, hi); }
#else
#error "define one of ELEM_F32, ELEM_F16, ELEM_BF16"
#endif

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- parameters --------------------------------------------------------------------------------

// Pointers already point at each tensor's first element; strides are in elements. Mirrors
// `FlashParams` in src/cuda/params.rs field by field (8-byte fields first, then 4-byte ones).
struct FlashParams {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    const float* bias;
    const float* alibi;  // one slope per (batch, query head)
    const int* cu_q;     // varlen: batch + 1 offsets into the packed rows, else null
    const int* cu_k;
    i64 q_batch, q_row, q_head;
    i64 k_batch, k_row, k_head;
    i64 v_batch, v_row, v_head;
    i64 o_batch, o_row, o_head;
    i64 bias_batch, bias_head, bias_row, bias_col;
    i64 lse_batch, lse_head;
    int batch, heads_q, group;  // group: query heads per key/value head
    int nq, nk;                 // padded lengths (unused with varlen)
    int head_dim, head_dim_v;
    int window_left, window_right;  // clamped to 2^30 (= unbounded)
    float scale, scale_log2, softcap;
};

// One (batch, query head) of a launch: where its rows start and how many there are.
struct SeqInfo {
    int b, h, hk;
    int q_row0, k_row0, nq, nk;
    int diag;  // key position of query 0's diagonal: nk - nq
};

// The launch grid is (query blocks, query heads, batch): consecutive blocks share a head's K/V,
// which then stays in L2 while they run.
__device__ __forceinline__ SeqInfo seq_info(const FlashParams& p) {
    SeqInfo s;
    s.b = blockIdx.z;
    s.h = blockIdx.y;
    s.hk = s.h / p.group;
    if (p.cu_q != 0) {
        s.q_row0 = p.cu_q[s.b];
        s.k_row0 = p.cu_k[s.b];
        s.nq = p.cu_q[s.b + 1] - s.q_row0;
        s.nk = p.cu_k[s.b + 1] - s.k_row0;
    } else {
        s.q_row0 = 0;
        s.k_row0 = 0;
        s.nq = p.nq;
        s.nk = p.nk;
    }
    s.diag = s.nk - s.nq;
    return s;
}

// The first query row of this block: heaviest query blocks first (under a causal mask the last
// rows see the most keys), so the light ones fill the tail of the grid.
__device__ __forceinline__ int block_row0(int rows) { return (gridDim.x - 1 - blockIdx.x) * rows; }

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

// ---- online softmax: one running max (log2 units) and sum per row -------------------------------

// `m` is -inf until the row has seen a visible key; exp2 of (-inf - 0) is 0, never NaN.
__device__ __forceinline__ float softmax_shift(float m) { return m == NEG_INF ? 0.f : m; }

// A NaN score is skipped by the running max (fmaxf) but reaches the sum through its exp2, so a row
// whose visible scores hold a NaN ends with l = NaN: its output and LSE become NaN, as in peers.
// Masked keys are -inf before the exp2, so a NaN there never reaches a row that does not see it.

// Natural-log LSE of a finished row: -inf when it saw no key (l = 0), NaN when l is NaN.
__device__ __forceinline__ float softmax_lse(float m_log2, float l) {
    return l == 0.f ? NEG_INF : (m_log2 + log2f(l)) * LN2;
}

// 1 / l, 0 for a row that saw no key (its O is 0), NaN when l is NaN.
__device__ __forceinline__ float softmax_inv_sum(float l) { return l == 0.f ? 0.f : 1.f / l; }
