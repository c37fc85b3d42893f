// The Hopper backward key-block kernel (sm_90a, issue 65): FlashAttention-2's backward on wgmma and
// TMA. A block owns BKB = 128 keys of one (batch, key/value head). The producer warp loads K and V
// once, then Q, dO (TMA, 128B swizzle) and the LSE and D of BQB = 64 query rows a step into a ring
// of STAGES slots (full and empty mbarriers), walking the query rows of the group's heads that see
// the block. Each of the two consumer warpgroups owns 64 keys and keeps their dK, dV in f32
// registers; a step computes
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ           wgmma SS (64 keys × 64 queries a warpgroup; at head dim 64
//                                     RS, K and V kept as A fragments in registers)
//   Pᵀ = exp(Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − D)   on the accumulators (bwd_p_ds)
//   dV += Pᵀ·dO, dK += dSᵀ·Q          wgmma RS (Pᵀ, dSᵀ packed to 16 bits; dO, Q MN-major)
//   dQ = dS·K                         wgmma SS from dSᵀ in shared memory (MN-major A), the f32
//                                     tile added to dq_accum by TMA reductions (one a 32 columns)
// At head dim 128 the warpgroups share dQ by columns (64 each, over all 128 keys), so they meet at
// named barriers; at 64 each computes dQ over its own keys into its own tile and reduces it itself.
// In deterministic mode dQ and the bias gradient are left to flash_bwd_dq.
//
// Defines: ELEM_BF16 or ELEM_F16; DQK, DV in {64, 128} (head dims padded to 64); STAGES >= 2;
// DETERMINISTIC; the option flags of mask.cuh. Parameters: BwdParams, then the tensor maps of Q, K,
// V and dO (rank 4 as the forward's; boxes of 64 × BQB rows for Q and dO, 64 × BKB for K and V)
// and of dq_accum (f32, boxes of 32 columns × BQB rows; unused in deterministic mode).
// Grid (key blocks, key/value heads, batch); 384 threads; WGMMA_BWD_SMEM bytes of shared memory.

#define NWG 2
#define BKB 128
#define BQB 64
#define NT (128 * (NWG + 1))
#define CONSUMERS (128 * NWG)
#define Q_BYTES (BQB * DQK * 2)
#define DO_BYTES (BQB * DV * 2)
#define K_BYTES (BKB * DQK * 2)
#define V_BYTES (BKB * DV * 2)
#define DS_BYTES (BKB * BQB * 2)
// dQ's f32 tile as TMA reads it: blocks of 32 columns (128-byte rows, swizzled) of BQB rows each.
#define DQ_BLOCK_BYTES (BQB * 128)
#define DQ_BYTES (DQK / 32 * DQ_BLOCK_BYTES)
#define ROWS_BYTES (2 * BQB * 4)  // a slot's LSE·log2(e) and D
#define DQ_SHARED (DQK >= 128)  // the warpgroups share dQ by columns (see above)
#define DQ_KEYS (DQ_SHARED ? BKB : 64)
#define DQ_TILES (DQ_SHARED ? 1 : NWG)
#define DQ_SYNC (DQ_SHARED ? CONSUMERS : 128)  // the threads that meet before and after a dQ product
// K and V held as A fragments (registers allow it only at 64). Not in deterministic mode: there
// ptxas (CUDA 13.0) reuses the fragments' registers inside the step loop (wrong dK; the PTX is right),
// which tests/cuda_compile.rs looks for in the SASS of CI's NVRTC (other versions are not checked).
#define KV_REGS (DQK == 64 && DV == 64 && !DETERMINISTIC)
#define WGMMA_BWD_SMEM                                                                                     \
    (1024 + K_BYTES + V_BYTES + STAGES * (Q_BYTES + DO_BYTES + ROWS_BYTES) + DS_BYTES + DQ_TILES * DQ_BYTES + \
     8 * (1 + 2 * STAGES))
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
// Named barriers (one pair, or one a warpgroup): dSᵀ written and the last dQ tile read; dQ written.
#define DS_READY 1
#define DQ_FULL 3

extern "C" __global__ void __launch_bounds__(NT, 1)
    flash_bwd_wgmma(const __grid_constant__ BwdParams bp, const __grid_constant__ TmaMap tq,
                    const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,
                    const __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tdq) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 base = smem_addr(smem);
    const u32 sK = (base + 1023) & ~1023u;
    const u32 sV = sK + K_BYTES;
    const u32 sQ0 = sV + V_BYTES;
    const u32 sdO0 = sQ0 + STAGES * Q_BYTES;
    const u32 sdS = sdO0 + STAGES * DO_BYTES;
    const u32 sdQ = sdS + DS_BYTES;
    const u32 sRows = sdQ + DQ_TILES * DQ_BYTES;
    const u32 bars = sRows + STAGES * ROWS_BYTES;
    const u32 full_kv = bars;
    auto full = [&](int st) { return bars + 8 * (1 + st); };
    auto empty = [&](int st) { return bars + 8 * (1 + STAGES + st); };
    auto at = [&](u32 addr) { return smem + (addr - base); };  // a generic pointer to a shared address

    const FlashParams& p = bp.f;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int b = blockIdx.z, hk = blockIdx.y, j0 = blockIdx.x * BKB;
    const SeqInfo s0 = seq_info_at(p, b, hk * p.group);
    if (j0 >= s0.nk) return;
    if (tid == 0) {
        mbarrier_init(full_kv, 1);
        for (int st = 0; st < STAGES; ++st) {
            mbarrier_init(full(st), 32);        // the producer warp's lanes (one with the bytes)
            mbarrier_init(empty(st), 4 * NWG);  // one arrival per consumer warp
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
            mbarrier_arrive_expect_tx(full_kv, K_BYTES + V_BYTES);
#pragma unroll
            for (int c = 0; c < DQK / 64; ++c)
                tma_load_4d(sK + c * BKB * 128, &tk, c * 64, s0.k_row0 + j0, hk, b, full_kv);
#pragma unroll
            for (int c = 0; c < DV / 64; ++c)
                tma_load_4d(sV + c * BKB * 128, &tv, c * 64, s0.k_row0 + j0, hk, b, full_kv);
        }
        for (int it = 0; it < steps; ++it) {
            const int st = it % STAGES, ph = (it / STAGES) & 1;
            const SeqInfo s = seq_info_at(p, b, hk * p.group + it / per_head);
            const int i0 = r_first + (it % per_head) * BQB;
            mbarrier_wait(empty(st), ph ^ 1);
            float* rows = (float*)at(sRows + st * ROWS_BYTES);
            for (int r = lane; r < BQB; r += 32) {
                const bool in = i0 + r < s.nq;
                rows[r] = in ? p.lse[lse_index(p, s, i0 + r)] * LOG2E : NEG_INF;
                rows[BQB + r] = in ? bp.delta[lse_index(p, s, i0 + r)] : 0.f;
            }
            if (lane != 0) {
                mbarrier_arrive(full(st));
                continue;
            }
            mbarrier_arrive_expect_tx(full(st), Q_BYTES + DO_BYTES);
#pragma unroll
            for (int c = 0; c < DQK / 64; ++c)
                tma_load_4d(sQ0 + st * Q_BYTES + c * BQB * 128, &tq, c * 64, s.q_row0 + i0, s.h, b, full(st));
#pragma unroll
            for (int c = 0; c < DV / 64; ++c)
                tma_load_4d(sdO0 + st * DO_BYTES + c * BQB * 128, &tdo, c * 64, s.q_row0 + i0, s.h, b, full(st));
        }
        return;
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    const int g = lane >> 2, t = lane & 3;
    const int kw = 64 * wg;  // this warpgroup's first key within the block
    float dk[DQK / 2], dv[DV / 2];
#pragma unroll
    for (int x = 0; x < DQK / 2; ++x) dk[x] = 0.f;
#pragma unroll
    for (int x = 0; x < DV / 2; ++x) dv[x] = 0.f;
#if !DETERMINISTIC
    const bool reducer = (tid & (DQ_SYNC - 1)) == 0;  // the thread that issues dQ's reductions
    const int bar_wg = DQ_SHARED ? 0 : wg;
    const u32 sdQw = sdQ + bar_wg * DQ_BYTES;  // the dQ tile this warpgroup writes
#endif
    mbarrier_wait(full_kv, 0);
#if KV_REGS
    // This warpgroup's K and V rows as the A fragments of Sᵀ and dPᵀ, loaded once: their products
    // then read only Qᵀ and dOᵀ from shared memory.
    u32 kf[DQK / 16][4], vf[DV / 16][4];
#pragma unroll
    for (int ks = 0; ks < DQK / 16; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // the accumulator layout's elements 8 ks + 2q and + 1
            const u32 off = sw128_offset(kw + 16 * warp + g + 8 * (q & 1), 16 * ks + 8 * (q >> 1) + 2 * t, BKB);
            kf[ks][q] = *(const u32*)at(sK + off);
            vf[ks][q] = *(const u32*)at(sV + off);
        }
#endif

    for (int it = 0; it < steps; ++it) {
        const int st = it % STAGES, ph = (it / STAGES) & 1;
        const SeqInfo s = seq_info_at(p, b, hk * p.group + it / per_head);
        const int i0 = r_first + (it % per_head) * BQB;
        const u32 sQ = sQ0 + st * Q_BYTES, sdO = sdO0 + st * DO_BYTES;
        const float* rows = (const float*)at(sRows + st * ROWS_BYTES);
        mbarrier_wait(full(st), ph);

        float sa[BQB / 2], dpa[BQB / 2];
        wgmma_fence();
#if KV_REGS
        {
            const u64 qd = desc_sw128(opaque(sQ)), od = desc_sw128(opaque(sdO));
#pragma unroll
            for (int ks = 0; ks < DQK / 16; ++ks)
                wgmma_rs<BQB>(sa, kf[ks], desc_advance(qd, sw128_k_offset(ks, BQB)), ks > 0);
#pragma unroll
            for (int ks = 0; ks < DV / 16; ++ks)
                wgmma_rs<BQB>(dpa, vf[ks], desc_advance(od, sw128_k_offset(ks, BQB)), ks > 0);
        }
#else
        {
            const u64 kd = desc_sw128(opaque(sK + kw * 128)), qd = desc_sw128(opaque(sQ));
#pragma unroll
            for (int ks = 0; ks < DQK / 16; ++ks)
                wgmma_ss<BQB>(sa, desc_advance(kd, sw128_k_offset(ks, BKB)), desc_advance(qd, sw128_k_offset(ks, BQB)),
                              ks > 0);
            const u64 vd = desc_sw128(opaque(sV + kw * 128)), od = desc_sw128(opaque(sdO));
#pragma unroll
            for (int ks = 0; ks < DV / 16; ++ks)
                wgmma_ss<BQB>(dpa, desc_advance(vd, sw128_k_offset(ks, BKB)), desc_advance(od, sw128_k_offset(ks, BQB)),
                              ks > 0);
        }
#endif
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(sa);
        wgmma_fence_operands(dpa);

        // Element x: key j0 + kw + 16 warp + g + 8 ((x >> 1) & 1), query i0 + 8 (x >> 2) + 2t + (x & 1).
        const float slope = alibi_slope(p, s);
        const bool full_step = i0 + BQB <= s.nq && block_is_full(p, s, i0, i0 + BQB, j0, BKB);
        // Steps whose rows all see all of the block's keys (most of them) skip the mask.
        auto p_ds = [&](const bool masked) {  // inlined twice, once per value
#pragma unroll
            for (int x = 0; x < BQB / 2; ++x) {
                const int r = 8 * (x >> 2) + 2 * t + (x & 1), i = i0 + r;
                const int j = j0 + kw + 16 * warp + g + 8 * ((x >> 1) & 1);
                const float lse2 = rows[r];
                bool seen = lse2 != NEG_INF;
                if (masked) seen &= (i < s.nq) & visible(p, s, i, j);
                float pr;
                dpa[x] = bwd_p_ds(bp, s, seen, sa[x], dpa[x], i, j, lse2, rows[BQB + r], slope, &pr);
                sa[x] = pr;
            }
        };
        if (full_step && !SCORE_MODS)  // with score mods a second copy spills at head dim 128
            p_ds(false);
        else
            p_ds(true);
        u32 pp[BQB / 16][4], pds[BQB / 16][4];
#pragma unroll
        for (int kk = 0; kk < BQB / 16; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                pp[kk][q] = pack2(sa[8 * kk + 2 * q], sa[8 * kk + 2 * q + 1]);
                pds[kk][q] = pack2(dpa[8 * kk + 2 * q], dpa[8 * kk + 2 * q + 1]);
            }
#if !DETERMINISTIC
        // dSᵀ as dS's MN-major A operand: a 128-byte swizzled row of 64 queries per key.
#pragma unroll
        for (int x = 0; x < BQB / 2; x += 2) {
            const int key = kw + 16 * warp + g + 8 * ((x >> 1) & 1);
            *(u32*)at(sdS + sw128_offset(key, 8 * (x >> 2) + 2 * t, BKB)) = pds[x >> 3][(x >> 1) & 3];
        }
#endif
        wgmma_fence();
        {
            const u64 od = desc_sw128_mn(opaque(sdO), BQB * 128), qd = desc_sw128_mn(opaque(sQ), BQB * 128);
#pragma unroll
            for (int kk = 0; kk < BQB / 16; ++kk) wgmma_rs<DV, 1>(dv, pp[kk], desc_advance(od, sw128_mn_k_offset(kk)), 1);
#pragma unroll
            for (int kk = 0; kk < BQB / 16; ++kk)
                wgmma_rs<DQK, 1>(dk, pds[kk], desc_advance(qd, sw128_mn_k_offset(kk)), 1);
        }
        wgmma_commit();
#if !DETERMINISTIC
        if (reducer) bulk_wait_read<0>();  // the last step's reductions have read the dQ tile
        fence_proxy_async();
        bar_sync(DS_READY + bar_wg, DQ_SYNC);
        float dq[32];  // 64 columns of dQ: all of them at head dim 64, this warpgroup's half at 128
        wgmma_fence();
        {
            const u32 kd0 = DQ_SHARED ? sK + wg * BKB * 128 : sK + kw * 128;
            const u64 ad = desc_sw128_mn(opaque(DQ_SHARED ? sdS : sdS + kw * 128), BKB * 128);
            const u64 kd = desc_sw128_mn(opaque(kd0), BKB * 128);
#pragma unroll
            for (int kk = 0; kk < DQ_KEYS / 16; ++kk)
                wgmma_ss<64, 1, 1>(dq, desc_advance(ad, sw128_mn_k_offset(kk)), desc_advance(kd, sw128_mn_k_offset(kk)),
                                   kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(dq);
#else
        wgmma_wait<0>();
#endif
        wgmma_fence_operands(dv);
        wgmma_fence_operands(dk);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty(st));  // Q, dO, LSE and D of this slot are read
#if !DETERMINISTIC
        // dQ's tile: query row 16 warp + g + 8 ((x >> 1) & 1), column 8 (x >> 2) + 2t + (x & 1).
#pragma unroll
        for (int x = 0; x < 32; x += 2) {
            const int row = 16 * warp + g + 8 * ((x >> 1) & 1);
            const int col = (DQ_SHARED ? 64 * wg : 0) + 8 * (x >> 2) + 2 * t;
            // An f32 column is two 16-bit ones of sw128_offset's layout.
            float2* at2 = (float2*)at(sdQw + (col >> 5) * DQ_BLOCK_BYTES + sw128_offset(row, 2 * (col & 31), BQB));
            *at2 = make_float2(dq[x], dq[x + 1]);
        }
        fence_proxy_async();
        bar_sync(DQ_FULL + bar_wg, DQ_SYNC);
        if (reducer) {
#pragma unroll
            for (int c = 0; c < DQK / 32; ++c)
                if (32 * c < p.head_dim)
                    tma_reduce_add_4d(&tdq, sdQw + c * DQ_BLOCK_BYTES, 32 * c, s.q_row0 + i0, s.h, b);
            bulk_commit();
        }
#endif
    }

    // dK·scale and dV of this warpgroup's keys, rows past the sequence's keys skipped.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = j0 + kw + 16 * warp + g + 8 * h;
        if (key >= s0.nk) continue;
        elem_t* dkr = dk_rows(bp, s0) + (i64)key * bp.dk_row;
        elem_t* dvr = dv_rows(bp, s0) + (i64)key * bp.dv_row;
#pragma unroll
        for (int n = 0; n < DQK / 8; ++n) {
            const int col = 8 * n + 2 * t;
            if (col < p.head_dim) *(u32*)(dkr + col) = pack2(dk[4 * n + 2 * h] * p.scale, dk[4 * n + 2 * h + 1] * p.scale);
        }
#pragma unroll
        for (int n = 0; n < DV / 8; ++n) {
            const int col = 8 * n + 2 * t;
            if (col < p.head_dim_v) *(u32*)(dvr + col) = pack2(dv[4 * n + 2 * h], dv[4 * n + 2 * h + 1]);
        }
    }
#if !DETERMINISTIC
    if (reducer) bulk_wait<0>();
#endif
}
