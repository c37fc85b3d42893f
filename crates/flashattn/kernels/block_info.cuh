// The forward kernels' parameters and where a block's rows and keys are: the parameter struct,
// one (batch, query head)'s sequence (varlen offsets, the GQA head map) and the block's first row.

// Pointers already point at each tensor's first element; strides are in elements. Mirrors
// `FlashParams` in src/cuda/params.rs field by field (8-byte fields first, then 4-byte ones).
struct FlashParams {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    const float* bias;
    const float* rel_bias;  // relative-position table [heads_q][2 rel_radius + 1]
    const float* alibi;  // one slope per (batch, query head)
    const int* cu_q;     // varlen: batch + 1 offsets into the packed rows, else null
    const int* cu_k;
    i64 q_batch, q_row, q_head;
    i64 k_batch, k_row, k_head;
    i64 v_batch, v_row, v_head;
    i64 o_batch, o_row, o_head;
    i64 bias_batch, bias_head, bias_row, bias_col;
    i64 lse_batch, lse_head;
    int batch, heads_q, group;  // group: query heads per key/value head
    int nq, nk;                 // lengths (varlen: the longest sequence's)
    int head_dim, head_dim_v;
    int window_left, window_right;  // clamped to 2^30 (= unbounded)
    int rel_radius;                 // L - 1 of the relative-position table
    int diag_given, diag;           // the call's diagonal (src/cuda/diagonal.rs), else nk - nq each
    float scale, scale_log2, softcap;
};

// One (batch, query head) of a launch: where its rows start and how many there are.
struct SeqInfo {
    int b, h, hk;
    int q_row0, k_row0, nq, nk;
    int diag;  // key position of query 0's diagonal (|i + diag| < 2^30 for every row i)
};

// Query head `h` of sequence `b`.
__device__ __forceinline__ SeqInfo seq_info_at(const FlashParams& p, int b, int h) {
    SeqInfo s;
    s.b = b;
    s.h = h;
    s.hk = s.h / p.group;
    if (p.cu_q != 0) {
        s.q_row0 = p.cu_q[s.b];
        s.k_row0 = p.cu_k[s.b];
        s.nq = p.cu_q[s.b + 1] - s.q_row0;
        s.nk = p.cu_k[s.b + 1] - s.k_row0;
    } else {
        s.q_row0 = 0;
        s.k_row0 = 0;
        s.nq = p.nq;
        s.nk = p.nk;
    }
    s.diag = p.diag_given ? p.diag : s.nk - s.nq;
    return s;
}

// The launch grid is (query blocks, query heads, batch): consecutive blocks share a head's K/V,
// which then stays in L2 while they run.
__device__ __forceinline__ SeqInfo seq_info(const FlashParams& p) { return seq_info_at(p, blockIdx.z, blockIdx.y); }

// The order of a persistent kernel's tiles of `rows` query rows, fixed for a launch: tiles come in
// sections of whole heads whose K and V together fit in `section_mb` MB (of L2); in a section, query
// blocks go heaviest first (under a causal mask the last rows see the most keys), each over the
// section's heads, so blocks that run together share K/V and the light ones fill the tail.
struct TileOrder {
    int rows, nblocks, section;  // query rows a tile, query blocks a head, heads a section
};

__device__ __forceinline__ TileOrder tile_order(const FlashParams& p, int rows, int section_mb) {
    const int heads = p.heads_q * p.batch;
    const i64 kv_bytes = (i64)p.nk * (p.head_dim + p.head_dim_v) * 2;  // one key/value head
    const i64 fit = ((i64)section_mb << 20) / (kv_bytes > 0 ? kv_bytes : 1);
    return {rows, (p.nq + rows - 1) / rows, (int)min((i64)heads, max((i64)1, fit) * p.group)};
}

// Tile `tile` in order `o`: its sequence and first row.
__device__ __forceinline__ SeqInfo tile_info(const FlashParams& p, const TileOrder& o, int tile, int* i0) {
    const int heads = p.heads_q * p.batch;
    const int first = tile / (o.nblocks * o.section) * o.section;  // the section's first head
    const int in = tile - first * o.nblocks, width = min(o.section, heads - first);
    const int bh = first + in % width;
    *i0 = (o.nblocks - 1 - in / width) * o.rows;
    return seq_info_at(p, bh / p.heads_q, bh % p.heads_q);
}

// How many tiles of `rows` query rows a launch has (the host keeps it below 2^31).
__device__ __forceinline__ int tile_count(const FlashParams& p, int rows) {
    return (p.nq + rows - 1) / rows * p.heads_q * p.batch;
}

// The first query row of this block: heaviest query blocks first (under a causal mask the last
// rows see the most keys), so the light ones fill the tail of the grid.
__device__ __forceinline__ int block_row0(int rows) { return (gridDim.x - 1 - blockIdx.x) * rows; }

// Query row `i` of this (batch, head), and the first key and value rows of its key/value head.
__device__ __forceinline__ const elem_t* q_row(const FlashParams& p, const SeqInfo& s, int i) {
    return p.q + s.b * p.q_batch + (i64)(s.q_row0 + i) * p.q_row + s.h * p.q_head;
}
__device__ __forceinline__ const elem_t* k_rows(const FlashParams& p, const SeqInfo& s) {
    return p.k + s.b * p.k_batch + (i64)s.k_row0 * p.k_row + s.hk * p.k_head;
}
__device__ __forceinline__ const elem_t* v_rows(const FlashParams& p, const SeqInfo& s) {
    return p.v + s.b * p.v_batch + (i64)s.k_row0 * p.v_row + s.hk * p.v_head;
}

// Where query row `i` of this (batch, head) writes its output.
__device__ __forceinline__ elem_t* out_row(const FlashParams& p, const SeqInfo& s, int i) {
    return p.o + s.b * p.o_batch + (i64)(s.q_row0 + i) * p.o_row + s.h * p.o_head;
}

// Writes the log-sum-exp of query row `i` of this (batch, head).
__device__ __forceinline__ void store_lse(const FlashParams& p, const SeqInfo& s, int i, float lse) {
    p.lse[s.b * p.lse_batch + s.h * p.lse_head + s.q_row0 + i] = lse;
}
