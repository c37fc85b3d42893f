// Linear attention (issue 67) on CUDA cores. One primitive, run once for the forward and three
// more times for the backward: for rows r and sources s,
//     y_r = Σ_{s visible to r} (x_r · u_s) · w_s,
// visible meaning every source, or (causal) s < r + 1 + off. It is computed by chunks of LIN_CHUNK
// sources: each chunk's state Σ u_s·w_sᵀ (linear_chunk_states), their exclusive prefix over the
// chunks (linear_prefix), then per block of rows the prefix product x·P plus the masked product
// inside the one chunk the block's rows end in (linear_rows). The operands are prepared by
// linear_prepare (φ(q), φ(k), and v with a column of ones, so that w = [v, 1] gives the numerator
// and the denominator at once) and the results turned into outputs and gradients by linear_finish
// and linear_grad_prep; src/linear/cuda/mod.rs says which operands each pass takes.
//
// Pasted after `#define ELEM_*`, `#define LIN_CHUNK n` and types.cuh.

typedef double acc_t; // every sum: f32 ones miss the tests' bound where g·(v − out) cancels

#define LIN_TILE 32     // the k and column extent of a shared-memory tile
#define LIN_THREADS 256 // 8 warps; warp w owns rows w, w + 8, ...
#define MAP_NONE 0
#define MAP_ELU1 1
#define MAP_RELU 2

// φ(x): elu(x) + 1 or max(x, 0); MAP_NONE leaves x.
__device__ __forceinline__ acc_t feature(int map, acc_t x) {
    if (map == MAP_ELU1) return x > 0 ? x + 1 : exp(x);
    if (map == MAP_RELU) return x > 0 ? x : (acc_t)0;
    return x;
}

// φ'(x).
__device__ __forceinline__ acc_t feature_grad(int map, acc_t x) {
    if (map == MAP_ELU1) return x > 0 ? (acc_t)1 : exp(x);
    return x > 0 ? (acc_t)1 : (acc_t)0;
}

__device__ __forceinline__ acc_t load_elem(const elem_t* p, i64 i) { return (acc_t)to_f32(p[i]); }

// Element (b, i, h, c) of a strided [batch, n, heads, dim] tensor, from its vector index (b·n + i)·heads + h.
__device__ __forceinline__ i64 strided_at(const i64* stride, i64 vec, int n, int heads, int c) {
    const i64 h = vec % heads, rest = vec / heads;
    return (rest / n) * stride[0] + (rest % n) * stride[1] + h * stride[2] + c * stride[3];
}

// ---- operands in, results out ---------------------------------------------------------------

// Host mirror: `PrepParams` in src/linear/cuda/kernels.rs.
struct PrepParams {
    u64 src;        // elem_t [batch, n, heads, dim], any strides
    u64 dst;        // acc_t [batch, n, heads, ld], contiguous
    i64 stride[4];
    i64 vectors;    // batch · n · heads
    int n, heads, dim, ld; // ld = dim, or dim + 1 for a column of ones
    int map;
    int pad;
};

// dst = φ(src), with 1 in column `dim` when ld > dim. One thread an element, grid-stride.
extern "C" __global__ void linear_prepare(const PrepParams p) {
    const elem_t* src = (const elem_t*)p.src;
    acc_t* dst = (acc_t*)p.dst;
    const i64 total = p.vectors * p.ld;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 vec = e / p.ld;
        const int c = (int)(e - vec * p.ld);
        dst[e] = c < p.dim ? feature(p.map, load_elem(src, strided_at(p.stride, vec, p.n, p.heads, c)))
                           : (acc_t)1;
    }
}

#define FINISH_DIVIDE 0 // out = y[:dim] / (y[dim] + eps): the forward's output
#define FINISH_GRAD 1   // out = y · φ'(x): dq, dk
#define FINISH_COPY 2   // out = y: dv

// Host mirror: `FinishParams` in src/linear/cuda/kernels.rs.
struct FinishParams {
    u64 y;          // acc_t [vectors, ld]
    u64 x;          // elem_t strided input whose φ' FINISH_GRAD takes, else 0
    u64 out;        // elem_t [vectors, dim], contiguous
    i64 stride[4];  // x's strides
    i64 vectors;
    double eps;
    int n, heads, dim, ld;
    int mode, map;
};

extern "C" __global__ void linear_finish(const FinishParams p) {
    const acc_t* y = (const acc_t*)p.y;
    const elem_t* x = (const elem_t*)p.x;
    elem_t* out = (elem_t*)p.out;
    const i64 total = p.vectors * p.dim;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 vec = e / p.dim;
        const int c = (int)(e - vec * p.dim);
        acc_t r = y[vec * p.ld + c];
        if (p.mode == FINISH_DIVIDE) {
            r /= y[vec * p.ld + p.dim] + (acc_t)p.eps;
        } else if (p.mode == FINISH_GRAD) {
            r *= feature_grad(p.map, load_elem(x, strided_at(p.stride, vec, p.n, p.heads, c)));
        }
        out[e] = from_f32((float)r);
    }
}

// Host mirror: `GradParams` in src/linear/cuda/kernels.rs.
struct GradParams {
    u64 y;          // acc_t [vectors, dv + 1]: the forward's numerator and denominator − eps
    u64 dout;       // elem_t [batch, nq, heads, dv], any strides
    u64 gc;         // acc_t [vectors, dv + 1]: g = dout / den, then c = −g·out
    i64 stride[4];
    i64 vectors;
    double eps;
    int n, heads, dv;
    int pad;
};

// One warp a query vector: g_e = dout_e / den and c = −Σ_e g_e · num_e / den.
extern "C" __global__ void linear_grad_prep(const GradParams p) {
    const acc_t* y = (const acc_t*)p.y;
    const elem_t* dout = (const elem_t*)p.dout;
    acc_t* gc = (acc_t*)p.gc;
    const int lane = threadIdx.x % 32;
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    for (i64 vec = blockIdx.x * (i64)(blockDim.x / 32) + threadIdx.x / 32; vec < p.vectors;
         vec += warps) {
        const acc_t* row = y + vec * (p.dv + 1);
        const acc_t den = row[p.dv] + (acc_t)p.eps;
        acc_t c = 0;
        for (int e = lane; e < p.dv; e += 32) {
            const acc_t g = load_elem(dout, strided_at(p.stride, vec, p.n, p.heads, e)) / den;
            gc[vec * (p.dv + 1) + e] = g;
            c -= g * row[e] / den;
        }
        for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffff, c, o);
        if (lane == 0) gc[vec * (p.dv + 1) + p.dv] = c;
    }
}

// ---- the chunked scan -----------------------------------------------------------------------

// Host mirror: `ScanParams` in src/linear/cuda/kernels.rs. Operands are contiguous acc_t
// [batch, n, heads, ld] buffers; a (batch, kv head) group has `gr` row heads and `gs` source heads.
struct ScanParams {
    u64 x, u, w;        // rows' x [.., du]; sources' u [.., du] and w [.., dw]
    u64 y;              // rows' y [.., dw]
    u64 states;         // [groups, chunks + 1, du, dw]: chunk states, then their exclusive prefix
    i64 nr, ns;         // rows, sources
    i64 off;            // causal: row r sees sources s < r + 1 + off
    i64 first_block;    // causal: the chunk row block 0 ends in, floor(off / LIN_CHUNK)
    i64 row_blocks;
    i64 chunks;         // state slots: one a chunk (causal), else partial sums (see linear_chunk_states)
    i64 source_chunks;  // chunks of LIN_CHUNK sources, ceil(ns / LIN_CHUNK)
    int groups, hk, gr, gs, du, dw;
    int ldx, ldu, ldw, ldy;
    int causal;
    int reverse;        // rows and sources counted from their ends (the backward's key side)
};

// The vector of head t of group g's `per` heads at position i of n (counted from the end with `reverse`).
__device__ __forceinline__ i64 vec_of(const ScanParams& p, int g, int per, i64 n, i64 i, int t) {
    const int b = g / p.hk, kh = g - b * p.hk;
    const i64 at = p.reverse ? n - 1 - i : i;
    return ((i64)b * n + at) * ((i64)p.hk * per) + (i64)kh * per + t;
}

// Grid: chunks × groups × (du, dw) tiles of 32 × 32; thread (ty, tx) sums rows ty + 8k, column tx.
// Slot c sums the source chunks c, c + chunks, ... (just c when chunks = source_chunks), in order.
extern "C" __global__ void __launch_bounds__(LIN_THREADS) linear_chunk_states(const ScanParams p) {
    __shared__ acc_t us[LIN_TILE][LIN_TILE + 1];
    __shared__ acc_t ws[LIN_TILE][LIN_TILE + 1];
    const acc_t* U = (const acc_t*)p.u;
    const acc_t* W = (const acc_t*)p.w;
    const int tu = (p.du + LIN_TILE - 1) / LIN_TILE, tw = (p.dw + LIN_TILE - 1) / LIN_TILE;
    i64 id = blockIdx.x;
    const int tile = (int)(id % (tu * tw));
    id /= tu * tw;
    const i64 c = id % p.chunks;
    const int g = (int)(id / p.chunks);
    const int a0 = (tile / tw) * LIN_TILE, b0 = (tile % tw) * LIN_TILE;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    acc_t acc[LIN_TILE / 8] = {};
    for (i64 sc = c; sc < p.source_chunks; sc += p.chunks) {
        for (int t = 0; t < p.gs; ++t) {
            for (int s0 = 0; s0 < LIN_CHUNK; s0 += LIN_TILE) {
                for (int e = threadIdx.x; e < LIN_TILE * LIN_TILE; e += LIN_THREADS) {
                    const int sr = e / LIN_TILE, col = e % LIN_TILE;
                    const i64 s = sc * LIN_CHUNK + s0 + sr;
                    const i64 v = s < p.ns ? vec_of(p, g, p.gs, p.ns, s, t) : -1;
                    us[sr][col] = v >= 0 && a0 + col < p.du ? U[v * p.ldu + a0 + col] : (acc_t)0;
                    ws[sr][col] = v >= 0 && b0 + col < p.dw ? W[v * p.ldw + b0 + col] : (acc_t)0;
                }
                __syncthreads();
#pragma unroll 8
                for (int s = 0; s < LIN_TILE; ++s) {
                    const acc_t wv = ws[s][tx];
#pragma unroll
                    for (int k = 0; k < LIN_TILE / 8; ++k) acc[k] += us[s][ty + 8 * k] * wv;
                }
                __syncthreads();
            }
        }
    }
    acc_t* st = (acc_t*)p.states + ((i64)g * (p.chunks + 1) + c) * p.du * p.dw;
#pragma unroll
    for (int k = 0; k < LIN_TILE / 8; ++k) {
        const int a = a0 + ty + 8 * k, col = b0 + tx;
        if (a < p.du && col < p.dw) st[(i64)a * p.dw + col] = acc[k];
    }
}

// In place: chunk c's slot becomes Σ of the chunks before it; slot `chunks` the total.
extern "C" __global__ void linear_prefix(const ScanParams p) {
    const i64 per = (i64)p.du * p.dw;
    const i64 total = p.groups * per;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < total;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 g = e / per;
        acc_t* st = (acc_t*)p.states + g * (p.chunks + 1) * per + (e - g * per);
        acc_t run = 0;
        for (i64 c = 0; c < p.chunks; ++c) {
            const acc_t x = st[c * per];
            st[c * per] = run;
            run += x;
        }
        st[p.chunks * per] = run;
    }
}

#define LIN_RPT (LIN_CHUNK / 8)  // rows a thread
#define LIN_SPT (LIN_CHUNK / 32) // score columns a thread

// Block rb of LIN_CHUNK rows of row head t of group g. Causal: the rows that see sources
// [0, cC + 1 + p) for p < C, c = first_block + rb: the prefix P_c, plus the sources of chunk c
// up to the row's own (a lower-triangular mask); c < 0 sees nothing, c ≥ chunks everything.
// Otherwise rows [rb·C, rb·C + C) and the total. Grid: row_blocks × groups × gr.
extern "C" __global__ void __launch_bounds__(LIN_THREADS) linear_rows(const ScanParams p) {
    __shared__ acc_t xs[LIN_CHUNK][LIN_TILE + 1];  // rows × a k tile
    __shared__ acc_t us[LIN_CHUNK][LIN_TILE + 1];  // sources × a k tile, then × a column tile of w
    __shared__ acc_t ps[LIN_TILE][LIN_TILE + 1];   // the prefix's k tile × column tile
    __shared__ acc_t as[LIN_CHUNK][LIN_CHUNK + 1]; // masked scores x·u
    const acc_t* X = (const acc_t*)p.x;
    const acc_t* U = (const acc_t*)p.u;
    const acc_t* W = (const acc_t*)p.w;
    acc_t* Y = (acc_t*)p.y;
    i64 id = blockIdx.x;
    const i64 rb = id % p.row_blocks;
    id /= p.row_blocks;
    const int t = (int)(id % p.gr), g = (int)(id / p.gr);
    const i64 c = p.causal ? p.first_block + rb : p.chunks;
    const i64 r0 = p.causal ? c * LIN_CHUNK - p.off : rb * LIN_CHUNK;
    const i64 pc = c < 0 ? 0 : (c > p.chunks ? p.chunks : c);
    const bool intra = p.causal && c >= 0 && c < p.chunks;
    const acc_t* P = (const acc_t*)p.states + ((i64)g * (p.chunks + 1) + pc) * p.du * p.dw;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    // Row i of the block (and its vector, or −1 outside [0, nr)).
    auto row_vec = [&](int i) -> i64 {
        const i64 r = r0 + i;
        return r >= 0 && r < p.nr ? vec_of(p, g, p.gr, p.nr, r, t) : -1;
    };
    auto load_x = [&](int k0) {
        for (int e = threadIdx.x; e < LIN_CHUNK * LIN_TILE; e += LIN_THREADS) {
            const int i = e / LIN_TILE, col = e % LIN_TILE;
            const i64 v = row_vec(i);
            xs[i][col] = v >= 0 && k0 + col < p.du ? X[v * p.ldx + k0 + col] : (acc_t)0;
        }
    };
    // Source j of the chunk, head t2 (or −1 past ns), and a tile of its u or w.
    auto load_sources = [&](const acc_t* src, int ld, int width, int t2, int k0) {
        for (int e = threadIdx.x; e < LIN_CHUNK * LIN_TILE; e += LIN_THREADS) {
            const int j = e / LIN_TILE, col = e % LIN_TILE;
            const i64 s = c * LIN_CHUNK + j;
            const i64 v = s < p.ns ? vec_of(p, g, p.gs, p.ns, s, t2) : -1;
            us[j][col] = v >= 0 && k0 + col < width ? src[v * ld + k0 + col] : (acc_t)0;
        }
    };
    for (int t2 = 0; t2 < (intra ? p.gs : 1); ++t2) {
        if (intra) {
            acc_t sc[LIN_RPT][LIN_SPT] = {};
            for (int k0 = 0; k0 < p.du; k0 += LIN_TILE) {
                load_x(k0);
                load_sources(U, p.ldu, p.du, t2, k0);
                __syncthreads();
#pragma unroll 4
                for (int kk = 0; kk < LIN_TILE; ++kk) {
                    acc_t uv[LIN_SPT];
#pragma unroll
                    for (int j = 0; j < LIN_SPT; ++j) uv[j] = us[tx + 32 * j][kk];
#pragma unroll
                    for (int i = 0; i < LIN_RPT; ++i) {
                        const acc_t xv = xs[ty + 8 * i][kk];
#pragma unroll
                        for (int j = 0; j < LIN_SPT; ++j) sc[i][j] += xv * uv[j];
                    }
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < LIN_RPT; ++i)
#pragma unroll
                for (int j = 0; j < LIN_SPT; ++j)
                    as[ty + 8 * i][tx + 32 * j] = tx + 32 * j <= ty + 8 * i ? sc[i][j] : (acc_t)0;
        }
        for (int b0 = 0; b0 < p.dw; b0 += LIN_TILE) {
            acc_t acc[LIN_RPT] = {};
            if (t2 > 0) {
                // Later source heads of the group add to what the first wrote (same thread, same cells).
#pragma unroll
                for (int i = 0; i < LIN_RPT; ++i) {
                    const i64 v = row_vec(ty + 8 * i);
                    if (v >= 0 && b0 + tx < p.dw) acc[i] = Y[v * p.ldy + b0 + tx];
                }
            } else if (pc > 0) {
                for (int k0 = 0; k0 < p.du; k0 += LIN_TILE) {
                    load_x(k0);
                    for (int e = threadIdx.x; e < LIN_TILE * LIN_TILE; e += LIN_THREADS) {
                        const int kk = e / LIN_TILE, col = e % LIN_TILE;
                        ps[kk][col] = k0 + kk < p.du && b0 + col < p.dw
                                          ? P[(i64)(k0 + kk) * p.dw + b0 + col]
                                          : (acc_t)0;
                    }
                    __syncthreads();
#pragma unroll 8
                    for (int kk = 0; kk < LIN_TILE; ++kk) {
                        const acc_t pv = ps[kk][tx];
#pragma unroll
                        for (int i = 0; i < LIN_RPT; ++i) acc[i] += xs[ty + 8 * i][kk] * pv;
                    }
                    __syncthreads();
                }
            }
            if (intra) {
                load_sources(W, p.ldw, p.dw, t2, b0);
                __syncthreads();
#pragma unroll 8
                for (int j = 0; j < LIN_CHUNK; ++j) {
                    const acc_t wv = us[j][tx];
#pragma unroll
                    for (int i = 0; i < LIN_RPT; ++i) acc[i] += as[ty + 8 * i][j] * wv;
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < LIN_RPT; ++i) {
                const i64 v = row_vec(ty + 8 * i);
                if (v >= 0 && b0 + tx < p.dw) Y[v * p.ldy + b0 + tx] = acc[i];
            }
        }
        __syncthreads(); // the next source head rewrites `as`
    }
}
