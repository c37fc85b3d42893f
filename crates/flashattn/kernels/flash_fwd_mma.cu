// FlashAttention-2 forward on tensor cores (f16/bf16 in, f32 accumulation), composed from the
// shared headers (types, block_info, mask, softmax) and mma.cuh. One block owns BR query rows of
// one (batch, head); each of its NWARPS warps owns MT consecutive 16-row slices. K/V blocks of BC
// keys stream through two shared-memory buffers each (cp.async): K(it+1) and V(it+1) load while
// block `it` is computed. S = Q.K^T and the softmax stay in registers; P is re-packed in registers
// as the A operand of O += P.V.
//
// Tile defines: DQK, DV (padded head dims, multiples of 32), BR, BC, NWARPS, Q_IN_REGS, MIN_BLOCKS,
// RESCALE_SLACK (0: the exact running max; 8: the max moves only by more than 2^8, see softmax.cuh).
// Option defines (mask.cuh) plus NONPOS_SCALE (scale <= 0: the row max is taken after scaling).

#define NT (NWARPS * 32)
#define MT (BR / (16 * NWARPS))
#define PQK (DQK + 8)  // row pitch of Q/K tiles: +16 bytes so ldmatrix rows hit distinct banks
#define PV (DV + 8)

// S[mt][n] = Q_warp . K_block^T for this warp's MT row slices.
// sQw, sKb: shared byte addresses of this warp's first Q row and of the K block. Each lane's
// ldmatrix row offsets are fixed; the loops only add compile-time constants.
__device__ __forceinline__ void scores_qk(float sc[MT][BC / 8][4], const u32 qf[MT][DQK / 16][4],
                                          u32 sQw, u32 sKb, int lane) {
    const u32 q_lane = sQw + ((lane & 15) * PQK + (lane >> 4) * 8) * 2;
    const u32 k_lane = sKb + (((lane >> 4) * 8 + (lane & 7)) * PQK + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#if Q_IN_REGS
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
#else
            ldmatrix_x4(a[mt], q_lane + (mt * 16 * PQK + kk * 16) * 2);
#endif
        }
#pragma unroll
        for (int nn = 0; nn < BC / 16; ++nn) {
            u32 b[4];
            ldmatrix_x4(b, k_lane + (nn * 16 * PQK + kk * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(sc[mt][2 * nn], a[mt], b[0], b[1]);
                mma_16816(sc[mt][2 * nn + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// O[mt] += P[mt] . V_block, P already packed as A fragments; psum[mt] += P[mt] . ones, the row sums
// of P as rounded (every column of the 16x8 result holds the sum of its row).
__device__ __forceinline__ void accumulate_pv(float o[MT][DV / 8][4], float psum[MT][4],
                                              const u32 pf[MT][BC / 16][4], u32 sVb, int lane) {
    const u32 ones = pack2(1.f, 1.f);
    const u32 v_lane = sVb + ((((lane >> 3) & 1) * 8 + (lane & 7)) * PV + (lane >> 4) * 8) * 2;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_16816(psum[mt], pf[mt][kk], ones, ones);
#pragma unroll
        for (int dn = 0; dn < DV / 16; ++dn) {
            u32 b[4];
            ldmatrix_x4_trans(b, v_lane + (kk * 16 * PV + dn * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(o[mt][2 * dn], pf[mt][kk], b[0], b[1]);
                mma_16816(o[mt][2 * dn + 1], pf[mt][kk], b[2], b[3]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS) flash_fwd_mma(const FlashParams p) {
    extern __shared__ __align__(16) u16 smem[];
    // Shared byte addresses: Q, then two K buffers, then two V buffers.
    const u32 sQ = smem_addr(smem);
    const u32 sK = sQ + BR * PQK * 2;
    const u32 sV = sK + 2 * BC * PQK * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const SeqInfo s = seq_info(p);
    const int i0 = block_row0(BR);
    if (i0 >= s.nq) return;
    const int i1 = min(i0 + BR, s.nq);
    int nb_first, nb_end;
    key_blocks(p, s, i0, i1, BC, &nb_first, &nb_end);
    const int n_iter = nb_end - nb_first;

    const u16* qg = q_row(p, s, i0);
    const u16* kg = k_rows(p, s);
    const u16* vg = v_rows(p, s);

    // Key blocks are visited from the last to the first, so the masked diagonal blocks come first.
    auto load_k = [&](int it) {
        if (it < n_iter) {
            const int j0 = (nb_end - 1 - it) * BC;
            load_tile_async<BC, DQK, PQK, NT>(sK + (it & 1) * BC * PQK * 2, kg + (i64)j0 * p.k_row, p.k_row,
                                              s.nk - j0, p.head_dim, tid);
        }
        cp_async_commit();
    };
    auto load_v = [&](int it) {
        if (it < n_iter) {
            const int j0 = (nb_end - 1 - it) * BC;
            load_tile_async<BC, DV, PV, NT>(sV + (it & 1) * BC * PV * 2, vg + (i64)j0 * p.v_row, p.v_row,
                                            s.nk - j0, p.head_dim_v, tid);
        }
        cp_async_commit();
    };
    load_tile_async<BR, DQK, PQK, NT>(sQ, qg, p.q_row, i1 - i0, p.head_dim, tid);
    load_k(0);  // one group: Q and K(0)
    load_v(0);

    const int wrow0 = warp * 16 * MT;  // this warp's first row within the block
    const u32 sQw = sQ + wrow0 * PQK * 2;
    const float slope = alibi_slope(p, s);
#if SCORE_MODS
    // Scores after the mods are in natural units; log2(e) is applied inside the exponent's FFMA
    // (never rounded into each score: at |s| ~ 1e4 that would cost 1e-3 of relative error).
    const float mult = LOG2E;
#else
    const float mult = p.scale_log2;  // scale * log2(e), folded into the exponent's FFMA
#endif

    float o[MT][DV / 8][4];
    // row[..].sum: the sum of P in f32 (for the LSE). psum: the sum of P as rounded for the P.V
    // product (by the tensor cores, P times a column of ones), which normalizes O, so the weights
    // applied to V sum to 1: a one-hot row gives its V row exactly even when its P is 2^x != 1
    // under the lazy reference max.
    RowSoftmax<float> row[MT][2];
    float psum[MT][4];
    u32 qf[MT][DQK / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DV / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            softmax_init(row[mt][h]);
            psum[mt][2 * h] = psum[mt][2 * h + 1] = 0.f;
        }
    }

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<1>();  // K(it) (and Q) landed; V(it) may still be in flight
        __syncthreads();
#if Q_IN_REGS
        if (it == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < DQK / 16; ++kk)
                    ldmatrix_x4(qf[mt][kk], sQw + ((mt * 16 + (lane & 15)) * PQK + kk * 16 + (lane >> 4) * 8) * 2);
        }
#endif
        // Both buffers of block it-1 are free: every warp has passed the barrier above.
        load_k(it + 1);
        load_v(it + 1);

        const int j0 = (nb_end - 1 - it) * BC;
        float sc[MT][BC / 8][4];
        scores_qk(sc, qf, sQw, sK + (it & 1) * BC * PQK * 2, lane);

        const bool full = block_is_full(p, s, i0, i1, j0, BC);
        mods_and_mask<MT, BC / 8>(p, s, &sc[0][0][0], i0 + wrow0 + g, j0, t, full, slope);

        // Online softmax with a lazy reference max (softmax_max_moves, slack RESCALE_SLACK): a warp
        // whose rows all keep their reference skips the rescale of O.
        float bmax[MT][2];
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(sc[mt][n][2 * h], sc[mt][n][2 * h + 1]));
                bmax[mt][h] = row_allreduce_max<4>(mx);
                grow |= softmax_max_moves(row[mt][h], bmax[mt][h], mult, RESCALE_SLACK);
            }
        if (__any_sync(0xffffffff, grow)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const bool moves = softmax_max_moves(row[mt][h], bmax[mt][h], mult, RESCALE_SLACK);
                    const float m_new = moves ? bmax[mt][h] : row[mt][h].max;
                    const float corr = softmax_rescale(row[mt][h], m_new, mult);
                    psum[mt][2 * h] *= corr;
                    psum[mt][2 * h + 1] *= corr;
#pragma unroll
                    for (int n = 0; n < DV / 8; ++n) {
                        o[mt][n][2 * h] *= corr;
                        o[mt][n][2 * h + 1] *= corr;
                    }
                }
        }
        u32 pf[MT][BC / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x = softmax_p(row[mt][h], sc[mt][n][2 * h + e], mult);
                        sc[mt][n][2 * h + e] = x;
                        sum += x;
                    }
                row[mt][h].sum += sum;
            }
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                pf[mt][kk][0] = pack2(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
                pf[mt][kk][1] = pack2(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
                pf[mt][kk][2] = pack2(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
                pf[mt][kk][3] = pack2(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
            }
        }

        cp_async_wait<2>();  // V(it) landed; K(it+1), V(it+1) may still be in flight
        __syncthreads();
        accumulate_pv(o, psum, pf, sV + (it & 1) * BC * PV * 2, lane);
    }
    cp_async_wait<0>();

    // Finish: O / l, LSE = ln(sum exp(s)); rows that saw no key give 0 and -inf.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float l = row_allreduce_sum<4>(row[mt][h].sum);
            const int i = i0 + wrow0 + mt * 16 + g + 8 * h;
            if (i >= s.nq) continue;
            const float inv = softmax_inv_sum(psum[mt][2 * h]);
            elem_t* og = out_row(p, s, i);
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                const int col = n * 8 + 2 * t;
                if (col < p.head_dim_v)
                    *(u32*)(og + col) = pack2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
            }
            if (t == 0) store_lse(p, s, i, softmax_lse(row[mt][h], l, mult));
        }
}
