// FlashAttention forward on CUDA cores, for every dtype and head dim (f32 inputs, f16/bf16 with head
// dims over 256 or strides the tensor-core path cannot load by 16 bytes). Computes in f32 with the
// same vocabulary as the tensor-core kernel: one block owns 16 query rows of one (batch, head), a
// row is shared by 8 lanes; K/V blocks of BCG keys are staged in shared memory as f32. Scores and
// the running max are kept in f64 (the dot products too), so at logits of ~1e4 the exponent's
// argument s - max carries no f32 rounding of s (6e-4 there); P, O and the sums are f32.
//
// Tile defines: DQK_MAX, DV_MAX (head dims rounded up to a multiple of 8), BCG (keys per block).

#define GM 16          // query rows per block
#define GT 128         // threads per block: 8 per row
#define GPQ (DQK_MAX + 1)  // odd pitch: the 8 keys a row group reads sit in distinct banks

// Loads `rows` x `cols` elements (row stride `stride`) as f32 into a ROWS x pitch tile, zero-filling
// the rest of the ROWS x width tile.
template <int ROWS>
__device__ __forceinline__ void load_tile_f32(float* dst, int pitch, int width, const elem_t* src,
                                              i64 stride, int rows, int cols) {
    for (int idx = threadIdx.x; idx < ROWS * width; idx += GT) {
        const int r = idx / width, c = idx - r * width;
        dst[r * pitch + c] = (r < rows && c < cols) ? to_f32(src[r * stride + c]) : 0.f;
    }
}

__device__ __forceinline__ double row_max_neg_inf() { return -__longlong_as_double(0x7ff0000000000000ll); }

extern "C" __global__ void __launch_bounds__(GT) flash_fwd_general(const FlashParams p) {
    extern __shared__ __align__(16) float gsmem[];
    float* sQ = gsmem;
    float* sK = sQ + GM * GPQ;
    float* sV = sK + BCG * GPQ;
    float* sP = sV + BCG * DV_MAX;

    const int tid = threadIdx.x, r = tid >> 3, c8 = tid & 7;
    const SeqInfo s = seq_info(p);
    const int i0 = block_row0(GM);
    if (i0 >= s.nq) return;
    const int i1 = min(i0 + GM, s.nq);
    int nb_first, nb_end;
    key_blocks(p, s, i0, i1, BCG, &nb_first, &nb_end);

    const elem_t* qg = p.q + s.b * p.q_batch + (i64)(s.q_row0 + i0) * p.q_row + s.h * p.q_head;
    const elem_t* kg = p.k + s.b * p.k_batch + (i64)s.k_row0 * p.k_row + s.hk * p.k_head;
    const elem_t* vg = p.v + s.b * p.v_batch + (i64)s.k_row0 * p.v_row + s.hk * p.v_head;
    load_tile_f32<GM>(sQ, GPQ, DQK_MAX, qg, p.q_row, i1 - i0, p.head_dim);

    const int i = i0 + r;
    const float slope = alibi_slope(p, s);
    const float* brow = bias_row_ptr(p, s, i);
    float o[DV_MAX / 8];
#pragma unroll
    for (int c = 0; c < DV_MAX / 8; ++c) o[c] = 0.f;
    double row_max = row_max_neg_inf();
    float row_sum = 0.f;

    for (int nb = nb_first; nb < nb_end; ++nb) {
        const int j0 = nb * BCG;
        __syncthreads();  // the previous block's K/V/P are no longer read
        load_tile_f32<BCG>(sK, GPQ, DQK_MAX, kg + (i64)j0 * p.k_row, p.k_row, s.nk - j0, p.head_dim);
        load_tile_f32<BCG>(sV, DV_MAX, DV_MAX, vg + (i64)j0 * p.v_row, p.v_row, s.nk - j0, p.head_dim_v);
        __syncthreads();

        double sc[BCG / 8];
        double mx = row_max;
#pragma unroll
        for (int u = 0; u < BCG / 8; ++u) {
            const int jj = c8 + 8 * u, j = j0 + jj;
            double dot = 0.0;
            for (int d = 0; d < p.head_dim; ++d)
                dot = fma((double)sQ[r * GPQ + d], (double)sK[jj * GPQ + d], dot);
            double x = score_mods(p, s, dot, i, j, slope, brow);
            if (!visible(p, s, i, j)) x = row_max_neg_inf();
            sc[u] = x;
            mx = fmax(mx, x);
        }
        mx = fmax(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmax(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        mx = fmax(mx, __shfl_xor_sync(0xffffffff, mx, 4));
        const double shift = mx == row_max_neg_inf() ? 0.0 : mx;
        const float corr = exp2f((float)((row_max - shift) * (double)LOG2E));
        row_max = mx;
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < BCG / 8; ++u) {
            const float e = exp2f((float)((sc[u] - shift) * (double)LOG2E));
            sP[r * BCG + c8 + 8 * u] = e;
            sum += e;
        }
        row_sum = row_sum * corr + sum;
        __syncwarp();  // a row's 8 lanes (one warp) exchange P through shared memory
#pragma unroll
        for (int c = 0; c < DV_MAX / 8; ++c) o[c] *= corr;
        for (int jj = 0; jj < BCG; ++jj) {
            const float pj = sP[r * BCG + jj];
#pragma unroll
            for (int c = 0; c < DV_MAX / 8; ++c) o[c] = fmaf(pj, sV[jj * DV_MAX + c8 + 8 * c], o[c]);
        }
    }

    float l = row_sum;
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    l += __shfl_xor_sync(0xffffffff, l, 4);
    if (i >= s.nq) return;
    const float inv = softmax_inv_sum(l);
    elem_t* og = p.o + s.b * p.o_batch + (i64)(s.q_row0 + i) * p.o_row + s.h * p.o_head;
#pragma unroll
    for (int c = 0; c < DV_MAX / 8; ++c) {
        const int col = c8 + 8 * c;
        if (col < p.head_dim_v) og[col] = from_f32(o[c] * inv);
    }
    if (c8 == 0) p.lse[s.b * p.lse_batch + s.h * p.lse_head + s.q_row0 + i] = (l > 0.f ? (float)(row_max + log((double)l)) : NEG_INF);
}
