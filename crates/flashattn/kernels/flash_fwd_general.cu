// FlashAttention forward on CUDA cores, for every dtype and head dim (f32 inputs, f16/bf16 with head
// dims over 256 or strides the tensor-core path cannot load by 16 bytes). Computes in f32 with the
// same vocabulary as the tensor-core kernel: one block owns 16·GRPT query rows of one (batch,
// head), a row is shared by 8 lanes; K/V blocks of BCG keys are staged in shared memory. Scores and
// the running max are kept in f64 (the dot products too), so at logits of ~1e4 the exponent's
// argument s - max carries no f32 rounding of s (6e-4 there); P, O and the sums are f32.
//
// Tile defines: DQK_MAX, DV_MAX (head dims rounded up to a multiple of 8), BCG (keys per block),
// GRPT (rows per lane group, default 1: a block owns 16·GRPT rows and each group of 8 lanes keeps
// GRPT rows, so every K and V value read from shared memory feeds GRPT rows), GK_F64 (K staged
// as f64: the dot products then convert only Q, whose value feeds BCG/8 keys). With K in f32 the
// loop is bounded by the f32 -> f64 conversion of both operands of every f64 FMA (a quarter-rate
// instruction); src/cuda/tile_config.rs picks GRPT and GK_F64 per head dim (measured in kernels/README.md).

#ifndef GRPT
#define GRPT 1
#endif
#if GK_F64
typedef double kdt;
#else
typedef float kdt;
#endif
#define GM (16 * GRPT)  // query rows per block
#define GT 128          // threads per block: 8 per lane group, 16 groups
#define GPQ (DQK_MAX + 1)  // odd pitch: the 8 keys a row group reads sit in distinct banks

// Loads `rows` x `cols` elements (row stride `stride`) as f32 or f64 into a ROWS x pitch tile,
// zero-filling the rest of the ROWS x width tile.
template <int ROWS, typename D>
__device__ __forceinline__ void load_tile(D* dst, int pitch, int width, const elem_t* src,
                                          i64 stride, int rows, int cols) {
    for (int idx = threadIdx.x; idx < ROWS * width; idx += GT) {
        const int r = idx / width, c = idx - r * width;
        dst[r * pitch + c] = (r < rows && c < cols) ? (D)to_f32(src[r * stride + c]) : (D)0;
    }
}

extern "C" __global__ void __launch_bounds__(GT) flash_fwd_general(const FlashParams p) {
    extern __shared__ __align__(16) double gsmem_d[];
    kdt* sK = (kdt*)gsmem_d;
    float* sQ = (float*)(sK + BCG * GPQ);
    float* sV = sQ + GM * GPQ;
    float* sP = sV + BCG * DV_MAX;

    const int tid = threadIdx.x, r = tid >> 3, c8 = tid & 7;
    const SeqInfo s = seq_info(p);
    const int i0 = block_row0(GM);
    if (i0 >= s.nq) return;
    const int i1 = min(i0 + GM, s.nq);
    int nb_first, nb_end;
    key_blocks(p, s, i0, i1, BCG, &nb_first, &nb_end);

    const elem_t* qg = q_row(p, s, i0);
    const elem_t* kg = k_rows(p, s);
    const elem_t* vg = v_rows(p, s);
    load_tile<GM>(sQ, GPQ, DQK_MAX, qg, p.q_row, i1 - i0, p.head_dim);

    // This lane group's rows: r, r + 16, ... (local), i0 + those (in the sequence).
    const float slope = alibi_slope(p, s);
    const float* brow[GRPT];
    float o[GRPT][DV_MAX / 8];
    RowSoftmax<double> row[GRPT];
#pragma unroll
    for (int t = 0; t < GRPT; ++t) {
        brow[t] = bias_row_ptr(p, s, i0 + r + 16 * t);
#pragma unroll
        for (int c = 0; c < DV_MAX / 8; ++c) o[t][c] = 0.f;
        softmax_init(row[t]);
    }

    for (int nb = nb_first; nb < nb_end; ++nb) {
        const int j0 = nb * BCG;
        __syncthreads();  // the previous block's K/V/P are no longer read
        load_tile<BCG>(sK, GPQ, DQK_MAX, kg + (i64)j0 * p.k_row, p.k_row, s.nk - j0, p.head_dim);
        load_tile<BCG>(sV, DV_MAX, DV_MAX, vg + (i64)j0 * p.v_row, p.v_row, s.nk - j0, p.head_dim_v);
        __syncthreads();

        double sc[GRPT][BCG / 8];
#pragma unroll
        for (int t = 0; t < GRPT; ++t)
#pragma unroll
            for (int u = 0; u < BCG / 8; ++u) sc[t][u] = 0.0;
        for (int d = 0; d < p.head_dim; ++d) {
            double qd[GRPT];
#pragma unroll
            for (int t = 0; t < GRPT; ++t) qd[t] = (double)sQ[(r + 16 * t) * GPQ + d];
#pragma unroll
            for (int u = 0; u < BCG / 8; ++u) {
                const double kd = (double)sK[(c8 + 8 * u) * GPQ + d];
#pragma unroll
                for (int t = 0; t < GRPT; ++t) sc[t][u] = fma(qd[t], kd, sc[t][u]);
            }
        }
#pragma unroll
        for (int t = 0; t < GRPT; ++t) {
            const int i = i0 + r + 16 * t;
            double mx = row[t].max;
#pragma unroll
            for (int u = 0; u < BCG / 8; ++u) {
                const int j = j0 + c8 + 8 * u;
                double x = score_mods(p, s, sc[t][u], i, j, slope, brow[t]);
                if (!visible(p, s, i, j)) x = (double)NEG_INF;
                sc[t][u] = x;
                mx = fmax(mx, x);
            }
            const float corr = softmax_rescale(row[t], row_allreduce_max<8>(mx), LOG2E);
            float sum = 0.f;
#pragma unroll
            for (int u = 0; u < BCG / 8; ++u) {
                const float e = softmax_p(row[t], sc[t][u], LOG2E);
                sP[(r + 16 * t) * BCG + c8 + 8 * u] = e;
                sum += e;
            }
            row[t].sum += sum;
#pragma unroll
            for (int c = 0; c < DV_MAX / 8; ++c) o[t][c] *= corr;
        }
        __syncwarp();  // a group's 8 lanes (one warp) exchange P through shared memory
        for (int jj = 0; jj < BCG; ++jj) {
            float pj[GRPT];
#pragma unroll
            for (int t = 0; t < GRPT; ++t) pj[t] = sP[(r + 16 * t) * BCG + jj];
#pragma unroll
            for (int c = 0; c < DV_MAX / 8; ++c) {
                const float vc = sV[jj * DV_MAX + c8 + 8 * c];
#pragma unroll
                for (int t = 0; t < GRPT; ++t) o[t][c] = fmaf(pj[t], vc, o[t][c]);
            }
        }
    }

#pragma unroll
    for (int t = 0; t < GRPT; ++t) {
        const int i = i0 + r + 16 * t;
        const float l = row_allreduce_sum<8>(row[t].sum);
        if (i >= s.nq) continue;
        const float inv = softmax_inv_sum(l);
        elem_t* og = out_row(p, s, i);
#pragma unroll
        for (int c = 0; c < DV_MAX / 8; ++c) {
            const int col = c8 + 8 * c;
            if (col < p.head_dim_v) og[col] = from_f32(o[t][c] * inv);
        }
        if (c8 == 0) store_lse(p, s, i, softmax_lse(row[t], l));
    }
}
