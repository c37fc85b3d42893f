// Online softmax, shared by the forward kernels: one running max and sum per query row, the
// exponent, the rescale when the max moves, and the row's end (1 / sum and the log-sum-exp).
//
// Edge cases. A row's max is -inf until it sees a visible key; exponents are taken against
// softmax_shift(max), which is 0 then, so exp(-inf - shift) is 0, never NaN (-inf minus -inf), and
// a row that sees no key ends with sum 0: output 0, LSE -inf. A NaN score is skipped by the max
// (fmax) but reaches the sum through its exponent, so a row whose visible scores hold a NaN ends
// with sum NaN: output and LSE NaN, as in peers. Masked keys are -inf before the exponent, so a NaN
// there never reaches a row that does not see it.
//
// T is float (tensor-core kernel) or double (CUDA-core kernel, which keeps scores in f64). Scores
// and the max are in score units; `mult` turns them into log2 units (log2(e), times the scale when
// the kernel folds the scale into the exponent).

template <typename T>
struct RowSoftmax {
    T max;      // the reference max the exponents are taken against
    float sum;  // sum of exp(s - max) over the visible keys seen so far (this lane's share)
};

template <typename T>
__device__ __forceinline__ void softmax_init(RowSoftmax<T>& r) {
    r.max = (T)NEG_INF;
    r.sum = 0.f;
}

template <typename T>
__device__ __forceinline__ T softmax_shift(T m) {
    return m == (T)NEG_INF ? (T)0 : m;
}

// exp(x - shift): in f32 one FFMA (contracted: NVRTC runs with --fmad=true) and ex2.approx; in
// f64 the difference is taken before rounding, so at scores of ~1e4 it carries no f32 rounding of x.
__device__ __forceinline__ float softmax_exp(float x, float shift, float mult) {
    return fast_exp2(x * mult - shift * mult);
}
__device__ __forceinline__ float softmax_exp(double x, double shift, float mult) {
    return exp2f((float)((x - shift) * (double)mult));
}

// P of score `x` in row `r`.
template <typename T>
__device__ __forceinline__ float softmax_p(const RowSoftmax<T>& r, T x, float mult) {
    return softmax_exp(x, softmax_shift(r.max), mult);
}

// Whether a row's max moves after a block whose max is `block_max`: only when that exceeds it by
// more than `slack` (log2 units). With slack > 0 the exponents stay <= 2^slack (exact in f32) while
// O and the sum share the reference, and most blocks skip the rescale of O.
__device__ __forceinline__ bool softmax_max_moves(const RowSoftmax<float>& r, float block_max, float mult,
                                                  float slack) {
    return block_max * mult > r.max * mult + slack;
}

// Moves the row's max to `m` (>= the current one) and returns the factor by which every
// accumulator taken against the old max (O, and the row's sum, scaled here) must be multiplied.
template <typename T>
__device__ __forceinline__ float softmax_rescale(RowSoftmax<T>& r, T m, float mult) {
    const float corr = softmax_exp(r.max, softmax_shift(m), mult);
    r.max = m;
    r.sum *= corr;
    return corr;
}

// Sum over the LANES consecutive lanes (a power of two) that share a row; every lane gets it.
template <int LANES>
__device__ __forceinline__ float row_allreduce_sum(float x) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// Max over the LANES consecutive lanes that share a row (NaN skipped, as by fmax).
template <int LANES>
__device__ __forceinline__ float row_allreduce_max(float x) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}
template <int LANES>
__device__ __forceinline__ double row_allreduce_max(double x) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) x = fmax(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// 1 / l for the output of a finished row whose weights sum to `l`: 0 for a row that saw no key
// (its O is 0), NaN when l is NaN.
__device__ __forceinline__ float softmax_inv_sum(float l) { return l == 0.f ? 0.f : 1.f / l; }

// Natural-log LSE of a finished row whose whole sum is `l`: -inf when it saw no key, NaN when l is.
__device__ __forceinline__ float softmax_lse(const RowSoftmax<float>& r, float l, float mult) {
    return l == 0.f ? NEG_INF : (r.max * mult + log2f(l)) * LN2;
}
// The f64 row's scores are in natural units (the CUDA-core kernel applies log2(e) in its exponent).
__device__ __forceinline__ float softmax_lse(const RowSoftmax<double>& r, float l) {
    return l == 0.f ? NEG_INF : (float)(r.max + log((double)l));
}
