// The Hopper forward (sm_90a, issue 64): warp-specialized FlashAttention on wgmma and TMA.
// A block is one producer warpgroup and NWG consumer warpgroups of 64 query rows each. The
// producer's one elected thread loads each tile's Q, and K/V blocks of BC keys into a ring of STAGES
// slots by TMA (128B swizzle), each slot guarded by a full and an empty mbarrier. A consumer
// computes S = Q.K^T by wgmma SS, the mask, score mods and online softmax on the accumulators
// (the m16n8 C-fragment layout over BC/8 column chunks, so softmax.cuh applies as in the mma
// kernel) and O += P.V by wgmma RS (P packed to 16 bits in registers, V MN-major). Overlap:
// S of block j+1 and P.V of block j are issued together, and the softmax of block j+1 runs while
// P.V is in flight, and the producer loads the next tile's Q and K/V under this tile's last
// blocks and epilogue. The consumers run a fixed lag apart (set once, then kept: no barrier spans
// them), so one's first softmax and epilogue of a tile run under another's matrix products. Each
// consumer computes only the key blocks its own rows see (under a mask, or with rows past the end),
// and frees the tile's other blocks as they land.
//
// Defines: ELEM_BF16 or ELEM_F16; DQK, DV (head dims padded to a multiple of 64; DV in {64, 128,
// 192, 256}); BC, keys a block (32, 64 or 128); NWG in {2, 3} and BR = 64 NWG; STAGES >= 2;
// RESCALE_SLACK; SECTION_MB (tile_order's L2 section, default 8); the
// option flags of mask.cuh and NONPOS_SCALE.
// Parameters: FlashParams, the tensor maps of Q, K, V (rank 4: head dim, rows, heads, batch;
// boxes of 64 x 64 for Q, a consumer's rows, and 64 x BC for K and V), and `sched`, two ints that
// are 0 before the first launch (each launch leaves them 0) and that no launch running at the same
// time shares.
// Persistent: a grid of at most one block per SM (tile_order numbers the tiles), 128 (NWG + 1)
// threads, WGMMA_SMEM bytes of dynamic shared memory.

#ifndef SECTION_MB
#define SECTION_MB 8
#endif
#if BR != 64 * NWG
#error "flash_fwd_wgmma: BR must be 64 NWG"
#endif
#define NT (128 * (NWG + 1))
// Named barriers: the tile slot's, one pair a consumer (with the producer's warp), and STAGGER + w,
// where the producer waits once for consumer w's first S.
#define SLOT_FULL 1
#define SLOT_READ (1 + NWG)
#define SLOT_THREADS (32 + 128)
#define STAGGER (1 + 2 * NWG)
#define Q_BYTES (BR * DQK * 2)
#define QW_BYTES (64 * DQK * 2)  // one consumer's rows
#define K_BYTES (BC * DQK * 2)
#define V_BYTES (BC * DV * 2)
// 1024 to align the tiles, the tiles, then the mbarriers and the tile slot.
#define WGMMA_SMEM (1024 + Q_BYTES + STAGES * (K_BYTES + V_BYTES) + 1024)
// Register budgets after the split: the producer gives back what the consumers take (65536 a block:
// 128 x PRODUCER_REGS + 128 NWG x CONSUMER_REGS, multiples of 8).
#if NWG == 2
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#else
#define PRODUCER_REGS 32
#define CONSUMER_REGS 160
#endif

struct I4 {
    int x, y, z, w;
};
__device__ __forceinline__ void st_shared_v4(u32 addr, I4 v) {
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ I4 ld_shared_v4(u32 addr) {
    I4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                 : "memory");
    return v;
}

// The tile slot, written by the producer for every consumer: {tile (-1: no more), i0, stagger, 0},
// the tile's SeqInfo in two records, then one record a consumer: {key blocks to skip first, to
// compute, to skip last, the end of the computed ones}. The consumers read it instead of
// recomputing it, which shortens each tile's start.
#define SLOT_BYTES (16 * (3 + NWG))
#if 16 * (NWG + 2 * STAGES) + SLOT_BYTES > 1024
#error "flash_fwd_wgmma: the mbarriers and the tile slot exceed their 1 KiB"
#endif
__device__ __forceinline__ void put_seq(u32 slot, const SeqInfo& s) {
    st_shared_v4(slot + 16, {s.b, s.h, s.hk, s.q_row0});
    st_shared_v4(slot + 32, {s.k_row0, s.nq, s.nk, s.diag});
}
__device__ __forceinline__ SeqInfo get_seq(u32 slot) {
    const I4 a = ld_shared_v4(slot + 16), b = ld_shared_v4(slot + 32);
    return {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
}

// The key blocks consumer w's rows see, within the tile's [first, end) of rows [i0, i1): empty at
// `end` when it has none. Key blocks are loaded last first, so it skips end - *we blocks, computes
// *we - *wf and skips *wf - first.
__device__ __forceinline__ void consumer_blocks(const FlashParams& p, const SeqInfo& s, int i0, int i1, int w,
                                                int end, int* wf, int* we) {
    key_blocks(p, s, i0 + 64 * w, min(i0 + 64 * w + 64, i1), BC, wf, we);
    if (*we <= *wf) *wf = *we = end;
}

// The first tile staggers the consumers only when each of them sees every key block of it, so
// every consumer's first S is on the tile's first block.
__device__ __forceinline__ bool consumers_see_all(const FlashParams& p, const SeqInfo& s, int i0, int i1,
                                                  int first, int end) {
    bool all = end > first;
#pragma unroll
    for (int w = 0; w < NWG; ++w) {
        int wf, we;
        consumer_blocks(p, s, i0, i1, w, end, &wf, &we);
        all &= wf == first && we == end;
    }
    return all;
}

// One consumer's row state: this lane's rows g and g + 8 of its warp's 16.
struct Rows {
    RowSoftmax<float> r[2];
    float corr[2];  // the factor O must take before the next P.V (1 when the max stayed)
    bool grow;      // some row of the warp moved its max
};

// Score mods and the mask on S of key block j0 (this lane's rows `row` and row + 8 of the consumer's
// rows [r0, r1)), then the online softmax:
// the max moves (lazily), sc becomes P in f32 and the f32 sums grow. O is untouched here (a P.V
// may be in flight); `finish_p` applies rows.corr to O once it has landed.
__device__ __forceinline__ void softmax_block(float (&sc)[BC / 2], Rows& rows, const FlashParams& p,
                                              const SeqInfo& s, int r0, int r1, int j0, int row, int t,
                                              float mult, float slope) {
    mods_and_mask<1, BC / 8>(p, s, sc, row, j0, t, block_is_full(p, s, r0, r1, j0, BC), slope);
    float bmax[2];
    bool grow = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(sc[4 * n + 2 * h], sc[4 * n + 2 * h + 1]));
        bmax[h] = row_allreduce_max<4>(mx);
        grow |= softmax_max_moves(rows.r[h], bmax[h], mult, RESCALE_SLACK);
    }
    rows.grow = __any_sync(0xffffffff, grow);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows.corr[h] = 1.f;
        if (rows.grow) {
            const bool moves = softmax_max_moves(rows.r[h], bmax[h], mult, RESCALE_SLACK);
            rows.corr[h] = softmax_rescale(rows.r[h], moves ? bmax[h] : rows.r[h].max, mult);
        }
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = softmax_p(rows.r[h], sc[4 * n + 2 * h + e], mult);
                sc[4 * n + 2 * h + e] = x;
                sum += x;
            }
        rows.r[h].sum += sum;
    }
}

// After the previous P.V landed: O takes rows.corr, and P is packed into the RS A-fragment layout
// (registers 8 kk .. 8 kk + 7 of S in pairs). O is normalized by the f32 sum of P as computed (not as
// rounded to 16 bits: that second sum cost a fifth of the loop's instructions; kernels/README.md).
__device__ __forceinline__ void finish_p(const float (&sc)[BC / 2], u32 (&pf)[BC / 16][4], float (&o)[DV / 2],
                                         Rows& rows) {
    if (rows.grow) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                o[4 * n + 2 * h] *= rows.corr[h];
                o[4 * n + 2 * h + 1] *= rows.corr[h];
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) pf[kk][j] = pack2(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1]);
}

extern "C" __global__ void __launch_bounds__(NT, 1)
    flash_fwd_wgmma(const __grid_constant__ FlashParams p, const __grid_constant__ TmaMap tq,
                    const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv, int* sched) {
    extern __shared__ __align__(1024) unsigned char smem[];
    // Shared byte addresses (tiles 1024-aligned): Q, the K ring, the V ring, then the mbarriers and
    // the tile slot (SLOT_BYTES: the tile whose Q is in sQ). Each consumer's 64 Q rows have their
    // own pair of mbarriers, so their refill waits for no consumer behind them (the producer waits
    // for consumer 0's rows first, the one the stagger puts ahead).
    const u32 sQ = (smem_addr(smem) + 1023) & ~1023u;
    const u32 sK = sQ + Q_BYTES;
    const u32 sV = sK + STAGES * K_BYTES;
    const u32 bars = sV + STAGES * V_BYTES;
    const u32 tile_slot = bars + 8 * (2 * NWG + 4 * STAGES);
    auto full_q = [&](int w) { return bars + 8 * w; };
    auto empty_q = [&](int w) { return bars + 8 * (NWG + w); };
    auto full_k = [&](int st) { return bars + 8 * (2 * NWG + st); };
    auto full_v = [&](int st) { return bars + 8 * (2 * NWG + STAGES + st); };
    auto empty_k = [&](int st) { return bars + 8 * (2 * NWG + 2 * STAGES + st); };
    auto empty_v = [&](int st) { return bars + 8 * (2 * NWG + 3 * STAGES + st); };

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    if (tid == 0) {
        for (int w = 0; w < NWG; ++w) {
            mbarrier_init(full_q(w), 1);
            mbarrier_init(empty_q(w), 4);  // one arrival per warp of consumer w
        }
        for (int st = 0; st < STAGES; ++st) {
            mbarrier_init(full_k(st), 1);
            mbarrier_init(full_v(st), 1);
            mbarrier_init(empty_k(st), 4 * NWG);
            mbarrier_init(empty_v(st), 4 * NWG);
        }
    }
    __syncthreads();
    // Persistent: block b starts with tile b, then takes tiles in order from the counter sched[0].
    // The producer passes each tile to the consumers through the tile slot: it writes the slot and
    // arrives on each consumer's SLOT_FULL, where that consumer waits before reading it; a consumer
    // arrives on its SLOT_READ after reading, where the producer waits before writing the next (named
    // barriers, which racecheck sees). No barrier spans the consumers, so they need not keep in step.
    const int n_tiles = tile_count(p, BR);  // the host keeps it below 2^31
    const TileOrder order = tile_order(p, BR, SECTION_MB);

    if (wg == NWG) {
        // The producer: key blocks from the last to the first (the masked diagonal ones first).
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp != 0 || lane != 0) return;
        auto has_rows = [&](int t) {  // varlen: a tile past its sequence's end has none
            int i0;
            const SeqInfo s = tile_info(p, order, t, &i0);
            return i0 < s.nq;
        };
        auto claim = [&]() {  // the next tile with rows from the counter, or n_tiles or more
            int t;
            do t = (int)gridDim.x + atomicAdd(sched, 1);
            while (t < n_tiles && p.cu_q != 0 && !has_rows(t));
            return t;
        };
        int kv = 0, qn = 0;
        auto load_q = [&](int w, const SeqInfo& s, int i0, int tb) {  // consumer w's Q rows
            mbarrier_arrive_expect_tx(full_q(w), QW_BYTES);
#pragma unroll
            for (int c = 0; c < DQK / 64; ++c)
                tma_load_4d(sQ + c * BR * 128 + w * 64 * 128, &tq, c * 64, s.q_row0 + i0 + 64 * w, s.h, tb,
                            full_q(w));
        };
        // Publishes tile t (or the end), then loads its Q (none for a consumer whose rows see no key)
        // and K/V blocks. In the block's first tile, if every consumer sees all of its keys, consumer
        // w > 0 gets its Q after the first K/V block, once consumer w - 1's first S has landed: the
        // one-time stagger.
        auto load_tile = [&](int t) {
            if (qn > 0)
                for (int w = 0; w < NWG; ++w) bar_sync(SLOT_READ + w, SLOT_THREADS);
            if (t >= n_tiles) {
                st_shared_v4(tile_slot, {-1, 0, 0, 0});
                for (int w = 0; w < NWG; ++w) bar_arrive(SLOT_FULL + w, SLOT_THREADS);
                return;
            }
            const int qph = (qn++ & 1) ^ 1;
            int i0, nb_first, nb_end;
            const SeqInfo s = tile_info(p, order, t, &i0);
            const int i1 = min(i0 + BR, s.nq);
            key_blocks(p, s, i0, i1, BC, &nb_first, &nb_end);
            const int tb = p.cu_q != 0 ? 0 : s.b;  // varlen rows are packed into one batch entry
            const bool stagger = qn == 1 && consumers_see_all(p, s, i0, i1, nb_first, nb_end);
            st_shared_v4(tile_slot, {t, i0, stagger, 0});
            put_seq(tile_slot, s);
            for (int w = 0; w < NWG; ++w) {
                int wf, we;
                consumer_blocks(p, s, i0, i1, w, nb_end, &wf, &we);
                st_shared_v4(tile_slot + 48 + 16 * w, {nb_end - we, we - wf, wf - nb_first, we});
            }
            for (int w = 0; w < NWG; ++w) bar_arrive(SLOT_FULL + w, SLOT_THREADS);
            // Consumer w frees its Q after its last S; what it does after that (its last P.V, its
            // trailing skips) waits only on blocks already loaded. A later release would deadlock here.
            for (int w = 0; w < NWG; ++w) {
                mbarrier_wait(empty_q(w), qph);
                if (ld_shared_v4(tile_slot + 48 + 16 * w).y == 0)  // its rows see no key
                    mbarrier_arrive(full_q(w));
                else if (w == 0 || !stagger)
                    load_q(w, s, i0, tb);
            }
            for (int jb = nb_end - 1; jb >= nb_first; --jb, ++kv) {
                const int st = kv % STAGES, ph = (kv / STAGES) & 1;
                const int row = s.k_row0 + jb * BC;
                mbarrier_wait(empty_k(st), ph ^ 1);
                mbarrier_arrive_expect_tx(full_k(st), K_BYTES);
#pragma unroll
                for (int c = 0; c < DQK / 64; ++c)
                    tma_load_4d(sK + st * K_BYTES + c * BC * 128, &tk, c * 64, row, s.hk, tb, full_k(st));
                mbarrier_wait(empty_v(st), ph ^ 1);
                mbarrier_arrive_expect_tx(full_v(st), V_BYTES);
#pragma unroll
                for (int c = 0; c < DV / 64; ++c)
                    tma_load_4d(sV + st * V_BYTES + c * BC * 128, &tv, c * 64, row, s.hk, tb, full_v(st));
                if (stagger && jb == nb_end - 1)
                    for (int w = 1; w < NWG; ++w) {
                        bar_sync(STAGGER + w - 1, SLOT_THREADS);
                        load_q(w, s, i0, tb);
                    }
            }
        };
        int cur = (int)blockIdx.x;
        if (cur < n_tiles && p.cu_q != 0 && !has_rows(cur)) cur = claim();
        for (;;) {
            const int next = cur < n_tiles ? claim() : cur;  // claimed a tile ahead
            load_tile(cur);
            if (cur >= n_tiles) break;
            cur = next;
        }
        // The last block to stop taking tiles resets the counters for the next launch.
        if (atomicAdd(sched + 1, 1) == (int)gridDim.x - 1) {
            atomicExch(sched, 0);
            atomicExch(sched + 1, 0);
        }
        return;
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    const int g = lane >> 2, t = lane & 3;
    const u32 sQw = sQ + wg * 64 * 128;     // this warpgroup's 64 Q rows in each 64-column block
#if SCORE_MODS
    const float mult = LOG2E;  // scores are scaled by score_mods
#else
    const float mult = p.scale_log2;  // scale * log2(e), folded into the exponent's FFMA
#endif
    float o[DV / 2];
    float sc[BC / 2];
    u32 pf[BC / 16][4];
    // Tile addresses are opaque: descriptors built where used.
    auto issue_s = [&](int st) {
        const u64 q = desc_sw128(opaque(sQw)), k = desc_sw128(opaque(sK + st * K_BYTES));
#pragma unroll
        for (int ks = 0; ks < DQK / 16; ++ks)
            wgmma_ss<BC>(sc, desc_advance(q, sw128_k_offset(ks, BR)), desc_advance(k, sw128_k_offset(ks, BC)),
                         ks > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int st) {
        const u64 v = desc_sw128_mn(opaque(sV + st * V_BYTES), BC * 128);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<DV, 1>(o, pf[kk], desc_advance(v, sw128_mn_k_offset(kk)), 1);
        wgmma_commit();
    };
    // One arrival a warp, after __syncwarp so that every lane is done with the buffer.
    auto release = [&](u32 bar) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(bar);
    };
    // This consumer's Q mbarriers. The full one's address goes through a shuffle, which ptxas knows
    // to be warp-uniform: waiting on an address computed from wg moved the main loop's slot
    // arithmetic off the uniform datapath (+35 instructions a block; kernels/README.md).
    const u32 my_full_q = __shfl_sync(0xffffffff, full_q(wg), 0), my_empty_q = empty_q(wg);
    const int wgu = __shfl_sync(0xffffffff, wg, 0);  // the same for the key range (uniform)
    int kv = 0, qn = 0;
    // Key blocks this consumer's rows do not see: freed as they land.
    auto skip = [&](int n) {
        for (int b = 0; b < n; ++b, ++kv) {
            const int st = kv % STAGES, ph = (kv / STAGES) & 1;
            mbarrier_wait(full_k(st), ph);
            release(empty_k(st));
            mbarrier_wait(full_v(st), ph);
            release(empty_v(st));
        }
    };
    for (;;) {
        bar_sync(SLOT_FULL + wg, SLOT_THREADS);
        const I4 head = ld_shared_v4(tile_slot);
        if (head.x < 0) break;
        const SeqInfo s = get_seq(tile_slot);
        const I4 mine = ld_shared_v4(tile_slot + 48 + 16 * wgu);
        bar_arrive(SLOT_READ + wg, SLOT_THREADS);
        mbarrier_wait(my_full_q, qn++ & 1);
        const int i0 = head.y, n_iter = mine.y, we = mine.w;
        const int r0 = i0 + 64 * wgu, r1 = min(r0 + 64, s.nq), row = r0 + warp * 16 + g;
        const float slope = alibi_slope(p, s);
#pragma unroll
        for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
        Rows rows;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            softmax_init(rows.r[h]);
        }
        if (n_iter == 0) release(my_empty_q);
        skip(mine.x);
        if (n_iter > 0) {
            const int st = kv % STAGES;
            mbarrier_wait(full_k(st), (kv / STAGES) & 1);
            wgmma_fence();
            issue_s(st);
            wgmma_wait<0>();
            wgmma_fence_operands(sc);
            if (head.z && wg < NWG - 1) bar_arrive(STAGGER + wg, SLOT_THREADS);  // load_tile's stagger
            release(empty_k(st));
            if (n_iter == 1) release(my_empty_q);
            softmax_block(sc, rows, p, s, r0, r1, (we - 1) * BC, row, t, mult, slope);
            finish_p(sc, pf, o, rows);
        }
        for (int it = 1; it < n_iter; ++it) {
            const int st = (kv + it) % STAGES, ph = ((kv + it) / STAGES) & 1;
            const int pst = (kv + it - 1) % STAGES, pph = ((kv + it - 1) / STAGES) & 1;
            mbarrier_wait(full_k(st), ph);
            mbarrier_wait(full_v(pst), pph);  // loaded before K(it); a wait between wgmmas adds a fence
            wgmma_fence_operands(o);
            wgmma_fence();
            issue_s(st);
            issue_pv(pst);
            wgmma_wait<1>();  // S landed; P.V may still run
            wgmma_fence_operands(sc);
            release(empty_k(st));
            if (it == n_iter - 1) release(my_empty_q);
            softmax_block(sc, rows, p, s, r0, r1, (we - 1 - it) * BC, row, t, mult, slope);
            wgmma_wait<0>();
            wgmma_fence_operands(o);
            release(empty_v(pst));
            finish_p(sc, pf, o, rows);
        }
        if (n_iter > 0) {
            kv += n_iter;
            const int pst = (kv - 1) % STAGES, pph = ((kv - 1) / STAGES) & 1;
            mbarrier_wait(full_v(pst), pph);
            wgmma_fence_operands(o);
            wgmma_fence();
            issue_pv(pst);
            wgmma_wait<0>();
            wgmma_fence_operands(o);
            release(empty_v(pst));
        }
        skip(mine.z);

        // Finish: O / l, LSE = ln(sum exp(s)); rows that saw no key give 0 and -inf.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float l = row_allreduce_sum<4>(rows.r[h].sum);
            const int i = row + 8 * h;
            if (i >= s.nq) continue;
            const float inv = softmax_inv_sum(l);
            elem_t* og = out_row(p, s, i);
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                const int col = n * 8 + 2 * t;
                if (col < p.head_dim_v)
                    *(u32*)(og + col) = pack2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
            }
            if (t == 0) store_lse(p, s, i, softmax_lse(rows.r[h], l, mult));
        }
    }
}
