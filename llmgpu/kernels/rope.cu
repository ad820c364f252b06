// rope.cu: rotary position embedding (RoPE, Su et al., "RoFormer"), Hugging Face Llama's layout.
//
// Each row of x (one head of one token at position t) has D = 2 * half elements. Element i pairs with
// element i + half ("rotate_half", not neighbouring pairs), and the pair is rotated by the angle
// t * inv_freq_i, whose cosine and sine come from fp32 tables cos[t, i], sin[t, i] ([S, half], S >= T):
//
//   y[i]        = x[i] cos - x[i + half] sin
//   y[i + half] = x[i + half] cos + x[i] sin                    (INV = 0, the forward)
//
// The backward is the transpose of that rotation, a rotation by -angle: the same code with sin
// negated (INV = 1), so forward and backward round alike.
//
// Elementwise and memory-bound (the tables are small and stay in L2): per element x is read and y
// written once. One thread per pack of W elements of the first half and the matching pack of the
// second half (16 bytes each: W = 4 fp32, 8 fp16/bf16; VEC = 0 is the scalar fallback the host picks
// when half % W != 0 or a pointer is not 16-byte aligned). A pair is read and written by one thread,
// both loads before both stores, so y may be x itself (in place, what the model does to Q and K) and
// neither pointer is __restrict__. The tables are read as float4 (the host checks their alignment).
//
// Layout: ROWS = 0, x and y contiguous [rows, D]. ROWS = 1, head-rows of `heads` consecutive heads per
// token, tokens ld_x (ld_y) elements apart: row r at (r / heads) * ld + (r % heads) * D. That is how the
// fast Llama step rotates q's and k's heads in place inside its one fused q|k|v GEMM's output:
// x = qkv.reshape(B, T, H + 2 Hk, D)[:, :, :H + Hk], heads = H + Hk, ld = (H + 2 Hk) D, v untouched.
// With ROWS = 1 the host picks VEC = 1 only when ld_x and ld_y are multiples of W too.
//
// rope_rotate_heads (method "fast"): one thread per pack for HPT heads of one position at once. The heads
// of a token share its cos/sin row, so the table packs are loaded once for HPT heads instead of once per
// head, the index arithmetic is done once, and a thread has 2 * HPT 16-byte loads of x in flight instead of
// 2. The host takes it when HPT divides the heads that share a position (SmolLM's q|k: 20 and 12 heads).
#include "common.cuh"

// llmgpu:kernel rope_rotate<{float,__half,__nv_bfloat16}, {0,1}, {0,1}, {0,1}>
// llmgpu:kernel rope_rotate_heads<{float,__half,__nv_bfloat16}, {0,1}, {0,1}, {2,4}>

#define ROPE_THREADS 256

// W consecutive fp32 table entries (W = 1, or a multiple of 4 from a 16-byte-aligned p).
template <int W>
__device__ __forceinline__ void load_table(const float* __restrict__ p, float (&v)[W]) {
    if constexpr (W == 1) {
        v[0] = *p;
    } else {
#pragma unroll
        for (int q = 0; q < W / 4; ++q) {
            const float4 f = reinterpret_cast<const float4*>(p)[q];
            v[4 * q] = f.x;
            v[4 * q + 1] = f.y;
            v[4 * q + 2] = f.z;
            v[4 * q + 3] = f.w;
        }
    }
}

// x, y: [rows, 2 * half]; `inner` consecutive rows share a position and the positions cycle through T:
// t = (row / inner) % T. [..., T, D] (the book model's [B, H, T, D]) has inner = 1; the fast model's
// token-major [B, T, H, D] has inner = H. Grid: one thread per pack, ceil(rows * half / W / THREADS) blocks.
// heads, ld_x, ld_y: the ROWS = 1 layout (unused when ROWS = 0).
template <typename T, int VEC, int INV, int ROWS>
__global__ void __launch_bounds__(ROPE_THREADS) rope_rotate(const T* x, T* y, const float* __restrict__ cos_t,
                                                            const float* __restrict__ sin_t, long long rows,
                                                            int seq, int inner, int half, int heads,
                                                            long long ld_x, long long ld_y) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const long long packs_per_row = half / W;  // the host guarantees half % W == 0
    const long long i = (long long)blockIdx.x * ROPE_THREADS + threadIdx.x;
    const long long packs = rows * packs_per_row;
    if (i >= packs) return;
    const bool narrow = packs <= 0xffffffffLL;  // every index below fits 32 bits: cheaper divisions
    const long long row = index_div(i, packs_per_row, narrow);
    const int e = (int)(i - row * packs_per_row) * W;  // first element of the pack in the first half
    const long long group = index_div(row, inner, narrow);
    const int t = (int)(group - index_div(group, seq, narrow) * seq);  // group % seq
    long long lo_x = row * 2 * half + e, lo_y = lo_x;
    if constexpr (ROWS) {
        const long long token = heads == inner ? group : index_div(row, heads, narrow);
        const long long within = (row - token * heads) * 2 * half + e;
        lo_x = token * ld_x + within;
        lo_y = token * ld_y + within;
    }
    float a[W], b[W], c[W], s[W];
    load_pack<T, W>(x + lo_x, a);
    load_pack<T, W>(x + lo_x + half, b);
    load_table<W>(cos_t + (long long)t * half + e, c);
    load_table<W>(sin_t + (long long)t * half + e, s);
    float ya[W], yb[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
        const float sn = INV ? -s[k] : s[k];
        ya[k] = a[k] * c[k] - b[k] * sn;
        yb[k] = b[k] * c[k] + a[k] * sn;
    }
    store_pack<T, W>(y + lo_y, ya);
    store_pack<T, W>(y + lo_y + half, yb);
}

// HPT heads (rows row0 .. row0 + HPT - 1, which share position t: the host guarantees inner % HPT == 0, and with
// ROWS = 1 heads % HPT == 0, so they also share a token) per thread, 16-byte packs only (W = 16 / sizeof(T)).
// Every load of the thread goes out before its first store (in place: y may be x). The same arithmetic as
// rope_rotate. Grid: one thread per (group of HPT rows, pack), ceil(rows / HPT * half / W / THREADS) blocks.
template <typename T, int INV, int ROWS, int HPT>
__global__ void __launch_bounds__(ROPE_THREADS) rope_rotate_heads(const T* x, T* y, const float* __restrict__ cos_t,
                                                                  const float* __restrict__ sin_t, long long rows,
                                                                  int seq, int inner, int half, int heads,
                                                                  long long ld_x, long long ld_y) {
    constexpr int W = 16 / (int)sizeof(T);
    const long long packs_per_row = half / W;  // the host guarantees half % W == 0
    const long long i = (long long)blockIdx.x * ROPE_THREADS + threadIdx.x;
    const long long packs = rows / HPT * packs_per_row;
    if (i >= packs) return;
    const bool narrow = rows * packs_per_row <= 0xffffffffLL;  // every index below fits 32 bits
    const long long hg = index_div(i, packs_per_row, narrow);
    const int e = (int)(i - hg * packs_per_row) * W;
    const long long row0 = hg * HPT;
    const long long group = index_div(row0, inner, narrow);
    const int t = (int)(group - index_div(group, seq, narrow) * seq);  // group % seq
    long long lo_x = row0 * 2 * half + e, lo_y = lo_x;
    if constexpr (ROWS) {
        const long long token = heads == inner ? group : index_div(row0, heads, narrow);
        const long long within = (row0 - token * heads) * 2 * half + e;
        lo_x = token * ld_x + within;
        lo_y = token * ld_y + within;
    }
    float c[W], s[W];
    load_table<W>(cos_t + (long long)t * half + e, c);
    load_table<W>(sin_t + (long long)t * half + e, s);
    float a[HPT][W], b[HPT][W];
#pragma unroll
    for (int h = 0; h < HPT; ++h) {  // head h's row is 2 * half elements after head h - 1's
        load_pack<T, W>(x + lo_x + h * 2 * half, a[h]);
        load_pack<T, W>(x + lo_x + h * 2 * half + half, b[h]);
    }
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
        float ya[W], yb[W];
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float sn = INV ? -s[k] : s[k];
            ya[k] = a[h][k] * c[k] - b[h][k] * sn;
            yb[k] = b[h][k] * c[k] + a[h][k] * sn;
        }
        store_pack<T, W>(y + lo_y + h * 2 * half, ya);
        store_pack<T, W>(y + lo_y + h * 2 * half + half, yb);
    }
}
