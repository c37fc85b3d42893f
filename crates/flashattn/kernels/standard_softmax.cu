// The "standard attention" baseline's own kernels (its two products run through cuBLAS):
//   standard_copy     gathers a strided [batch, seqlen, heads, dim] operand into a contiguous,
//                     zero-padded [batch, heads, max_seqlen, dim] buffer, or scatters such a
//                     buffer back into a strided output;
//   standard_softmax  turns each row of the materialized score matrix S = q·kᵀ·scale into
//                     P = softmax(S) in place, applying the options in the order of the core API
//                     (softcap, then ALiBi and the biases, then the window mask), and writes the
//                     log-sum-exp.
// Like a framework computing in the element type T, every materialized value is rounded to T: the
// scores after each step and P; the softmax itself runs in f32.
//
// Pasted after types.cuh (the element type, conversions and round_elem), like every kernel.

// ---- gather / scatter ----------------------------------------------------------------------------

// Host mirror: `CopyParams` in src/cuda/standard.rs.
struct CopyParams {
    u64 strided;     // elem_t*: the [batch, seqlen, heads, dim] operand (any strides)
    u64 packed;      // elem_t*: [batch, heads, max_n, dim], contiguous
    u64 seq_row0;    // const int*: first row of each sequence in `strided` (varlen), or null
    u64 seq_len;     // const int*: rows of each sequence
    i64 offset;      // element offset of `strided`
    i64 stride_b;    // batch stride of `strided` (0 with varlen)
    i64 stride_row;  // row stride
    i64 stride_head; // head stride
    int batch, heads, max_n, dim;
    int to_packed;   // 1: strided -> packed (rows past a sequence's end become 0); 0: packed -> strided
};

// One thread per element of `packed`; a grid-stride loop covers any size.
extern "C" __global__ void standard_copy(const CopyParams p) {
    const i64 total = (i64)p.batch * p.heads * p.max_n * p.dim;
    const int* row0 = (const int*)p.seq_row0;
    const int* len = (const int*)p.seq_len;
    elem_t* strided = (elem_t*)p.strided;
    elem_t* packed = (elem_t*)p.packed;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const int d = (int)(e % p.dim);
        i64 r = e / p.dim;
        const int i = (int)(r % p.max_n);
        r /= p.max_n;
        const int h = (int)(r % p.heads);
        const int b = (int)(r / p.heads);
        const bool inside = i < len[b];
        const i64 at = p.offset + (i64)b * p.stride_b +
                       (i64)((row0 ? row0[b] : 0) + i) * p.stride_row + (i64)h * p.stride_head + d;
        if (p.to_packed) {
            packed[e] = inside ? strided[at] : from_f32(0.0f);
        } else if (inside) {
            strided[at] = packed[e];
        }
    }
}

// ---- softmax -------------------------------------------------------------------------------------

// Host mirror: `SoftmaxParams` in src/cuda/standard.rs.
struct SoftmaxParams {
    u64 scores;    // elem_t*: [batch, heads, max_nq, max_nk], rows turned into P in place
    u64 lse;       // float*: [batch, heads, max_nq], or [heads, total_q] with varlen
    u64 bias;      // const float*, or null
    u64 rel_bias;  // const float*: relative-position table [heads][2 rel_radius + 1], or null
    u64 slopes;    // const float*: ALiBi slope per (batch, head), or null
    u64 seq_nq;    // const int*: queries of each sequence
    u64 seq_nk;    // const int*: keys of each sequence
    u64 seq_q_row0; // const int*: first packed query row of each sequence (varlen), or null
    i64 bias_offset;
    i64 bias_stride[4]; // b, h, i, j (0 along broadcast dimensions)
    i64 window_left;    // keys before the diagonal a query sees (huge when unbounded)
    i64 window_right;   // keys after it
    i64 diagonal;       // query 0's diagonal of every sequence when diagonal_given, else nk - nq
    int batch, heads, max_nq, max_nk, total_q, rel_radius, diagonal_given;
    float softcap;      // 0: none
};

#define SOFTMAX_THREADS 256

// Max (is_max) or sum over the block; every thread gets the result.
__device__ float block_reduce(float x, bool is_max, float* shared) {
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(0xffffffffu, x, o);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // `shared` may still be read by a previous reduction
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    x = shared[0];
    for (int w = 1; w < SOFTMAX_THREADS / 32; ++w) x = is_max ? fmaxf(x, shared[w]) : x + shared[w];
    return x;
}

// One block per (batch·head, query row): a 1-D grid of batch·heads·max_nq blocks.
extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS) standard_softmax(const SoftmaxParams p) {
    __shared__ float red[SOFTMAX_THREADS / 32];
    const int i = (int)(blockIdx.x % (u32)p.max_nq);
    const int bh = (int)(blockIdx.x / (u32)p.max_nq);
    const int b = bh / p.heads, h = bh % p.heads;
    const int nq = ((const int*)p.seq_nq)[b];
    const int nk = ((const int*)p.seq_nk)[b];
    elem_t* row = (elem_t*)p.scores + ((i64)bh * p.max_nq + i) * p.max_nk;
    if (i >= nq) {
        // Padding row of a shorter sequence: zeros, so the product with V stays finite.
        for (int j = threadIdx.x; j < p.max_nk; j += SOFTMAX_THREADS) row[j] = from_f32(0.0f);
        return;
    }
    // Keys query i sees: the window around its diagonal position i + diagonal, within 0..nk
    // (|diagonal| <= 2^40 and the window's edges below 2^61 keep every sum in 64 bits).
    const i64 center = (i64)i + (p.diagonal_given ? p.diagonal : (i64)nk - nq);
    i64 lo = center - p.window_left, hi = center + p.window_right + 1;
    lo = lo < 0 ? 0 : (lo > nk ? nk : lo);
    hi = hi < 0 ? 0 : (hi > nk ? nk : hi);
    if (hi < lo) hi = lo;
    const float slope = p.slopes ? ((const float*)p.slopes)[bh] : 0.0f;
    const float* bias = (const float*)p.bias;
    const i64 bias_row = p.bias_offset + (i64)b * p.bias_stride[0] + (i64)h * p.bias_stride[1] +
                         (i64)i * p.bias_stride[2];
    const int r = p.rel_radius;
    const float* rel = p.rel_bias ? (const float*)p.rel_bias + (i64)h * (2 * r + 1) : 0;

    // Pass 1: the score mods, each rounded to T as stored; the row maximum over visible keys,
    // NaN when one of them is NaN (then P and the LSE are NaN, as in peers).
    float m = NEG_INF, nan = 0.0f;
    for (int j = threadIdx.x; j < p.max_nk; j += SOFTMAX_THREADS) {
        if (j < lo || j >= hi) continue;
        float s = to_f32(row[j]);
        if (p.softcap > 0.0f) s = round_elem(p.softcap * tanhf(s / p.softcap));
        if (slope != 0.0f || bias || rel) {
            const i64 d = (i64)j - center;
            const float alibi = slope * (float)llabs(d);
            const float add = bias ? bias[bias_row + (i64)j * p.bias_stride[3]] : 0.0f;
            const float add_rel = rel ? rel[d < -r ? 0 : d > r ? 2 * r : d + r] : 0.0f;
            s = round_elem(s - alibi + add + add_rel);
        }
        row[j] = from_f32(s);
        m = fmaxf(m, s);
        if (s != s) nan = 1.0f;
    }
    m = block_reduce(m, true, red);
    if (block_reduce(nan, true, red) != 0.0f) m = NAN_F;

    // Pass 2: the sum of exponentials (f32).
    float sum = 0.0f;
    if (m != NEG_INF) {
        for (int j = threadIdx.x; j < p.max_nk; j += SOFTMAX_THREADS) {
            if (j >= lo && j < hi) sum += expf(to_f32(row[j]) - m);
        }
    }
    sum = block_reduce(sum, false, red);

    // Pass 3: P rounded to T; masked keys (and every key of a row that sees none) get 0.
    const float inv = m == NEG_INF ? 0.0f : 1.0f / sum;
    for (int j = threadIdx.x; j < p.max_nk; j += SOFTMAX_THREADS) {
        const bool visible = j >= lo && j < hi && m != NEG_INF;
        row[j] = from_f32(visible ? expf(to_f32(row[j]) - m) * inv : 0.0f);
    }
    if (threadIdx.x == 0) {
        const i64 at = p.seq_q_row0 ? (i64)h * p.total_q + ((const int*)p.seq_q_row0)[b] + i
                                    : (i64)bh * p.max_nq + i;
        ((float*)p.lse)[at] = m == NEG_INF ? NEG_INF : m + logf(sum);
    }
}
