// FlashAttention-2 backward on tensor cores (f16/bf16 in, f32 accumulation; mma.sync m16n8k16),
// composed from the shared headers, bwd_info.cuh and mma.cuh. One block owns BKB = 16·NWARPS keys
// of one (batch, key/value head); warp w owns keys 16w..16w+15 and keeps their dK, dV in f32
// registers while the query rows that see the block pass by, BQB at a time, for each query head:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ         (per warp: its 16 keys × BQB queries, in registers)
//   Pᵀ = exp(Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − D), dbias, drel_bias += dSᵀ (atomics), dSᵀ *= softcap'
//   dV += Pᵀ·dO, dK += dSᵀ·Q         (Pᵀ, dSᵀ re-packed in registers as A operands)
//   dQ += dS·K                       (dS through shared memory; f32 atomics into dq_accum)
// P and dS are rounded to the element type for the products, as a framework's backward does.
// The steps (query head, BQB rows) run as one sequence whose Q and dO tiles are double-buffered:
// step t+1's cp.async load is issued before step t's products.
//
// Tile defines: DQK, DV (head dims padded to multiples of 16), NWARPS, BQB (query rows a step:
// 16 times a divisor of NWARPS, so that the warps share the dQ product evenly). Needs head dims
// that are multiples of 8 and 16-byte-aligned rows (cp.async).

#define NT (NWARPS * 32)
#define BKB (16 * NWARPS)
#define PQK (DQK + 8)  // row pitches: +16 bytes so ldmatrix rows hit distinct banks
#define PV (DV + 8)
#define PS (BKB + 8)
#define QSLICES (BQB / 16)               // 16-row slices of dQ a step
#define SLICE_WARPS (NWARPS / QSLICES)   // warps sharing one slice's columns

// C[16 x N] += A[16 x K] . B[N x K]^T, A and B row-major in shared memory (byte addresses of
// their first rows, pitches PA and PB elements).
template <int N, int K, int PA, int PB>
__device__ __forceinline__ void mma_abt(float c[N / 8][4], u32 a_base, u32 b_base, int lane) {
    const u32 a_lane = a_base + ((lane & 15) * PA + (lane >> 4) * 8) * 2;
    const u32 b_lane = b_base + (((lane >> 4) * 8 + (lane & 7)) * PB + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[4];
        ldmatrix_x4(a, a_lane + kk * 32);
#pragma unroll
        for (int nn = 0; nn < N / 16; ++nn) {
            u32 b[4];
            ldmatrix_x4(b, b_lane + (nn * 16 * PB + kk * 16) * 2);
            mma_16816(c[2 * nn], a, b[0], b[1]);
            mma_16816(c[2 * nn + 1], a, b[2], b[3]);
        }
    }
}

// C[16 x N] += A . B[K x N], A as K/16 register fragments, B row-major in shared memory.
template <int N, int K, int PB>
__device__ __forceinline__ void mma_ab(float c[N / 8][4], const u32 a[K / 16][4], u32 b_base, int lane) {
    const u32 b_lane = b_base + ((((lane >> 3) & 1) * 8 + (lane & 7)) * PB + (lane >> 4) * 8) * 2;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int dn = 0; dn < N / 16; ++dn) {
            u32 b[4];
            ldmatrix_x4_trans(b, b_lane + (kk * 16 * PB + dn * 16) * 2);
            mma_16816(c[2 * dn], a[kk], b[0], b[1]);
            mma_16816(c[2 * dn + 1], a[kk], b[2], b[3]);
        }
}

// The accumulators of a 16 x N product as the A operand of the next one (k = its columns).
template <int N>
__device__ __forceinline__ void pack_a(u32 a[N / 16][4], const float c[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        a[kk][0] = pack2(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = pack2(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

template <int N>
__device__ __forceinline__ void zero(float c[N / 8][4]) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] = 0.f;
}

// Writes a warp's 16 x W f32 accumulators times `mult` as rows of `w` (< W) columns of `dst`
// (row stride `stride`), rows at or past `rows` skipped.
template <int W>
__device__ __forceinline__ void store_rows(elem_t* dst, i64 stride, const float c[W / 8][4], float mult,
                                           int rows, int w, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        if (r >= rows) continue;
#pragma unroll
        for (int n = 0; n < W / 8; ++n) {
            const int col = n * 8 + 2 * t;
            if (col < w) *(u32*)(dst + r * stride + col) = pack2(c[n][2 * h] * mult, c[n][2 * h + 1] * mult);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT) flash_bwd_mma(const BwdParams bp) {
    extern __shared__ __align__(16) u16 smem[];
    // K, V, then two (Q, dO) buffers: step t+1's load overlaps step t's products.
    const u32 sK = smem_addr(smem);
    const u32 sV = sK + BKB * PQK * 2;
    const u32 sQ0 = sV + BKB * PV * 2;
    const u32 QDO_BYTES = BQB * (PQK + PV) * 2;
    u16* sdS = smem + (BKB * PQK + BKB * PV + 2 * BQB * (PQK + PV));  // BQB x PS, query-major
    float* sL = (float*)(sdS + BQB * PS);  // LSE · log2(e) of the step's rows
    float* sD = sL + BQB;

    const FlashParams& p = bp.f;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, hk = blockIdx.y;
    const SeqInfo s0 = seq_info_at(p, b, hk * p.group);
    const int j0 = blockIdx.x * BKB;
    if (j0 >= s0.nk) return;
    load_tile_async<BKB, DQK, PQK, NT>(sK, k_rows(p, s0) + (i64)j0 * p.k_row, p.k_row, s0.nk - j0, p.head_dim, tid);
    load_tile_async<BKB, DV, PV, NT>(sV, v_rows(p, s0) + (i64)j0 * p.v_row, p.v_row, s0.nk - j0, p.head_dim_v, tid);

    const int kw0 = 16 * warp;  // this warp's first key within the block
    float dk[DQK / 8][4], dv[DV / 8][4];
    zero<DQK>(dk);
    zero<DV>(dv);
    // This warp's share of dQ: query slice `qs`, 16-column chunks qc0, qc0 + SLICE_WARPS, ...
    const int qs = warp / SLICE_WARPS, qc0 = warp % SLICE_WARPS;

    // The steps: BQB query rows of each query head of the group that see the block.
    int r_first, r_end;
    query_rows(p, s0, j0, j0 + BKB, &r_first, &r_end);
    const int per_head = (r_end - r_first + BQB - 1) / BQB, steps = per_head * p.group;
    auto step_seq = [&](int it) { return seq_info_at(p, b, hk * p.group + it / per_head); };
    auto step_row = [&](int it) { return r_first + (it % per_head) * BQB; };
    auto load_step = [&](int it) {
        if (it < steps) {
            const SeqInfo s = step_seq(it);
            const int i0 = step_row(it), n = s.nq - i0;
            const u32 q = sQ0 + (it & 1) * QDO_BYTES, o = q + BQB * PQK * 2;
            load_tile_async<BQB, DQK, PQK, NT>(q, q_row(p, s, i0), p.q_row, n, p.head_dim, tid);
            load_tile_async<BQB, DV, PV, NT>(o, dout_row(bp, s, i0), bp.dout_row, n, p.head_dim_v, tid);
        }
        cp_async_commit();
    };
    load_step(0);  // one group: K, V and step 0

    for (int it = 0; it < steps; ++it) {
        const SeqInfo s = step_seq(it);
        const int i0 = step_row(it), nqb = min(BQB, s.nq - i0);
        const u32 sQ = sQ0 + (it & 1) * QDO_BYTES, sdO = sQ + BQB * PQK * 2;
        __syncthreads();  // step it-1 no longer reads its Q/dO buffer, dS, LSE or D
        load_step(it + 1);
        for (int r = tid; r < BQB; r += NT) {
            sL[r] = r < nqb ? p.lse[lse_index(p, s, i0 + r)] * LOG2E : NEG_INF;
            sD[r] = r < nqb ? bp.delta[lse_index(p, s, i0 + r)] : 0.f;
        }
        cp_async_wait<1>();  // step it's group landed (step it+1's may be in flight)
        __syncthreads();

        float st[BQB / 8][4], dpt[BQB / 8][4];
        zero<BQB>(st);
        zero<BQB>(dpt);
        mma_abt<BQB, DQK, PQK, PQK>(st, sK + kw0 * PQK * 2, sQ, lane);
        mma_abt<BQB, DV, PV, PV>(dpt, sV + kw0 * PV * 2, sdO, lane);

        // Element (n, e): key kw0 + g + 8·(e >> 1), query 8n + 2t + (e & 1) of the step. Steps
        // whose rows all see all of the block's keys skip the mask.
        const float slope = alibi_slope(p, s);
        const bool full = nqb == BQB && block_is_full(p, s, i0, i0 + BQB, j0, BKB);
#pragma unroll
        for (int n = 0; n < BQB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 8 * n + 2 * t + (e & 1), i = i0 + r;
                const int j = j0 + kw0 + g + 8 * (e >> 1);
                const bool seen = (sL[r] != NEG_INF) & (full | ((r < nqb) & visible(p, s, i, j)));
                float pr;
                const float ds = bwd_p_ds(bp, s, seen, st[n][e], dpt[n][e], i, j, sL[r], sD[r], slope, &pr);
                st[n][e] = pr;
                dpt[n][e] = ds;
                sdS[r * PS + kw0 + g + 8 * (e >> 1)] = from_f32(ds);
            }
        {
            u32 a[BQB / 16][4];
            pack_a<BQB>(a, st);
            mma_ab<DV, BQB, PV>(dv, a, sdO, lane);
            pack_a<BQB>(a, dpt);
            mma_ab<DQK, BQB, PQK>(dk, a, sQ, lane);
        }
        __syncthreads();  // every warp's dS is in shared memory

        const int r0 = 16 * qs;
        if (!DETERMINISTIC && r0 < nqb) {
            u32 a[BKB / 16][4];
            const u32 ds_lane = smem_addr(sdS) + ((r0 + (lane & 15)) * PS + (lane >> 4) * 8) * 2;
#pragma unroll
            for (int kk = 0; kk < BKB / 16; ++kk) ldmatrix_x4(a[kk], ds_lane + kk * 32);
            for (int c = qc0; c < DQK / 16; c += SLICE_WARPS) {
                float dq[2][4];
                zero<16>(dq);
                mma_ab<16, BKB, PQK>(dq, a, sK + c * 16 * 2, lane);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = r0 + g + 8 * hh;
                    if (r >= nqb) continue;
                    float* acc = accum_row(bp, s, i0 + r);
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = c * 16 + n * 8 + 2 * t + e;
                            if (col < p.head_dim) atomic_add_f32(acc + col, dq[n][2 * hh + e]);
                        }
                }
            }
        }
    }

    cp_async_wait<0>();  // K and V landed even when no query sees the block
    const int rows = s0.nk - j0 - kw0;
    if (rows <= 0) return;
    store_rows<DQK>(dk_rows(bp, s0) + (i64)(j0 + kw0) * bp.dk_row, bp.dk_row, dk, p.scale, rows, p.head_dim, lane);
    store_rows<DV>(dv_rows(bp, s0) + (i64)(j0 + kw0) * bp.dv_row, bp.dv_row, dv, 1.f, rows, p.head_dim_v, lane);
}
