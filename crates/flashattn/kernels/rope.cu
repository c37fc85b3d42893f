// The fused layer's rotary embedding, in place in a packed [rows, cols] buffer (the projections,
// or their gradient): in each row the first `heads` heads (the q heads, then the k heads), pair p
// of a head (dims p and p + R/2, or 2p and 2p + 1 interleaved) turned by the angle
// t · inv_freq[p] for the row's position t, or by its negative (`inverse`: the transpose, for
// the gradient). The angle and its sine and cosine are taken in f64, as on the CPU.

struct RopeParams {
    u64 data;       // elem_t [rows, cols]
    u64 positions;  // int [rows]
    u64 inv_freq;   // double [dim / 2]
    i64 rows;
    int cols;
    int heads;
    int head_dim;
    int half;       // R / 2
    int interleaved;
    int inverse;
};

extern "C" __global__ void rope_rotate(const RopeParams p) {
    const i64 pairs = (i64)p.heads * p.half;
    const i64 total = p.rows * pairs;
    const int* pos = (const int*)p.positions;
    const double* freq = (const double*)p.inv_freq;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / pairs;
        const int rest = (int)(i - row * pairs);
        const int h = rest / p.half, j = rest - h * p.half;
        elem_t* head = (elem_t*)p.data + row * p.cols + (i64)h * p.head_dim;
        const int a = p.interleaved ? 2 * j : j;
        const int b = p.interleaved ? 2 * j + 1 : j + p.half;
        const double angle = (double)pos[row] * freq[j];
        const double c = cos(angle), s = p.inverse ? -sin(angle) : sin(angle);
        const double x = to_f32(head[a]), y = to_f32(head[b]);
        head[a] = from_f32((float)(x * c - y * s));
        head[b] = from_f32((float)(x * s + y * c));
    }
}
