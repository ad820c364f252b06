// gelu.cu: GELU, the tanh approximation GPT-2 uses (chapter 3).
//
//   u = sqrt(2/pi) * (x + 0.044715 x^3),  t = tanh(u)
//   y  = 0.5 x (1 + t)
//   dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//
// Elementwise and memory-bound: per element the forward moves 2 values, the backward 3 (x, dy in,
// dx out). What matters is how memory is touched:
//   gelu_*_naive  one thread per element, scalar loads (a grid as large as the array);
//   gelu_*        a grid-stride loop over 16-byte packs (W = 4 fp32, 8 fp16/bf16), a fixed grid of a
//                 few blocks per SM; VEC = 0 is the scalar fallback the host picks when a pointer is
//                 not 16-byte aligned. With VEC = 1 the last n % W elements (the tail) are done one
//                 per thread after the loop.
// No tanh at all: 0.5 (1 + tanh(u)) = sigmoid(2u), so y = x * s with s = 1 / (1 + exp(-2u)), and
// dy/dx = s + 2 x s (1 - s) u'. The tanh form computes 1 + t, which cancels for negative x and
// leaves y with a large *relative* error where GELU is tiny; the sigmoid form has no such
// subtraction. expf, not __expf: the accurate exponential costs a few instructions, and an fp32
// element still takes longer to load than to compute. At the extremes exp(-2u) = inf gives s = 0
// and y = -0, exp(-2u) = 0 gives s = 1.
//   gelu_*_fast   the same sigmoid form, rewritten for 16-bit storage, where that is no longer true
//                 (see the block comment above gelu_forward_fast).
#include "common.cuh"
#include "gelu.cuh"

// llmgpu:kernel gelu_forward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel gelu_backward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel gelu_forward<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel gelu_backward<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel gelu_forward_fast<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel gelu_backward_fast<{float,__half,__nv_bfloat16}, {0,1}>

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_CUBIC 0.044715f

__device__ __forceinline__ float sigmoid_2u(float x, float x2) {
    const float u = GELU_SQRT_2_OVER_PI * (x + GELU_CUBIC * x2 * x);
    return 1.0f / (1.0f + expf(-2.0f * u));
}

__device__ __forceinline__ float gelu_value(float x) {
    return x * sigmoid_2u(x, x * x);
}

// Non-finite input (all three kernel families, and the NumPy reference): NaN gives NaN; GELU(+inf) =
// +inf, GELU(-inf) = NaN (-inf * 0, as the tanh formula and PyTorch give), GELU'(+-inf) = NaN
// (inf * 0 in the second term). Finite x always gives a finite gradient: x^2 is clamped in u' so
// that |x| > ~1.8e19 (x^2 = inf) does not turn the saturated term 0 * u' into 0 * inf.
__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float s = sigmoid_2u(x, x2);
    const float du = GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_CUBIC * fminf(x2, 1e30f));
    return s + 2.0f * x * s * (1.0f - s) * du;
}

// One thread per element: the first version anyone writes.
template <typename T>
__global__ void gelu_forward_naive(const T* __restrict__ x, T* __restrict__ y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_float<T>(gelu_value(to_float(x[i])));
}

template <typename T>
__global__ void gelu_backward_naive(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                    long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dx[i] = from_float<T>(to_float(dy[i]) * gelu_grad(to_float(x[i])));
}

// Grid-stride over packs of W elements, then the tail (n % W elements, VEC only).
template <typename T, int VEC>
__global__ void __launch_bounds__(256) gelu_forward(const T* __restrict__ x, T* __restrict__ y, long long n) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const long long nvec = n / W;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long j = tid; j < nvec; j += stride) {
        float v[W];
        load_pack<T, W>(x + j * W, v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = gelu_value(v[k]);
        store_pack<T, W>(y + j * W, v);
    }
    const long long i = nvec * W + tid;  // W == 1: i >= n, nothing left
    if (i < n) y[i] = from_float<T>(gelu_value(to_float(x[i])));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) gelu_backward(const T* __restrict__ dy, const T* __restrict__ x,
                                                     T* __restrict__ dx, long long n) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const long long nvec = n / W;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long j = tid; j < nvec; j += stride) {
        float d[W], v[W];
        load_pack<T, W>(dy + j * W, d);
        load_pack<T, W>(x + j * W, v);
#pragma unroll
        for (int k = 0; k < W; ++k) d[k] *= gelu_grad(v[k]);
        store_pack<T, W>(dx + j * W, d);
    }
    const long long i = nvec * W + tid;
    if (i < n) dx[i] = from_float<T>(to_float(dy[i]) * gelu_grad(to_float(x[i])));
}

// ------------------------------------------------------------------------------------------ fast
//
// Why bf16 needs another kernel. A 16-byte pack carries 4 fp32 but 8 bf16 elements, so per byte
// moved the bf16 kernel does twice the arithmetic, and at full bandwidth an SM can issue only a few
// instructions per bf16 element. gelu_forward above spends more: expf (a range reduction around one
// MUFU.EX2) and the IEEE division with a branch to a slow path, and that branch (BSSY/BSYNC per
// element) keeps the scheduler from interleaving the elements of a pack, so a warp computes for a
// long time between two loads and fewer bytes are in flight. fp32 hides this (half the elements per
// byte); bf16 does not.
//
// The fast form (its math, accuracy and extremes: gelu.cuh, where its device functions live, shared
// with fp8.cu) does the same math in a few instructions per element, without branches.
// Shape: one pass, no grid-stride loop. Each thread takes UNROLL = 2 packs (32 bytes per input),
// issues all its loads before any arithmetic (more bytes in flight per thread), and the grid covers
// the array once: blocks that finish are replaced by the hardware, so the grid does not have to be
// sized to the number of resident blocks (a grid-stride grid of 8 blocks per SM runs in two waves
// as soon as registers allow fewer than 8 resident blocks). Pack k of a thread is
// block_base + threadIdx.x + k * 256: consecutive threads, consecutive 16-byte packs (coalesced).
// 16-bit storage converts two elements at a time (bf16 -> fp32 is a shift or a mask; fp32 -> bf16x2
// is one cvt.rn.bf16x2.f32).

#define GELU_FAST_UNROLL 2
#define GELU_FAST_THREADS 256

// Grid: ceil(n_packs / (256 * UNROLL)) blocks of 256 threads (at least 1). VEC = 0 (a pointer not
// 16-byte aligned): packs of one element. The n % W tail elements go to the first threads of the grid.
template <typename T, int VEC>
__global__ void __launch_bounds__(GELU_FAST_THREADS) gelu_forward_fast(const T* __restrict__ x, T* __restrict__ y,
                                                                       long long n) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = GELU_FAST_UNROLL;
    const long long nvec = n / W;
    const long long j0 = (long long)blockIdx.x * (GELU_FAST_THREADS * U) + threadIdx.x;
    float v[U][W];
#pragma unroll
    for (int k = 0; k < U; ++k) {  // all loads first: U * 16 bytes in flight per thread
        const long long j = j0 + k * GELU_FAST_THREADS;
        if (j < nvec) load_pack16<T, W>(x + j * W, v[k]);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * GELU_FAST_THREADS;
        if (j < nvec) {
#pragma unroll
            for (int i = 0; i < W; ++i) v[k][i] = gelu_fast_value(v[k][i]);
            store_pack16<T, W>(y + j * W, v[k]);
        }
    }
    const long long gtid = (long long)blockIdx.x * GELU_FAST_THREADS + threadIdx.x;
    const long long i = nvec * W + gtid;  // W == 1: i >= n, nothing left
    if (i < n) y[i] = from_float<T>(gelu_fast_value(to_float(x[i])));
}

// Same shape; two inputs, so 2 * U * 16 bytes in flight per thread.
template <typename T, int VEC>
__global__ void __launch_bounds__(GELU_FAST_THREADS) gelu_backward_fast(const T* __restrict__ dy,
                                                                        const T* __restrict__ x,
                                                                        T* __restrict__ dx, long long n) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = GELU_FAST_UNROLL;
    const long long nvec = n / W;
    const long long j0 = (long long)blockIdx.x * (GELU_FAST_THREADS * U) + threadIdx.x;
    float d[U][W], v[U][W];
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * GELU_FAST_THREADS;
        if (j < nvec) {
            load_pack16<T, W>(dy + j * W, d[k]);
            load_pack16<T, W>(x + j * W, v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * GELU_FAST_THREADS;
        if (j < nvec) {
#pragma unroll
            for (int i = 0; i < W; ++i) d[k][i] *= gelu_fast_grad(v[k][i]);
            store_pack16<T, W>(dx + j * W, d[k]);
        }
    }
    const long long gtid = (long long)blockIdx.x * GELU_FAST_THREADS + threadIdx.x;
    const long long i = nvec * W + gtid;
    if (i < n) dx[i] = from_float<T>(to_float(dy[i]) * gelu_fast_grad(to_float(x[i])));
}
