// Test kernels of the Hopper vocabulary (hopper.cuh): one warpgroup computes C[64 x TILE_N] =
// A[64 x TILE_K] * B[TILE_N x TILE_K]^T in f32, with wgmma SS (A and B loaded by TMA, or written by
// ordinary stores into the swizzled layout) and RS (B by TMA, A's fragments read from global memory
// into registers); and the attention's O[64 x TILE_N] = P[64 x TILE_K] * V[TILE_K x TILE_N] by RS
// with V MN-major (imm-trans-b). A and B are row-major in global memory (TILE_K elements a row), V
// too (TILE_N a row). Pasted after types.cuh, mma.cuh and hopper.cuh behind `#define`s of ELEM_BF16
// or ELEM_F16, TILE_N (64, 128, 256) and TILE_K (a multiple of 64). Launch: one block of 128
// threads with 1024 + A_BYTES + B_BYTES bytes of dynamic shared memory (the tiles start
// 1024-aligned: the dynamic base is rounded up).

#define A_BYTES (64 * TILE_K * 2)
#define B_BYTES (TILE_N * TILE_K * 2)

// The A tile's and the B tile's shared addresses.
struct TestTiles {
    u32 a, b;
};

__device__ __forceinline__ TestTiles test_tiles(const void* smem) {
    const u32 base = (smem_addr(smem) + 1023) & ~1023u;
    return {base, base + A_BYTES};
}

// Thread 0 loads the B tile (and the A tile when `with_a`) by TMA, one 64-column box at a time,
// on `bar`; every thread then waits for the bytes. With `b_mn`, B is V[TILE_K][TILE_N] (MN-major):
// boxes of 64 N-columns x TILE_K rows, one block of TILE_K x 128 bytes each.
__device__ __forceinline__ void load_tiles(TestTiles t, const TmaMap* a_map, const TmaMap* b_map, bool with_a,
                                           u32 bar, bool b_mn = false) {
    if (threadIdx.x == 0) {
        mbarrier_init(bar, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(bar, B_BYTES + (with_a ? A_BYTES : 0));
#pragma unroll
        for (int kb = 0; kb < TILE_K / 64; ++kb) {
            if (with_a) tma_load_2d(t.a + kb * 64 * 128, a_map, kb * 64, 0, bar);
            if (!b_mn) tma_load_2d(t.b + kb * TILE_N * 128, b_map, kb * 64, 0, bar);
        }
        if (b_mn) {
#pragma unroll
            for (int nb = 0; nb < TILE_N / 64; ++nb) tma_load_2d(t.b + nb * TILE_K * 128, b_map, nb * 64, 0, bar);
        }
    }
    mbarrier_wait(bar, 0);
}

// Writes the accumulators (row-major, TILE_N columns) to `c`.
__device__ __forceinline__ void store_acc(float* c, const float (&acc)[TILE_N / 2]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < TILE_N / 2; ++i) {
        c[wgmma_acc_row(i, lane, warp) * TILE_N + wgmma_acc_col(i, lane)] = acc[i];
    }
}

// The accumulators start as NaN: the first wgmma's accumulate = 0 must ignore them.
__device__ __forceinline__ void poison_acc(float (&acc)[TILE_N / 2]) {
#pragma unroll
    for (int i = 0; i < TILE_N / 2; ++i) acc[i] = NAN_F;
}

// The descriptor of k16 step `ks` of the B tile at `b`: K-major, or MN-major (V) when TRANS_B.
template <int TRANS_B>
__device__ __forceinline__ u64 b_desc(u32 b, int ks) {
    return TRANS_B ? desc_sw128_mn(b + sw128_mn_k_offset(ks), TILE_K * 128) : desc_sw128(b + sw128_k_offset(ks, TILE_N));
}

// acc = A * B^T (A * V when TRANS_B) by wgmma SS over the tiles at `t`, then written to `c`.
template <int TRANS_B = 0>
__device__ __forceinline__ void mma_ss_and_store(float* c, TestTiles t) {
    float acc[TILE_N / 2];
    poison_acc(acc);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < TILE_K / 16; ++ks) {
        wgmma_ss<TILE_N, 0, TRANS_B>(acc, desc_sw128(t.a + sw128_k_offset(ks, 64)), b_desc<TRANS_B>(t.b, ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    store_acc(c, acc);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    hopper_test_ss(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map, float* c) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bar;
    const TestTiles t = test_tiles(smem);
    load_tiles(t, &a_map, &b_map, true, smem_addr(&bar));
    mma_ss_and_store(c, t);
}

// Copies a ROWS x TILE_K tile from global memory (b32 pairs) into the swizzled layout at `dst`.
template <int ROWS>
__device__ __forceinline__ void store_tile(u32 dst, const u32* src) {
    for (int p = threadIdx.x; p < ROWS * TILE_K / 2; p += 128) {
        const int r = p / (TILE_K / 2), col = 2 * (p % (TILE_K / 2));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(dst + sw128_offset(r, col, ROWS)), "r"(src[p]) : "memory");
    }
}

// The SS product with the tiles written by ordinary stores: exercises `sw128_offset` and
// `fence_proxy_async` (each writer fences, then the barrier, then wgmma reads).
extern "C" __global__ void __launch_bounds__(128, 1) hopper_test_ss_stores(const u32* a, const u32* b, float* c) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const TestTiles t = test_tiles(smem);
    store_tile<64>(t.a, a);
    store_tile<TILE_N>(t.b, b);
    fence_proxy_async();
    __syncthreads();
    mma_ss_and_store(c, t);
}

// Each thread reads its A fragments from `a` as b32 pairs.
extern "C" __global__ void __launch_bounds__(128, 1)
    hopper_test_rs(const __grid_constant__ TmaMap b_map, const u32* a, float* c) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bar;
    const TestTiles t = test_tiles(smem);
    load_tiles(t, &b_map, &b_map, false, smem_addr(&bar));

    // m16n8k16 A fragment of step ks: rows r0, r0 + 8 and columns c0, c0 + 8 (pairs of 2).
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int r0 = 16 * warp + lane / 4;
    u32 frag[TILE_K / 16][4];
#pragma unroll
    for (int ks = 0; ks < TILE_K / 16; ++ks) {
        const int c0 = 16 * ks + 2 * (lane % 4);
        frag[ks][0] = a[(r0 * TILE_K + c0) / 2];
        frag[ks][1] = a[((r0 + 8) * TILE_K + c0) / 2];
        frag[ks][2] = a[(r0 * TILE_K + c0 + 8) / 2];
        frag[ks][3] = a[((r0 + 8) * TILE_K + c0 + 8) / 2];
    }

    float acc[TILE_N / 2];
    poison_acc(acc);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < TILE_K / 16; ++ks) {
        wgmma_rs<TILE_N>(acc, frag[ks], desc_sw128(t.b + sw128_k_offset(ks, TILE_N)), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    store_acc(c, acc);
}

// P.V as the attention kernel will do it: P (f32, 64 x TILE_K row-major, values exact in the 16-bit
// type) read into the accumulator layout of an m64nTILE_K product and packed in pairs into the RS A
// fragments; V (TILE_K x TILE_N row-major) loaded by TMA in 64-column boxes as an MN-major tile.
extern "C" __global__ void __launch_bounds__(128, 1)
    hopper_test_rs_mn(const __grid_constant__ TmaMap v_map, const float* p, float* c) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bar;
    const TestTiles t = test_tiles(smem);
    load_tiles(t, &v_map, &v_map, false, smem_addr(&bar), true);

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float s[TILE_K / 2];
#pragma unroll
    for (int i = 0; i < TILE_K / 2; ++i) s[i] = p[wgmma_acc_row(i, lane, warp) * TILE_K + wgmma_acc_col(i, lane)];
    u32 frag[TILE_K / 16][4];
#pragma unroll
    for (int ks = 0; ks < TILE_K / 16; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) frag[ks][j] = pack2(s[8 * ks + 2 * j], s[8 * ks + 2 * j + 1]);
    }

    float acc[TILE_N / 2];
    poison_acc(acc);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < TILE_K / 16; ++ks) {
        wgmma_rs<TILE_N, 1>(acc, frag[ks], b_desc<1>(t.b, ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    store_acc(c, acc);
}

// P.V by SS: P (64 x TILE_K, K-major) and V (MN-major) both loaded by TMA, imm-trans-b = 1.
extern "C" __global__ void __launch_bounds__(128, 1)
    hopper_test_ss_mn(const __grid_constant__ TmaMap p_map, const __grid_constant__ TmaMap v_map, float* c) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bar;
    const TestTiles t = test_tiles(smem);
    load_tiles(t, &p_map, &v_map, true, smem_addr(&bar), true);
    mma_ss_and_store<1>(c, t);
}
