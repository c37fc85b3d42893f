// Tensor-core and async-copy building blocks (sm_80+): cp.async with zero fill, ldmatrix, and
// mma.sync m16n8k16 with f32 accumulation. Operands follow the PTX fragment layouts: in a warp,
// lane = 4 * g + t holds rows g and g + 8 and columns 2t, 2t + 1 (+ 8) of each 16-wide fragment.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Copies 16 bytes from global to shared memory, or writes 16 zero bytes when `valid` is false
// (the source is then not read).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

#if defined(ELEM_BF16)
#define MMA_TYPES "f32.bf16.bf16.f32"
#else
#define MMA_TYPES "f32.f16.f16.f32"
#endif

// c += a * b for one 16x8x16 tile: a is 16x16 (row-major fragment), b is 16x8 (column fragment).
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col." MMA_TYPES
                 " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Loads a ROWS x COLS tile of 16-bit elements (row stride `stride` elements in global memory) into
// shared memory at byte address `dst` with row pitch PITCH elements, by 16-byte chunks spread over
// NT threads. Rows at or past `rows` and columns at or past `cols` (a multiple of 8) are zero-filled.
// When NT is a multiple of the chunks per row, each thread keeps one column and walks rows
// NT / (COLS / 8) apart, so its addresses advance by constants.
template <int ROWS, int COLS, int PITCH, int NT>
__device__ __forceinline__ void load_tile_async(u32 dst, const u16* src, i64 stride, int rows, int cols,
                                                int tid) {
    const int CPR = COLS / 8;  // chunks per row
    if constexpr (NT % CPR == 0) {
        const int STEP = NT / CPR;
        const int r0 = tid / CPR, col = (tid % CPR) * 8;
        const u16* g = src + r0 * stride + col;
        const u32 d = dst + (r0 * PITCH + col) * 2;
        const bool col_ok = col < cols;
#pragma unroll
        for (int r = 0; r < ROWS; r += STEP) {
            if (ROWS % STEP == 0 || r + r0 < ROWS) {
                const bool ok = col_ok && r + r0 < rows;
                cp_async_16(d + r * PITCH * 2, ok ? g : src, ok);
            }
            g += STEP * stride;
        }
    } else {
#pragma unroll
        for (int c0 = 0; c0 < ROWS * CPR; c0 += NT) {
            const int c = c0 + tid;
            if ((ROWS * CPR) % NT == 0 || c < ROWS * CPR) {
                const int r = c / CPR, col = (c - r * CPR) * 8;
                const bool ok = r < rows && col < cols;
                cp_async_16(dst + (r * PITCH + col) * 2, ok ? src + r * stride + col : src, ok);
            }
        }
    }
}
