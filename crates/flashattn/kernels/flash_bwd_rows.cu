// The backward's passes over query rows, before and after the key-block kernel: `flash_bwd_pre`
// computes D = rowsum(dO∘O) in f32 and zeroes the f32 dQ accumulator and the bias gradients (all
// are summed into); `flash_bwd_post` writes dq = scale · dQ in dq's dtype and strides;
// `flash_bwd_dbias_sum` (deterministic mode, a bias broadcast over query rows) sums the dQ pass's
// partial bias gradients over the query blocks, in order; `flash_bwd_drel_sum` (deterministic
// mode) sums its partial table gradients over batch and query blocks, in order.
// Grid: (query rows / ROWS_PER_BLOCK, query heads, batch); one warp per row.

#define ROW_THREADS 128
#define ROWS_PER_BLOCK (ROW_THREADS / 32)

// This thread's index in the whole grid, and the grid's thread count.
__device__ __forceinline__ i64 grid_thread() {
    const i64 block = ((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    return block * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ i64 grid_threads() {
    return (i64)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
}

extern "C" __global__ void __launch_bounds__(ROW_THREADS) flash_bwd_pre(const BwdParams bp) {
    const FlashParams& p = bp.f;
    for (i64 e = grid_thread(); e < bp.accum_len; e += grid_threads()) bp.dq_accum[e] = 0.f;
    for (i64 e = grid_thread(); e < bp.dbias_len; e += grid_threads()) bp.dbias[e] = 0.f;
    for (i64 e = grid_thread(); e < bp.drel_len; e += grid_threads()) bp.drel_bias[e] = 0.f;
    for (i64 e = grid_thread(); e < bp.drel_part_len; e += grid_threads()) bp.drel_part[e] = 0.f;
    const SeqInfo s = seq_info(p);
    const int i = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= s.nq) return;  // the whole warp
    const elem_t* o = out_row(p, s, i);
    const elem_t* g = dout_row(bp, s, i);
    float d = 0.f;
    for (int c = lane; c < p.head_dim_v; c += 32) d = fmaf(to_f32(o[c]), to_f32(g[c]), d);
    d = row_allreduce_sum<32>(d);
    if (lane == 0) bp.delta[lse_index(p, s, i)] = d;
}

extern "C" __global__ void __launch_bounds__(ROW_THREADS) flash_bwd_post(const BwdParams bp) {
    const FlashParams& p = bp.f;
    const SeqInfo s = seq_info(p);
    const int i = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= s.nq) return;
    const float* acc = accum_row(bp, s, i);
    elem_t* dq = dq_row(bp, s, i);
    for (int c = lane; c < p.head_dim; c += 32) dq[c] = from_f32(acc[c] * p.scale);
}

extern "C" __global__ void __launch_bounds__(ROW_THREADS) flash_bwd_dbias_sum(const BwdParams bp) {
    for (i64 e = grid_thread(); e < bp.dbias_len; e += grid_threads()) {
        const i64 j = e % bp.dbias_cols, rest = e / bp.dbias_cols;
        const i64 h = rest % bp.dbias_heads, b = rest / bp.dbias_heads;
        const float* part = bp.dq_accum + b * bp.part_batch + h * bp.part_head + j * bp.dbias_col;
        float sum = 0.f;
        for (i64 blk = 0; blk < bp.part_blocks; ++blk) sum += part[blk * bp.part_block];
        bp.dbias[e] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(ROW_THREADS) flash_bwd_drel_sum(const BwdParams bp) {
    const FlashParams& p = bp.f;
    const i64 width = 2 * p.rel_radius + 1;
    for (i64 e = grid_thread(); e < bp.drel_len; e += grid_threads()) {
        const i64 h = e / width, c = e - h * width;
        float sum = 0.f;
        for (int b = 0; b < p.batch; ++b) {
            const float* part = bp.drel_part + ((i64)b * p.heads_q + h) * bp.drel_blocks * width + c;
            for (i64 blk = 0; blk < bp.drel_blocks; ++blk) sum += part[blk * width];
        }
        bp.drel_bias[e] = sum;
    }
}
