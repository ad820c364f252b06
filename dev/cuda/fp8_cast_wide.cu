// fp8_cast_wide.cu: wider accesses for the two passes of a current-scaling FP8 cast (issue 37), to be checked and
// timed against llmgpu/kernels/fp8.cu by fp8_cast_wide.py.
//
// * fp8_amax_wide: the amax pass in 16-byte loads (8 elements of a 16-bit x), AMAX_UNROLL of them in flight per
//   thread, and plain (cached) loads where the package streams (ld.global.cs): the transposing cast that follows
//   reads the same tensor, and whatever of it L2 still holds it then reads from there.
// * fp8_cast_transpose_wide: the package's 64 x 64 tiled cast + transpose with groups of 8 elements (16-byte loads
//   of a 16-bit x, 8-byte stores of y and y^T) where R and C are multiples of 8.
// Same bytes and the same amax as the package's kernels: the rounding, NaN and amax helpers are fp8.cu's.
// The hypothesis, as written before a GPU ran it: the package's amax pass keeps one 8-byte load in flight per
// thread and runs at ~70 % of the copy rate; this one should reach ~90 %, and the pair amax + cast should be
// 15-25 % faster where the tensor fits in L2.
#include "fp8.cu"  // the package's rounding, NaN and amax helpers (abs_bits, to_fp8x4, block_amax_to), not restated

// llmgpu:kernel fp8_amax_wide<{float,__nv_bfloat16}>
// llmgpu:kernel fp8_cast_transpose_wide<{float,__nv_bfloat16}, {__NV_E4M3,__NV_E5M2}>

#define WIDE_VEC 8
#define AMAX_UNROLL 4

// amax of x[0, n): x 16-byte aligned (the script checks), a grid-stride loop over 16-byte packs, then the tail.
template <typename T>
__global__ void __launch_bounds__(FP8_THREADS) fp8_amax_wide(const T* __restrict__ x, long long n, float* amax) {
    constexpr int W = 16 / (int)sizeof(T);
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const long long npacks = n / W;
    unsigned m = 0;
    long long i = tid;
    for (; i + (AMAX_UNROLL - 1) * nthreads < npacks; i += AMAX_UNROLL * nthreads) {
        float v[AMAX_UNROLL][W];
#pragma unroll
        for (int u = 0; u < AMAX_UNROLL; ++u) load_pack16<T, W>(x + (i + u * nthreads) * W, v[u]);
#pragma unroll
        for (int u = 0; u < AMAX_UNROLL; ++u)
#pragma unroll
            for (int k = 0; k < W; ++k) m = max(m, abs_bits(v[u][k]));
    }
    for (; i < npacks; i += nthreads) {
        float v[W];
        load_pack16<T, W>(x + i * W, v);
#pragma unroll
        for (int k = 0; k < W; ++k) m = max(m, abs_bits(v[k]));
    }
    for (long long j = npacks * W + tid; j < n; j += nthreads) m = max(m, abs_bits(to_float(x[j])));
    block_amax_to(m, amax);
}

// x [R, C] -> y [R, C], yt [C, R] and amax; R and C multiples of 8, pointers aligned to 8 elements (the script
// checks). One block per 64 x 64 tile: each thread casts groups of 8 consecutive elements of a row, writes their
// bytes to y and to a shared tile (row pitch 65 bytes: the column gathers fall into different banks), and after the
// barrier gathers 8 consecutive rows of one column into one 8-byte store of yt.
template <typename T, __nv_fp8_interpretation_t FMT>
__global__ void __launch_bounds__(FP8_THREADS)
fp8_cast_transpose_wide(const T* __restrict__ x, unsigned char* __restrict__ y, unsigned char* __restrict__ yt,
                        long long R, long long C, const float* __restrict__ scale, float* __restrict__ amax) {
    constexpr int PITCH = FP8_TILE + 1, GROUPS = FP8_TILE / WIDE_VEC, ITERS = FP8_TILE * GROUPS / FP8_THREADS;
    __shared__ unsigned char tile[FP8_TILE * PITCH];
    const float s = *scale;
    const long long r0 = (long long)blockIdx.x * FP8_TILE, c0 = (long long)blockIdx.y * FP8_TILE;
    unsigned m = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int g = threadIdx.x + it * FP8_THREADS;
        const int r = g / GROUPS, c = (g % GROUPS) * WIDE_VEC;
        const long long row = r0 + r, col = c0 + c;
        if (row >= R || col >= C) continue;
        const long long i = row * C + col;
        float v[WIDE_VEC];
        load_pack<T, WIDE_VEC>(x + i, v);
#pragma unroll
        for (int k = 0; k < WIDE_VEC; ++k) m = max(m, abs_bits(v[k]));
        const float lo[4] = {v[0], v[1], v[2], v[3]}, hi[4] = {v[4], v[5], v[6], v[7]};
        const unsigned w0 = to_fp8x4<FMT>(lo, s), w1 = to_fp8x4<FMT>(hi, s);
        *reinterpret_cast<uint2*>(y + i) = make_uint2(w0, w1);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            tile[r * PITCH + c + k] = (unsigned char)(w0 >> (8 * k));
            tile[r * PITCH + c + 4 + k] = (unsigned char)(w1 >> (8 * k));
        }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int g = threadIdx.x + it * FP8_THREADS;
        const int c = g / GROUPS, r = (g % GROUPS) * WIDE_VEC;
        const long long col = c0 + c, row = r0 + r;
        if (row >= R || col >= C) continue;
        unsigned w[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < WIDE_VEC; ++k) w[k / 4] |= (unsigned)tile[(r + k) * PITCH + c] << (8 * (k % 4));
        *reinterpret_cast<uint2*>(yt + col * R + row) = make_uint2(w[0], w[1]);
    }
    block_amax_to(m, amax);
}
