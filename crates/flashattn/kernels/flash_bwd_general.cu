// FlashAttention-2 backward on CUDA cores, for every dtype and head dim (the tensor-core kernel's
// fallback). One block owns BKB keys of one (batch, key/value head): it keeps their K and V in
// shared memory and their dK, dV in f32 registers while the query rows that see them pass by, BQB
// at a time, for each query head of the group:
//   S = Q·Kᵀ (score mods, mask), P = exp(S − lse), dP = dO·Vᵀ, dS = P∘(dP − D)
//   dbias, drel_bias += dS (atomics), dS *= d score / d(q·k·scale) (softcap)
//   dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K (f32 atomics into dq_accum; scale applied after)
// A row whose LSE is −inf saw no key: its P is 0 (not exp(−inf − (−inf))), so it adds nothing.
//
// Tile defines: DQK_MAX, DV_MAX (head dims rounded up to a multiple of 16), BKB (keys a block),
// BQB (query rows a step); src/cuda/backward/tiles.rs picks them. DETERMINISTIC 1 leaves dQ and
// dbias to the fixed-order pass of flash_bwd_dq.cu (no atomics here).

#define BT 128                  // threads per block
#define TPK (BT / BKB)          // threads sharing one key's dK/dV row
#define TPR (BT / BQB)          // threads sharing one query row's dQ
#define PQK (DQK_MAX + 1)       // odd pitches: consecutive keys (rows) fall in distinct banks
#define PV (DV_MAX + 1)

extern "C" __global__ void __launch_bounds__(BT) flash_bwd_general(const BwdParams bp) {
    extern __shared__ __align__(16) float bsmem[];
    float* sK = bsmem;               // BKB x PQK
    float* sV = sK + BKB * PQK;      // BKB x PV
    float* sQ = sV + BKB * PV;       // BQB x PQK
    float* sdO = sQ + BQB * PQK;     // BQB x PV
    float* sP = sdO + BQB * PV;      // BQB x BKB
    float* sdS = sP + BQB * BKB;     // BQB x BKB
    float* sL = sdS + BQB * BKB;     // BQB: LSE of the step's rows
    float* sD = sL + BQB;            // BQB: D of the step's rows

    const FlashParams& p = bp.f;
    const int tid = threadIdx.x, b = blockIdx.z, hk = blockIdx.y;
    const SeqInfo s0 = seq_info_at(p, b, hk * p.group);
    const int j0 = blockIdx.x * BKB;
    if (j0 >= s0.nk) return;
    const int nkb = min(BKB, s0.nk - j0);
    load_rows_f32<BKB, BT>(sK, PQK, DQK_MAX, k_rows(p, s0) + (i64)j0 * p.k_row, p.k_row, nkb, p.head_dim);
    load_rows_f32<BKB, BT>(sV, PV, DV_MAX, v_rows(p, s0) + (i64)j0 * p.v_row, p.v_row, nkb, p.head_dim_v);

    // This thread's share of dK/dV: key kc, columns kw + TPK·u; of dQ: row qr, columns qw + TPR·u.
    const int kc = tid / TPK, kw = tid % TPK, qr = tid / TPR, qw = tid % TPR;
    float dk[DQK_MAX / TPK], dv[DV_MAX / TPK];
#pragma unroll
    for (int u = 0; u < DQK_MAX / TPK; ++u) dk[u] = 0.f;
#pragma unroll
    for (int u = 0; u < DV_MAX / TPK; ++u) dv[u] = 0.f;

    int r_first, r_end;
    query_rows(p, s0, j0, j0 + BKB, &r_first, &r_end);
    for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
        const SeqInfo s = seq_info_at(p, b, h);
        const float slope = alibi_slope(p, s);
        for (int i0 = r_first; i0 < r_end; i0 += BQB) {
            const int nqb = min(BQB, s.nq - i0);
            __syncthreads();  // the previous step's tiles are no longer read
            load_rows_f32<BQB, BT>(sQ, PQK, DQK_MAX, q_row(p, s, i0), p.q_row, nqb, p.head_dim);
            load_rows_f32<BQB, BT>(sdO, PV, DV_MAX, dout_row(bp, s, i0), bp.dout_row, nqb, p.head_dim_v);
            for (int r = tid; r < BQB; r += BT) {
                sL[r] = r < nqb ? p.lse[lse_index(p, s, i0 + r)] : NEG_INF;
                sD[r] = r < nqb ? bp.delta[lse_index(p, s, i0 + r)] : 0.f;
            }
            __syncthreads();

            for (int e = tid; e < BQB * BKB; e += BT) {
                const int r = e / BKB, c = e - r * BKB, i = i0 + r, j = j0 + c;
                float pr = 0.f, ds = 0.f;
                if (r < nqb && sL[r] != NEG_INF && visible(p, s, i, j)) {
                    float dot = 0.f, dp = 0.f;
                    for (int d = 0; d < p.head_dim; ++d) dot = fmaf(sQ[r * PQK + d], sK[c * PQK + d], dot);
                    for (int d = 0; d < p.head_dim_v; ++d) dp = fmaf(sdO[r * PV + d], sV[c * PV + d], dp);
                    const float x = score_mods(p, s, dot, i, j, slope, bias_row_ptr(p, s, i));
                    pr = exp2f(x * LOG2E - sL[r] * LOG2E);
                    ds = pr * (dp - sD[r]);
#if !DETERMINISTIC
                    add_bias_grads(bp, s, i, j, ds);
#endif
                    ds *= score_mods_grad(p, dot);
                }
                sP[e] = pr;
                sdS[e] = ds;
            }
            __syncthreads();

            // Over all BQB rows (those past the sequence have P = dS = 0): a constant trip count
            // lets ptxas unroll it (with `nqb` it spilled).
            for (int r = 0; r < BQB; ++r) {
                const float pr = sP[r * BKB + kc], ds = sdS[r * BKB + kc];
#pragma unroll
                for (int u = 0; u < DV_MAX / TPK; ++u) dv[u] = fmaf(pr, sdO[r * PV + kw + TPK * u], dv[u]);
#pragma unroll
                for (int u = 0; u < DQK_MAX / TPK; ++u) dk[u] = fmaf(ds, sQ[r * PQK + kw + TPK * u], dk[u]);
            }
            if (!DETERMINISTIC && qr < nqb) {
                float dq[DQK_MAX / TPR];
#pragma unroll
                for (int u = 0; u < DQK_MAX / TPR; ++u) dq[u] = 0.f;
                for (int c = 0; c < BKB; ++c) {
                    const float ds = sdS[qr * BKB + c];
#pragma unroll
                    for (int u = 0; u < DQK_MAX / TPR; ++u) dq[u] = fmaf(ds, sK[c * PQK + qw + TPR * u], dq[u]);
                }
                float* acc = accum_row(bp, s, i0 + qr);
#pragma unroll
                for (int u = 0; u < DQK_MAX / TPR; ++u) {
                    const int col = qw + TPR * u;
                    if (col < p.head_dim && dq[u] != 0.f) atomic_add_f32(acc + col, dq[u]);
                }
            }
        }
    }

    if (kc >= nkb) return;
    elem_t* dkg = dk_rows(bp, s0) + (i64)(j0 + kc) * bp.dk_row;
    elem_t* dvg = dv_rows(bp, s0) + (i64)(j0 + kc) * bp.dv_row;
#pragma unroll
    for (int u = 0; u < DQK_MAX / TPK; ++u) {
        const int col = kw + TPK * u;
        if (col < p.head_dim) dkg[col] = from_f32(dk[u] * p.scale);
    }
#pragma unroll
    for (int u = 0; u < DV_MAX / TPK; ++u) {
        const int col = kw + TPK * u;
        if (col < p.head_dim_v) dvg[col] = from_f32(dv[u]);
    }
}
