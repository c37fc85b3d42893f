// First Hopper forward (sm_90a, issue 64, step 1): the FA2 dataflow of flash_fwd_mma.cu on warpgroup
// MMA. NWG consumer warpgroups (128 threads each) own 64 query rows each of one (batch, head); no
// producer warp, no TMA yet. Q, K and V are written by cp.async into 128B-swizzled tiles
// (`sw128_offset`), fenced to the async proxy; K/V blocks of BC keys are double-buffered.
// S = Q.K^T by wgmma SS (both K-major), the online softmax on the accumulators (the m16n8
// C-fragment layout repeated over BC/8 column chunks, so softmax.cuh applies as in the mma kernel),
// P packed to 16-bit pairs in registers and O += P.V by wgmma RS with V MN-major (imm-trans-b).
//
// Defines: ELEM_BF16 or ELEM_F16; DQK = DV in {64, 128}; BC in {64, 128}; NWG in {1, 2} and
// BR = 64 NWG; RESCALE_SLACK; SYNC_LOADS (1: ordinary loads + stores instead of cp.async);
// HAS_MASK (a window, causal included). Score mods are not supported.
// Launch: grid (ceil(nq / BR), heads_q, batch), 128 NWG threads, WGMMA_SMEM bytes of dynamic smem.

#if HAS_SOFTCAP || HAS_ALIBI || HAS_BIAS || NONPOS_SCALE
#error "flash_fwd_wgmma: score mods and scale <= 0 are not supported"
#endif
#if DQK != DV
#error "flash_fwd_wgmma: DQK must equal DV"
#endif

#if BR != 64 * NWG
#error "flash_fwd_wgmma: BR must be 64 NWG"
#endif
#define NT (128 * NWG)
#define Q_BYTES (BR * DQK * 2)
#define K_BYTES (BC * DQK * 2)
#define V_BYTES (BC * DV * 2)
#define WGMMA_SMEM (1024 + Q_BYTES + 2 * K_BYTES + 2 * V_BYTES)

// Copies a ROWS x COLS tile of 16-bit elements (row stride `stride`) into the K-major 128B-swizzled
// layout at `dst` by 16-byte chunks (cp.async unless SYNC_LOADS); rows >= `rows` and columns >= `cols` are zero-filled.
// The same layout is V's MN-major one: element (key, d) at sw128_offset(key, d, BC).
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile_sw128(u32 dst, const u16* src, i64 stride, int rows, int cols, int tid) {
    // Each thread keeps one 16-byte column chunk and walks rows STEP apart; STEP is a multiple of 8,
    // so the swizzle (row % 8) stays fixed and the shared address advances by STEP * 128 bytes.
    const int CPR = COLS / 8;  // 16-byte chunks a row
    static_assert(NT % CPR == 0 && (NT / CPR) % 8 == 0 && ROWS % (NT / CPR) == 0, "tile load shape");
    const int STEP = NT / CPR;
    const int r0 = tid / CPR, col = (tid % CPR) * 8;
    const u16* gp = src + r0 * stride + col;
    const u32 d = dst + sw128_offset(r0, col, ROWS);
    const bool col_ok = col < cols;
#pragma unroll
    for (int r = 0; r < ROWS; r += STEP) {
        const bool ok = col_ok && r + r0 < rows;
#if SYNC_LOADS
        // The tested `ss_stores` way (a fallback for checking cp.async + the proxy fence): load, store.
        u32 x0 = 0, x1 = 0, x2 = 0, x3 = 0;
        if (ok)
            asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "l"(gp));
        asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(d + r * 128), "r"(x0), "r"(x1), "r"(x2), "r"(x3)
                     : "memory");
#else
        cp_async_16(d + r * 128, ok ? gp : src, ok);
#endif
        gp += STEP * stride;
    }
}

// The bf16/f16 pair `x` (low half first) back in f32, summed: the row sum of P as rounded.
__device__ __forceinline__ float sum_pair(u32 x) {
#if defined(ELEM_BF16)
    return __uint_as_float(x << 16) + __uint_as_float(x & 0xffff0000u);
#else
    return f16_to_f32((u16)(x & 0xffff)) + f16_to_f32((u16)(x >> 16));
#endif
}

extern "C" __global__ void __launch_bounds__(NT, 1) flash_fwd_wgmma(const FlashParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    // Shared byte addresses (1024-aligned): Q, two K buffers, two V buffers.
    const u32 sQ = (smem_addr(smem) + 1023) & ~1023u;
    const u32 sK = sQ + Q_BYTES;
    const u32 sV = sK + 2 * K_BYTES;

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
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

    // Key blocks from the last to the first, so the masked diagonal blocks come first.
    auto load_k = [&](int it) {
        if (it < n_iter) {
            const int j0 = (nb_end - 1 - it) * BC;
            load_tile_sw128<BC, DQK>(sK + (it & 1) * K_BYTES, kg + (i64)j0 * p.k_row, p.k_row, s.nk - j0,
                                     p.head_dim, tid);
        }
        cp_async_commit();
    };
    auto load_v = [&](int it) {
        if (it < n_iter) {
            const int j0 = (nb_end - 1 - it) * BC;
            load_tile_sw128<BC, DV>(sV + (it & 1) * V_BYTES, vg + (i64)j0 * p.v_row, p.v_row, s.nk - j0,
                                    p.head_dim_v, tid);
        }
        cp_async_commit();
    };
    load_tile_sw128<BR, DQK>(sQ, qg, p.q_row, i1 - i0, p.head_dim, tid);
    load_k(0);  // one group: Q and K(0)
    load_v(0);

    // This warpgroup's 64 Q rows start at row 64 wg: 8 KB into each 64-column block (1024-aligned).
    const u32 sQw = sQ + wg * 64 * 128;
    const int wrow0 = wg * 64 + warp * 16;  // this warp's first row within the block
    const float mult = p.scale_log2;        // scale * log2(e), folded into the exponent's FFMA

    // Accumulators: o[4 n + e] is the m16n8 C fragment of columns 8n..8n+7 (e < 2: row g, else g + 8).
    float o[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
    // row[h].sum: P's sum in f32 (for the LSE); psum[h]: P's sum as rounded to 16 bits (normalizes O,
    // so a one-hot row gives its V row exactly). Both are this lane's share of its row.
    RowSoftmax<float> row[2];
    float psum[2] = {0.f, 0.f};
    softmax_init(row[0]);
    softmax_init(row[1]);

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<1>();  // K(it) (and Q) landed; V(it) may still be in flight
        fence_proxy_async();
        __syncthreads();
        // Both buffers of block it-1 are free: every thread waited for its wgmmas before the barrier.
        load_k(it + 1);
        load_v(it + 1);

        const int j0 = (nb_end - 1 - it) * BC;
        const u32 sKb = sK + (it & 1) * K_BYTES;
        float sc[BC / 2];
        wgmma_fence_operands(sc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < DQK / 16; ++ks) {
            wgmma_ss<BC>(sc, desc_sw128(sQw + sw128_k_offset(ks, BR)), desc_sw128(sKb + sw128_k_offset(ks, BC)),
                         ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(sc);

        if (!block_is_full(p, s, i0, i1, j0, BC)) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = i0 + wrow0 + g + 8 * h;
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (!visible(p, s, i, j0 + n * 8 + 2 * t + e)) sc[4 * n + 2 * h + e] = NEG_INF;
            }
        }

        // Online softmax with the lazy reference max, as in flash_fwd_mma.cu.
        float bmax[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(sc[4 * n + 2 * h], sc[4 * n + 2 * h + 1]));
            bmax[h] = row_allreduce_max<4>(mx);
            grow |= softmax_max_moves(row[h], bmax[h], mult, RESCALE_SLACK);
        }
        if (__any_sync(0xffffffff, grow)) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool moves = softmax_max_moves(row[h], bmax[h], mult, RESCALE_SLACK);
                const float m_new = moves ? bmax[h] : row[h].max;
                const float corr = softmax_rescale(row[h], m_new, mult);
                psum[h] *= corr;
#pragma unroll
                for (int n = 0; n < DV / 8; ++n) {
                    o[4 * n + 2 * h] *= corr;
                    o[4 * n + 2 * h + 1] *= corr;
                }
            }
        }
        // P in the RS A-fragment layout: registers 8 kk .. 8 kk + 7 of S packed in pairs.
        u32 pf[BC / 16][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x = softmax_p(row[h], sc[4 * n + 2 * h + e], mult);
                    sc[4 * n + 2 * h + e] = x;
                    sum += x;
                }
            row[h].sum += sum;
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                pf[kk][j] = pack2(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1]);
                psum[j & 1] += sum_pair(pf[kk][j]);  // j = 0, 2: row g; j = 1, 3: row g + 8
            }

        cp_async_wait<2>();  // V(it) landed; K(it+1), V(it+1) may still be in flight
        fence_proxy_async();
        __syncthreads();
        const u32 sVb = sV + (it & 1) * V_BYTES;
        wgmma_fence_operands(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            wgmma_rs<DV, 1>(o, pf[kk], desc_sw128_mn(sVb + sw128_mn_k_offset(kk), BC * 128), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
    }
    cp_async_wait<0>();

    // Finish: O / l, LSE = ln(sum exp(s)); rows that saw no key give 0 and -inf.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float l = row_allreduce_sum<4>(row[h].sum);
        const float lr = row_allreduce_sum<4>(psum[h]);
        const int i = i0 + wrow0 + g + 8 * h;
        if (i >= s.nq) continue;
        const float inv = softmax_inv_sum(lr);
        elem_t* og = out_row(p, s, i);
#pragma unroll
        for (int n = 0; n < DV / 8; ++n) {
            const int col = n * 8 + 2 * t;
            if (col < p.head_dim_v) *(u32*)(og + col) = pack2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
        }
        if (t == 0) store_lse(p, s, i, softmax_lse(row[h], l, mult));
    }
}
