// The Hopper backward for head dims above 128 (sm_90a, issue 65): dK and dV of 128 keys no longer
// fit two warpgroups' registers, so a block owns BKB = 64 keys of one (batch, key/value head) and
// the two consumer warpgroups split the head dims instead of the keys. A step of BQB = 64 query
// rows computes
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ            wgmma SS, warpgroup w: all 64 keys × queries 32w..32w+31
//   Pᵀ = exp(Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − D)   on the accumulators (bwd_p_ds), then stored to
//                                      shared memory (both warpgroups' halves meet at one barrier)
//   dV += Pᵀ·dO, dK += dSᵀ·Q           wgmma SS, warpgroup w: columns DV/2·w.., DQK/2·w..
//   dQ = dS·K                          wgmma SS (dSᵀ as MN-major A), warpgroup w: its DQK/2
//                                      columns, 64 at a time through its own f32 tile, added to
//                                      dq_accum by its own TMA reductions
// Pᵀ and dSᵀ are double-buffered, so one barrier a step suffices. Q and dO have rings of their own
// (dO's slot frees after dV, the step's first product; Q's after dK), so where shared memory
// allows one dO slot only, Q still has two. Column blocks past the head dim are zeroed, never loaded.
//
// Defines: ELEM_BF16 or ELEM_F16; DQK, DV in {128, 256} (head dims padded to 128, not both 128);
// Q_STAGES, DO_STAGES >= 1; DETERMINISTIC; the option flags of mask.cuh. Parameters as flash_bwd_wgmma's (K and
// V boxes of 64 rows). Grid (key blocks, key/value heads, batch); 384 threads; WGMMA_BWD_SMEM bytes.

#define NWG 2
#define BKB 64
#define BQB 64
#define NT (128 * (NWG + 1))
#define CONSUMERS (128 * NWG)
#define HQK (DQK / 2)  // the head-dim columns of Q/K a warpgroup owns in dK and dQ
#define HV (DV / 2)    // and of V in dV
#define Q_BYTES (BQB * DQK * 2)
#define DO_BYTES (BQB * DV * 2)
#define K_BYTES (BKB * DQK * 2)
#define V_BYTES (BKB * DV * 2)
#define PDS_BYTES (BKB * BQB * 2)  // Pᵀ or dSᵀ: a 128-byte swizzled row of 64 queries per key
#define DQ_BLOCK_BYTES (BQB * 128)  // 32 f32 columns of BQB rows, as TMA reads them
#define DQ_HALVES (HQK / 64)  // a warpgroup's dQ goes through its tile 64 columns at a time
#define DQ_BYTES (2 * DQ_BLOCK_BYTES)  // a warpgroup's dQ tile
#define ROWS_BYTES (2 * BQB * 4)  // a dO slot's LSE·log2(e) and D
#define WGMMA_BWD_SMEM                                                                                         \
    (1024 + K_BYTES + V_BYTES + Q_STAGES * Q_BYTES + DO_STAGES * (DO_BYTES + ROWS_BYTES) + 4 * PDS_BYTES + \
     NWG * DQ_BYTES + 8 * (1 + 2 * (Q_STAGES + DO_STAGES)))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
// Named barriers: Pᵀ and dSᵀ of a step written (both warpgroups); a warpgroup's dQ tile written.
#define PDS_READY 1
#define DQ_FULL 2

extern "C" __global__ void __launch_bounds__(NT, 1)
    flash_bwd_wgmma_wide(const __grid_constant__ BwdParams bp, const __grid_constant__ TmaMap tq,
                         const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,
                         const __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tdq) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 base = smem_addr(smem);
    const u32 sK = (base + 1023) & ~1023u;
    const u32 sV = sK + K_BYTES;
    const u32 sQ0 = sV + V_BYTES;
    const u32 sdO0 = sQ0 + Q_STAGES * Q_BYTES;
    const u32 sPdS = sdO0 + DO_STAGES * DO_BYTES;  // Pᵀ, dSᵀ of even steps, then of odd ones
    const u32 sdQ = sPdS + 4 * PDS_BYTES;
    const u32 sRows = sdQ + NWG * DQ_BYTES;
    const u32 bars = sRows + DO_STAGES * ROWS_BYTES;
    const u32 full_kv = bars;
    auto full_q = [&](int st) { return bars + 8 * (1 + st); };
    auto empty_q = [&](int st) { return bars + 8 * (1 + Q_STAGES + st); };
    auto full_do = [&](int st) { return bars + 8 * (1 + 2 * Q_STAGES + st); };
    auto empty_do = [&](int st) { return bars + 8 * (1 + 2 * Q_STAGES + DO_STAGES + st); };
    auto at = [&](u32 addr) { return smem + (addr - base); };  // a generic pointer to a shared address

    const FlashParams& p = bp.f;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int b = blockIdx.z, hk = blockIdx.y, j0 = blockIdx.x * BKB;
    const SeqInfo s0 = seq_info_at(p, b, hk * p.group);
    if (j0 >= s0.nk) return;
    // The 64-column blocks that hold head-dim columns (the rest stay zero, as they were stored).
    const int qk_blocks = (p.head_dim + 63) / 64, v_blocks = (p.head_dim_v + 63) / 64;
    {
        auto zero = [&](u32 tile, int rows, int from, int to) {
            for (int x = tid; x < (to - from) * rows * 8; x += NT)
                *(uint4*)at(tile + from * rows * 128 + 16 * x) = make_uint4(0, 0, 0, 0);
        };
        zero(sK, BKB, qk_blocks, DQK / 64);
        zero(sV, BKB, v_blocks, DV / 64);
        for (int st = 0; st < Q_STAGES; ++st) zero(sQ0 + st * Q_BYTES, BQB, qk_blocks, DQK / 64);
        for (int st = 0; st < DO_STAGES; ++st) zero(sdO0 + st * DO_BYTES, BQB, v_blocks, DV / 64);
        fence_proxy_async();
    }
    if (tid == 0) {
        mbarrier_init(full_kv, 1);
        for (int st = 0; st < Q_STAGES; ++st) {
            mbarrier_init(full_q(st), 1);
            mbarrier_init(empty_q(st), 4 * NWG);  // one arrival per consumer warp
        }
        for (int st = 0; st < DO_STAGES; ++st) {
            mbarrier_init(full_do(st), 32);  // the producer warp's lanes (one with the bytes)
            mbarrier_init(empty_do(st), 4 * NWG);
        }
    }
    __syncthreads();
    // Step `it`: query head hk·group + it / per_head, rows r_first + (it % per_head)·BQB on.
    int r_first, r_end;
    query_rows(p, s0, j0, j0 + BKB, &r_first, &r_end);
    const int per_head = (r_end - r_first + BQB - 1) / BQB, steps = per_head * p.group;

    if (wg == NWG) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp != 0) return;
        if (lane == 0) {
            mbarrier_arrive_expect_tx(full_kv, (qk_blocks + v_blocks) * BKB * 128);
            for (int c = 0; c < qk_blocks; ++c)
                tma_load_4d(sK + c * BKB * 128, &tk, c * 64, s0.k_row0 + j0, hk, b, full_kv);
            for (int c = 0; c < v_blocks; ++c)
                tma_load_4d(sV + c * BKB * 128, &tv, c * 64, s0.k_row0 + j0, hk, b, full_kv);
        }
        for (int it = 0; it < steps; ++it) {
            const int qs = it % Q_STAGES, qph = (it / Q_STAGES) & 1;
            const int ds = it % DO_STAGES, dph = (it / DO_STAGES) & 1;
            const SeqInfo s = seq_info_at(p, b, hk * p.group + it / per_head);
            const int i0 = r_first + (it % per_head) * BQB;
            // The rows' LSE and D are read before the waits, so their latency hides under them.
            float lse[BQB / 32], delta[BQB / 32];
#pragma unroll
            for (int k = 0; k < BQB / 32; ++k) {
                const int r = lane + 32 * k;
                const bool in = i0 + r < s.nq;
                lse[k] = in ? p.lse[lse_index(p, s, i0 + r)] * LOG2E : NEG_INF;
                delta[k] = in ? bp.delta[lse_index(p, s, i0 + r)] : 0.f;
            }
            if (lane == 0) {
                mbarrier_wait(empty_q(qs), qph ^ 1);
                mbarrier_arrive_expect_tx(full_q(qs), qk_blocks * BQB * 128);
                for (int c = 0; c < qk_blocks; ++c)
                    tma_load_4d(sQ0 + qs * Q_BYTES + c * BQB * 128, &tq, c * 64, s.q_row0 + i0, s.h, b, full_q(qs));
            }
            mbarrier_wait(empty_do(ds), dph ^ 1);
            float* rows = (float*)at(sRows + ds * ROWS_BYTES);
#pragma unroll
            for (int k = 0; k < BQB / 32; ++k) {
                rows[lane + 32 * k] = lse[k];
                rows[BQB + lane + 32 * k] = delta[k];
            }
            if (lane != 0) {
                mbarrier_arrive(full_do(ds));
                continue;
            }
            mbarrier_arrive_expect_tx(full_do(ds), v_blocks * BQB * 128);
            for (int c = 0; c < v_blocks; ++c)
                tma_load_4d(sdO0 + ds * DO_BYTES + c * BQB * 128, &tdo, c * 64, s.q_row0 + i0, s.h, b, full_do(ds));
        }
        return;
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    const int g = lane >> 2, t = lane & 3;
    const int qw = 32 * wg;  // this warpgroup's first query row of a step in Sᵀ and dPᵀ
    float dk[HQK / 2], dv[HV / 2];
#pragma unroll
    for (int x = 0; x < HQK / 2; ++x) dk[x] = 0.f;
#pragma unroll
    for (int x = 0; x < HV / 2; ++x) dv[x] = 0.f;
#if !DETERMINISTIC
    const bool reducer = (tid & 127) == 0;  // the thread that issues this warpgroup's dQ reductions
    const u32 sdQw = sdQ + wg * DQ_BYTES;
#endif
    mbarrier_wait(full_kv, 0);

    for (int it = 0; it < steps; ++it) {
        const int qs = it % Q_STAGES, qph = (it / Q_STAGES) & 1;
        const int ds = it % DO_STAGES, dph = (it / DO_STAGES) & 1;
        const SeqInfo s = seq_info_at(p, b, hk * p.group + it / per_head);
        const int i0 = r_first + (it % per_head) * BQB;
        const u32 sQ = sQ0 + qs * Q_BYTES, sdO = sdO0 + ds * DO_BYTES;
        const u32 sP = sPdS + (it & 1) * 2 * PDS_BYTES, sdS = sP + PDS_BYTES;
        const float* rows = (const float*)at(sRows + ds * ROWS_BYTES);
        float sa[16], dpa[16];
        mbarrier_wait(full_q(qs), qph);
        mbarrier_wait(full_do(ds), dph);
        wgmma_fence();
        {
            const u64 kd = desc_sw128(opaque(sK)), qd = desc_sw128(opaque(sQ + qw * 128));
#pragma unroll
            for (int ks = 0; ks < DQK / 16; ++ks)
                wgmma_ss<32>(sa, desc_advance(kd, sw128_k_offset(ks, BKB)), desc_advance(qd, sw128_k_offset(ks, BQB)),
                             ks > 0);
            const u64 vd = desc_sw128(opaque(sV)), od = desc_sw128(opaque(sdO + qw * 128));
#pragma unroll
            for (int ks = 0; ks < DV / 16; ++ks)
                wgmma_ss<32>(dpa, desc_advance(vd, sw128_k_offset(ks, BKB)), desc_advance(od, sw128_k_offset(ks, BQB)),
                             ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(sa);
        wgmma_fence_operands(dpa);

        // Element x: key j0 + 16 warp + g + 8 ((x >> 1) & 1), query i0 + qw + 8 (x >> 2) + 2t + (x & 1).
        const float slope = alibi_slope(p, s);
        const bool full_step = i0 + BQB <= s.nq && block_is_full(p, s, i0, i0 + BQB, j0, BKB);
        auto p_ds = [&](const bool masked) {  // inlined twice, once per value
#pragma unroll
            for (int x = 0; x < 16; ++x) {
                const int r = qw + 8 * (x >> 2) + 2 * t + (x & 1), i = i0 + r;
                const int j = j0 + 16 * warp + g + 8 * ((x >> 1) & 1);
                const float lse2 = rows[r];
                bool seen = lse2 != NEG_INF;
                if (masked) seen &= (i < s.nq) & visible(p, s, i, j);
                float pr;
                dpa[x] = bwd_p_ds(bp, s, seen, sa[x], dpa[x], i, j, lse2, rows[BQB + r], slope, &pr);
                sa[x] = pr;
            }
        };
        if (full_step && !SCORE_MODS)
            p_ds(false);
        else
            p_ds(true);
#if !DETERMINISTIC
        if (reducer) bulk_wait_read<0>();  // the last step's reductions have read the dQ tile
#endif
#pragma unroll
        for (int x = 0; x < 16; x += 2) {
            const int key = 16 * warp + g + 8 * ((x >> 1) & 1), q = qw + 8 * (x >> 2) + 2 * t;
            *(u32*)at(sP + sw128_offset(key, q, BKB)) = pack2(sa[x], sa[x + 1]);
            *(u32*)at(sdS + sw128_offset(key, q, BKB)) = pack2(dpa[x], dpa[x + 1]);
        }
        fence_proxy_async();
        bar_sync(PDS_READY, CONSUMERS);

        wgmma_fence();
        {
            const u64 pd = desc_sw128(opaque(sP)), dsd = desc_sw128(opaque(sdS));
            const u64 od = desc_sw128_mn(opaque(sdO + wg * (HV / 64) * BQB * 128), BQB * 128);
            const u64 qd = desc_sw128_mn(opaque(sQ + wg * (HQK / 64) * BQB * 128), BQB * 128);
#pragma unroll
            for (int kk = 0; kk < BQB / 16; ++kk)
                wgmma_ss<HV, 0, 1>(dv, desc_advance(pd, sw128_k_offset(kk, BKB)), desc_advance(od, sw128_mn_k_offset(kk)),
                                   1);
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < BQB / 16; ++kk)
                wgmma_ss<HQK, 0, 1>(dk, desc_advance(dsd, sw128_k_offset(kk, BKB)), desc_advance(qd, sw128_mn_k_offset(kk)),
                                    1);
            wgmma_commit();
        }
#if !DETERMINISTIC
        // dQ of this warpgroup's columns, 64 at a time (one commit group each).
        float dq[DQ_HALVES][32];
        {
            const u64 ad = desc_sw128_mn(opaque(sdS), BKB * 128);
#pragma unroll
            for (int hh = 0; hh < DQ_HALVES; ++hh) {
                const u64 kd = desc_sw128_mn(opaque(sK + (wg * DQ_HALVES + hh) * BKB * 128), BKB * 128);
#pragma unroll
                for (int kk = 0; kk < BKB / 16; ++kk)
                    wgmma_ss<64, 1, 1>(dq[hh], desc_advance(ad, sw128_mn_k_offset(kk)),
                                       desc_advance(kd, sw128_mn_k_offset(kk)), kk > 0);
                wgmma_commit();
            }
        }
#define DQ_GROUPS DQ_HALVES
#else
#define DQ_GROUPS 0
#endif
        wgmma_wait<DQ_GROUPS + 1>();
        wgmma_fence_operands(dv);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty_do(ds));  // dO, LSE and D of this slot are read
        wgmma_wait<DQ_GROUPS>();
        wgmma_fence_operands(dk);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty_q(qs));  // Q of this slot is read
#undef DQ_GROUPS
#if !DETERMINISTIC
        // 64 columns of dQ into the tile (query row 16 warp + g + 8 ((x >> 1) & 1), column
        // 8 (x >> 2) + 2t + (x & 1)), then its reductions; `hh` > 0 waits for the last ones' reads.
        auto reduce_dq = [&](const float(&d)[32], int hh) {
            if (hh > 0) {
                if (reducer) bulk_wait_read<0>();
                bar_sync(DQ_FULL + wg, 128);
            }
#pragma unroll
            for (int x = 0; x < 32; x += 2) {
                const int row = 16 * warp + g + 8 * ((x >> 1) & 1), col = 8 * (x >> 2) + 2 * t;
                // An f32 column is two 16-bit ones of sw128_offset's layout.
                float2* at2 = (float2*)at(sdQw + (col >> 5) * DQ_BLOCK_BYTES + sw128_offset(row, 2 * (col & 31), BQB));
                *at2 = make_float2(d[x], d[x + 1]);
            }
            fence_proxy_async();
            bar_sync(DQ_FULL + wg, 128);
            if (reducer) {
                const SeqInfo sr = seq_info_at(p, b, hk * p.group + it / per_head);  // fewer live registers
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = HQK * wg + 64 * hh + 32 * c;
                    if (col < p.head_dim)
                        tma_reduce_add_4d(&tdq, sdQw + c * DQ_BLOCK_BYTES, col, sr.q_row0 + i0, sr.h, b);
                }
                bulk_commit();
            }
        };
#if DQ_HALVES == 2
        wgmma_wait<1>();
        wgmma_fence_operands(dq[0]);
        reduce_dq(dq[0], 0);
        wgmma_wait<0>();
        wgmma_fence_operands(dq[1]);
        reduce_dq(dq[1], 1);
#else
        wgmma_wait<0>();
        wgmma_fence_operands(dq[0]);
        reduce_dq(dq[0], 0);
#endif
#endif
    }

    // dK·scale and dV of this warpgroup's columns, rows past the sequence's keys skipped.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = j0 + 16 * warp + g + 8 * h;
        if (key >= s0.nk) continue;
        elem_t* dkr = dk_rows(bp, s0) + (i64)key * bp.dk_row;
        elem_t* dvr = dv_rows(bp, s0) + (i64)key * bp.dv_row;
#pragma unroll
        for (int n = 0; n < HQK / 8; ++n) {
            const int col = HQK * wg + 8 * n + 2 * t;
            if (col < p.head_dim) *(u32*)(dkr + col) = pack2(dk[4 * n + 2 * h] * p.scale, dk[4 * n + 2 * h + 1] * p.scale);
        }
#pragma unroll
        for (int n = 0; n < HV / 8; ++n) {
            const int col = HV * wg + 8 * n + 2 * t;
            if (col < p.head_dim_v) *(u32*)(dvr + col) = pack2(dv[4 * n + 2 * h], dv[4 * n + 2 * h + 1]);
        }
    }
#if !DETERMINISTIC
    if (reducer) bulk_wait<0>();
#endif
}
