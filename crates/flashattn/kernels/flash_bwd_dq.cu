// The deterministic backward's dQ pass on CUDA cores (every dtype and head dim): one block owns BQB
// query rows and walks the key blocks they see, BKB keys at a time, in order, recomputing
// S, P, dP and dS = P∘(dP − D) as the key-block kernel does; it keeps dQ in f32 registers and
// writes dq once, and sums the bias gradients in a fixed order (no atomics), so every run gives the
// same bits. A bias broadcast over batch or heads has the block loop over them (the host gives the
// grid a size of 1 there); one broadcast over query rows goes to per-block partial sums, added up
// in order by flash_bwd_dbias_sum, and so does the relative-position table's (flash_bwd_drel_sum).
//
// Tile defines as flash_bwd_general.cu: DQK_MAX, DV_MAX, BKB, BQB.

#define BT 128
#define TPR (BT / BQB)  // threads sharing one query row's dQ
#define PQK (DQK_MAX + 1)
#define PV (DV_MAX + 1)

// Adds this step's bias gradient tile `sB` (nqb x nkb of BQB x BKB, rows i0.., keys j0..) to the
// elements this block owns, each sum over the broadcast dims taken in a fixed order.
__device__ __forceinline__ void add_bias_tile(const BwdParams& bp, const SeqInfo& s, const float* sB,
                                              int i0, int j0, int nqb, int nkb) {
    const int tid = threadIdx.x;
    const bool rows = bp.dbias_row != 0, cols = bp.dbias_col != 0;
    float* base = rows ? dbias_at(bp, s, i0, j0) : part_at(bp, s, blockIdx.x, j0);
    if (rows && cols) {
        for (int e = tid; e < BQB * BKB; e += BT) {
            const int r = e / BKB, c = e - r * BKB;
            if (r < nqb && c < nkb) base[r * bp.dbias_row + c * bp.dbias_col] += sB[e];
        }
    } else if (rows) {
        for (int r = tid; r < nqb; r += BT) {
            float sum = 0.f;
            for (int c = 0; c < nkb; ++c) sum += sB[r * BKB + c];
            base[r * bp.dbias_row] += sum;
        }
    } else if (cols) {
        for (int c = tid; c < nkb; c += BT) {
            float sum = 0.f;
            for (int r = 0; r < nqb; ++r) sum += sB[r * BKB + c];
            base[c * bp.dbias_col] += sum;
        }
    } else if (tid == 0) {
        float sum = 0.f;
        for (int r = 0; r < nqb; ++r)
            for (int c = 0; c < nkb; ++c) sum += sB[r * BKB + c];
        base[0] += sum;
    }
}

// Adds this step's dS tile `sB` (as add_bias_tile) to this block's partial table gradient: a
// thread per table entry the tile reaches, summing its pairs row by row (the two clamped entries
// take every pair beyond them).
__device__ __forceinline__ void add_rel_tile(const BwdParams& bp, const SeqInfo& s, const float* sB,
                                             int i0, int j0, int nqb, int nkb) {
    const int r = bp.f.rel_radius;
    const i64 far = (i64)1 << 40;
    const i64 base = (i64)i0 + s.diag - j0;  // tile column of row 0's diagonal
    float* part = drel_part_at(bp, s, blockIdx.x);
    const int first = rel_column(r, -base - (nqb - 1)), last = rel_column(r, nkb - 1 - base);
    for (int c = first + (int)threadIdx.x; c <= last; c += BT) {
        const i64 lo = c == 0 ? -far : c - r, hi = c == 2 * r ? far : c - r;
        float sum = 0.f;
        for (int q = 0; q < nqb; ++q) {
            const i64 a = max(base + q + lo, (i64)0), b = min(base + q + hi, (i64)nkb - 1);
            for (i64 k = a; k <= b; ++k) sum += sB[q * BKB + k];
        }
        part[c] += sum;
    }
}

extern "C" __global__ void __launch_bounds__(BT) flash_bwd_dq(const BwdParams bp) {
    extern __shared__ __align__(16) float dsmem[];
    float* sK = dsmem;               // BKB x PQK
    float* sV = sK + BKB * PQK;      // BKB x PV
    float* sQ = sV + BKB * PV;       // BQB x PQK
    float* sdO = sQ + BQB * PQK;     // BQB x PV
    float* sdS = sdO + BQB * PV;     // BQB x BKB: dS through the softcap, for dQ
    float* sB = sdS + BQB * BKB;     // BQB x BKB: dS, for the bias gradient
    float* sL = sB + BQB * BKB;
    float* sD = sL + BQB;

    const FlashParams& p = bp.f;
    const int tid = threadIdx.x, qr = tid / TPR, qw = tid % TPR;
    const int i0 = blockIdx.x * BQB;
    // The batch and heads this block walks: its own, or all of them where the grid has size 1.
    const int b_first = gridDim.z == p.batch ? blockIdx.z : 0, b_end = gridDim.z == p.batch ? b_first + 1 : p.batch;
    const int h_first = gridDim.y == p.heads_q ? blockIdx.y : 0, h_end = gridDim.y == p.heads_q ? h_first + 1 : p.heads_q;
    for (int b = b_first; b < b_end; ++b)
        for (int h = h_first; h < h_end; ++h) {
            const SeqInfo s = seq_info_at(p, b, h);
            if (i0 >= s.nq) continue;  // the whole block
            const int nqb = min(BQB, s.nq - i0);
            const float slope = alibi_slope(p, s);
            __syncthreads();  // the previous (batch, head)'s tiles are no longer read
            load_rows_f32<BQB, BT>(sQ, PQK, DQK_MAX, q_row(p, s, i0), p.q_row, nqb, p.head_dim);
            load_rows_f32<BQB, BT>(sdO, PV, DV_MAX, dout_row(bp, s, i0), bp.dout_row, nqb, p.head_dim_v);
            for (int r = tid; r < BQB; r += BT) {
                sL[r] = r < nqb ? p.lse[lse_index(p, s, i0 + r)] : NEG_INF;
                sD[r] = r < nqb ? bp.delta[lse_index(p, s, i0 + r)] : 0.f;
            }
            float dq[DQK_MAX / TPR];
#pragma unroll
            for (int u = 0; u < DQK_MAX / TPR; ++u) dq[u] = 0.f;

            int kb_first, kb_end;
            key_blocks(p, s, i0, i0 + nqb, BKB, &kb_first, &kb_end);
            for (int kb = kb_first; kb < kb_end; ++kb) {
                const int j0 = kb * BKB, nkb = min(BKB, s.nk - j0);
                __syncthreads();  // the previous key block's K, V, dS are no longer read
                load_rows_f32<BKB, BT>(sK, PQK, DQK_MAX, k_rows(p, s) + (i64)j0 * p.k_row, p.k_row, nkb, p.head_dim);
                load_rows_f32<BKB, BT>(sV, PV, DV_MAX, v_rows(p, s) + (i64)j0 * p.v_row, p.v_row, nkb, p.head_dim_v);
                __syncthreads();
                for (int e = tid; e < BQB * BKB; e += BT) {
                    const int r = e / BKB, c = e - r * BKB, i = i0 + r, j = j0 + c;
                    float ds = 0.f, dsr = 0.f;
                    if (r < nqb && sL[r] != NEG_INF && visible(p, s, i, j)) {
                        float dot = 0.f, dp = 0.f;
                        for (int d = 0; d < p.head_dim; ++d) dot = fmaf(sQ[r * PQK + d], sK[c * PQK + d], dot);
                        for (int d = 0; d < p.head_dim_v; ++d) dp = fmaf(sdO[r * PV + d], sV[c * PV + d], dp);
                        const float x = score_mods(p, s, dot, i, j, slope, bias_row_ptr(p, s, i));
                        const float pr = exp2f(x * LOG2E - sL[r] * LOG2E);
                        ds = pr * (dp - sD[r]);
                        dsr = ds * score_mods_grad(p, dot);
                    }
                    sdS[e] = dsr;
                    sB[e] = ds;
                }
                __syncthreads();
#pragma unroll 4
                for (int c = 0; c < BKB; ++c) {
                    const float ds = sdS[qr * BKB + c];
#pragma unroll
                    for (int u = 0; u < DQK_MAX / TPR; ++u) dq[u] = fmaf(ds, sK[c * PQK + qw + TPR * u], dq[u]);
                }
#if HAS_BIAS
                add_bias_tile(bp, s, sB, i0, j0, nqb, nkb);
#endif
#if HAS_REL_BIAS
                add_rel_tile(bp, s, sB, i0, j0, nqb, nkb);
#endif
            }
            if (qr < nqb) {
                elem_t* out = dq_row(bp, s, i0 + qr);
#pragma unroll
                for (int u = 0; u < DQK_MAX / TPR; ++u) {
                    const int col = qw + TPR * u;
                    if (col < p.head_dim) out[col] = from_f32(dq[u] * p.scale);
                }
            }
        }
}
