// Hopper (sm_90a) building blocks: shared-memory matrix descriptors, warpgroup MMA (wgmma), the
// async-proxy fence, mbarriers and TMA tile loads. Pasted after types.cuh and mma.cuh (for
// `smem_addr` and the ELEM_* dtype); compiles only with `--gpu-architecture=sm_90a`.
//
// Layout relied on throughout: a K-major tile with 128-byte swizzle is stored as column blocks of
// 64 16-bit elements (128 bytes a row); in a block, row r sits at byte 128 r and its 16-byte chunk c
// at chunk c ^ (r % 8). That is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element
// inner box, and what a 128B-swizzle descriptor reads. Blocks must start 1024-byte aligned.

// ---- Shared-memory matrix descriptors -----------------------------------------------------------

// Bytes between consecutive 8-row groups of a 128B-swizzled K-major tile (8 rows x 128 bytes).
#define SW128_GROUP_BYTES 1024

// The wgmma descriptor of a K-major, 128B-swizzled operand starting at shared byte address `addr`:
// bits 0-13 addr >> 4, 16-29 leading byte offset >> 4 (unused for this layout, set to 1 as
// CUTLASS does), 32-45 stride byte offset >> 4 (1024 B between 8-row groups), 49-51 base offset
// (0: the block is 1024-aligned), 62-63 swizzle mode (1 = 128B).
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(SW128_GROUP_BYTES >> 4) << 32) |
           ((u64)1 << 62);
}

// The descriptor `d` moved on by `bytes` (a multiple of 16): one add to the start address in its
// low bits (shared addresses stay below 2^18, so the add never carries into the next field).
__device__ __forceinline__ u64 desc_advance(u64 d, u32 bytes) {
    u32 lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(d));
    lo += bytes >> 4;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi));
    return d;
}

// Byte offset of 16-column step `ks` (k = 16 ks .. 16 ks + 15) inside a K-major 128B-swizzled tile
// of `rows` rows: the column block of 64, then 32 bytes per step inside it (the hardware applies
// the swizzle to the advanced address, so the base offset stays 0).
__device__ __forceinline__ u32 sw128_k_offset(int ks, int rows) {
    return (u32)((ks >> 2) * rows * 128 + (ks & 3) * 32);
}

// Byte offset of 16-bit element (r, c) in a K-major 128B-swizzled tile of `rows` rows: for tiles
// written by ordinary stores (then `fence_proxy_async`) instead of TMA, or read by ordinary loads.
__device__ __forceinline__ u32 sw128_offset(int r, int c, int rows) {
    return (u32)((c >> 6) * rows * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2);
}

// MN-major (transposed) tiles, e.g. V[keys][head dim] as the B of P.V: the same bytes as a
// K-major tile with the roles swapped, i.e. blocks of 64 MN-contiguous elements, one 128-byte row
// per k, row k at 128 k and chunk c at c ^ (k % 8); a TMA box of 64 MN-elements x `k_rows` rows
// writes one block, so element (k, n) is at sw128_offset(k, n, k_rows). Descriptor fields for this
// layout, from CUTLASS cute's make_gmma_desc<Major::MN> canonical form for 128B swizzle,
// Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) with T = 8 elements (16 bytes): LBO is the
// byte stride between 64-element MN blocks and SBO the stride between 8-row groups along K.
// ThunderKittens' transposed 128B descriptor agrees (LBO = 128 x tile rows, SBO = 1024, a k16 step
// 2048 B), and the PTX ISA's "Shared Memory Matrix Layout" says imm-trans-b = 1 reads B N-major.

// The descriptor of an MN-major 128B-swizzled operand at `addr` whose 64-element MN blocks are
// `block_bytes` apart (k_rows x 128 for a TMA-loaded tile; unused when the MMA's N is 64).
__device__ __forceinline__ u64 desc_sw128_mn(u32 addr, u32 block_bytes) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((block_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)(SW128_GROUP_BYTES >> 4) << 32) | ((u64)1 << 62);
}

// Byte offset of k16 step `ks` in an MN-major 128B-swizzled tile: 16 rows of 128 bytes (two
// 8-row groups, so it stays 1024-aligned and the base offset stays 0).
__device__ __forceinline__ u32 sw128_mn_k_offset(int ks) { return (u32)(ks * 16 * 128); }

// ---- Warpgroup MMA ------------------------------------------------------------------------------

// Orders this thread's earlier register and shared-memory accesses before the wgmmas that follow
// (needed whenever accumulators or A fragments were written by ordinary instructions).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins registers in place for the compiler: reads of accumulators cannot move above a
// `wgmma_wait` nor writes below a `wgmma_fence` (PTX registers are tied to the asm, not the wait).
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&r)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#if defined(ELEM_BF16)
#define WGMMA_TYPES "f32.bf16.bf16"
#else
#define WGMMA_TYPES "f32.f16.f16"
#endif

// Accumulator layout of m64nN (f32, N/2 registers a thread): register i of lane l in warp w of the
// warpgroup holds row 16 w + l / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (l % 4) + (i & 1).
// Two consecutive registers packed to 16 bits give the RS A-operand fragment of one k16 step.
__device__ __forceinline__ int wgmma_acc_row(int i, int lane, int warp) {
    return 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int wgmma_acc_col(int i, int lane) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

// PTX operand lists: "%0, ..., %R-1" as a string and the matching "+f"(d[i]) constraints. PTX names
// operands by number only, so the lists are spelled out by digit; WG_U(t, u) is operand "%tu".
#define WG_U(t, u) "%" #t #u
#define WG_T(t) \
    WG_U(t, 0) "," WG_U(t, 1) "," WG_U(t, 2) "," WG_U(t, 3) "," WG_U(t, 4) "," WG_U(t, 5) "," WG_U(t, 6) \
    "," WG_U(t, 7) "," WG_U(t, 8) "," WG_U(t, 9)
#define WG_REGS_16 WG_T() "," WG_U(1, 0) "," WG_U(1, 1) "," WG_U(1, 2) "," WG_U(1, 3) "," WG_U(1, 4) "," WG_U(1, 5)
#define WG_REGS_32 WG_T() "," WG_T(1) "," WG_T(2) "," WG_U(3, 0) "," WG_U(3, 1)
#define WG_REGS_96 WG_T() "," WG_T(1) "," WG_T(2) "," WG_T(3) "," WG_T(4) "," WG_T(5) "," WG_T(6) \
    "," WG_T(7) "," WG_T(8) "," WG_U(9, 0) "," WG_U(9, 1) "," WG_U(9, 2) "," WG_U(9, 3) "," WG_U(9, 4) \
    "," WG_U(9, 5)
#define WG_REGS_64 WG_T() "," WG_T(1) "," WG_T(2) "," WG_T(3) "," WG_T(4) "," WG_T(5) "," WG_U(6, 0) \
    "," WG_U(6, 1) "," WG_U(6, 2) "," WG_U(6, 3)
#define WG_REGS_128 WG_T() "," WG_T(1) "," WG_T(2) "," WG_T(3) "," WG_T(4) "," WG_T(5) "," WG_T(6) \
    "," WG_T(7) "," WG_T(8) "," WG_T(9) "," WG_T(10) "," WG_T(11) "," WG_U(12, 0) "," WG_U(12, 1) \
    "," WG_U(12, 2) "," WG_U(12, 3) "," WG_U(12, 4) "," WG_U(12, 5) "," WG_U(12, 6) "," WG_U(12, 7)
#define WG_F8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_F32(i) WG_F8(i), WG_F8(i + 8), WG_F8(i + 16), WG_F8(i + 24)
#define WG_OPS_16 WG_F8(0), WG_F8(8)
#define WG_OPS_32 WG_F32(0)
#define WG_OPS_96 WG_F32(0), WG_F32(32), WG_F32(64)
#define WG_OPS_64 WG_F32(0), WG_F32(32)
#define WG_OPS_128 WG_F32(0), WG_F32(32), WG_F32(64), WG_F32(96)

// One specialization per N (R accumulator registers, so the inputs are operands R, R + 1, ...):
// d[64 x N] (+)= A[64 x 16] * B[16 x N]. `ss` takes A and B as shared-memory descriptors, `rs`
// takes A as the 4 b32 registers of the m16n8k16 A fragment of this warp's 16 rows (the
// accumulator layout of a k16 column step, packed in pairs). `accumulate` = 0 ignores d's old values
// (the scale-d predicate), so no zeroing is needed. Immediates: scale-a = scale-b = 1; TRANS_A /
// TRANS_B = 0 for a K-major operand, 1 for an MN-major one (PTX: imm-trans-a / imm-trans-b).
template <int N>
struct Wgmma;

#define WGMMA_DEFINE(N, REGS, OPS, I0, I1, I2, I3, I4, I5, I6)                                          \
    template <>                                                                                       \
    struct Wgmma<N> {                                                                                 \
        template <int TRANS_A, int TRANS_B>                                                           \
        static __device__ __forceinline__ void ss(float (&d)[N / 2], u64 a, u64 b, int accumulate) {  \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %" #I2 ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16." WGMMA_TYPES " {" REGS         \
                         "}, %" #I0 ", %" #I1 ", p, 1, 1, %" #I3 ", %" #I4 "; }"                      \
                         : OPS                                                                        \
                         : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));              \
        }                                                                                             \
        template <int TRANS_B>                                                                        \
        static __device__ __forceinline__ void rs(float (&d)[N / 2], const u32 (&a)[4], u64 b,        \
                                                  int accumulate) {                                   \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %" #I5 ", 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16." WGMMA_TYPES " {" REGS         \
                         "}, {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4 ", p, 1, 1, %" #I6 "; }" \
                         : OPS                                                                        \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),      \
                           "n"(TRANS_B));                                                             \
        }                                                                                             \
    };

WGMMA_DEFINE(32, WG_REGS_16, WG_OPS_16, 16, 17, 18, 19, 20, 21, 22)
WGMMA_DEFINE(64, WG_REGS_32, WG_OPS_32, 32, 33, 34, 35, 36, 37, 38)
WGMMA_DEFINE(128, WG_REGS_64, WG_OPS_64, 64, 65, 66, 67, 68, 69, 70)
WGMMA_DEFINE(192, WG_REGS_96, WG_OPS_96, 96, 97, 98, 99, 100, 101, 102)
WGMMA_DEFINE(256, WG_REGS_128, WG_OPS_128, 128, 129, 130, 131, 132, 133, 134)

// The SS form: A and B from shared memory (descriptors `a`, `b`); K-major unless transposed.
template <int N, int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 a, u64 b, int accumulate) {
    Wgmma<N>::template ss<TRANS_A, TRANS_B>(d, a, b, accumulate);
}

// The RS form: A from registers (always K-major), B from shared memory; TRANS_B = 1 for MN-major B.
template <int N, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 b, int accumulate) {
    Wgmma<N>::template rs<TRANS_B>(d, a, b, accumulate);
}

// ---- Proxy fence, mbarriers, TMA ----------------------------------------------------------------

// Makes this thread's ordinary shared-memory stores visible to the async proxy (wgmma, TMA); put it
// before the barrier that precedes the wgmma or TMA that reads them.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Initializes the mbarrier at shared address `bar` to expect `count` arrivals a phase; one thread
// does this, then a __syncthreads() precedes any use.
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives on `bar` and adds `bytes` to the transaction count the current phase waits for (the bytes
// the TMA loads issued next will deliver).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// True once the phase of parity `parity` (0 for the first phase, then alternating) has completed.
__device__ __forceinline__ bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Arrives on `bar` (one of the `count` arrivals its phase waits for), with release semantics: the
// shared-memory reads this thread's warp finished before (e.g. waited wgmmas) are ordered before it.
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Spins until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    while (!mbarrier_try_wait(bar, parity)) {
    }
}

// The host's CUtensorMap (cuTensorMapEncodeTiled): opaque, 128 bytes, passed by value to a kernel as
// `const __grid_constant__ TmaMap` so that its address is one TMA can read.
struct __align__(64) TmaMap {
    u64 opaque[16];
};

// Loads the box at element coordinates (x = inner, y = outer) of the tensor `map` into shared
// memory at `dst` (128B swizzle: 1024-aligned), completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
        "%3}], [%4];" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// Loads the box at element coordinates (c0 innermost .. c3) of the rank-4 tensor `map` into shared
// memory at `dst`, completing `bar`'s transaction bytes (elements outside the tensor arrive as 0).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
        "%3, %4, %5}], [%6];" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Adds the box at element coordinates (c0 innermost .. c3) of the rank-4 tensor `map` from shared
// memory at `src` (laid out as a TMA load of that box would write it) into global memory,
// asynchronously (elements outside the tensor are skipped); `bulk_commit` closes the reductions
// issued since into one bulk group.
__device__ __forceinline__ void tma_reduce_add_4d(const TmaMap* map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
            (u64)map),
        "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's bulk groups still read their shared memory
// (`bulk_wait_read`) or are still in flight at all (`bulk_wait`).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// `x`, hidden from the optimizer (it cannot hoist what is computed from it out of a loop): tile
// addresses made opaque get their descriptors built where used, one add a k step, instead of
// being kept for every k step and slot across a loop (tens of registers).
__device__ __forceinline__ u32 opaque(u32 x) {
    asm volatile("" : "+r"(x));
    return x;
}

// ---- Warp specialization -------------------------------------------------------------------------

// Moves this warpgroup's register budget to N a thread (a multiple of 8 in 24..256); every warp of
// the warpgroup executes it. Honoured only under `__launch_bounds__(threads, 1)`.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (counted by warps):
// `bar_sync` waits, `bar_arrive` signals without waiting (a hand-off between warpgroups). The
// non-aligned forms, so a warp whose other lanes have exited (the producer's one thread) may call them.
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
