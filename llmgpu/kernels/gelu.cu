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
// The fast form does the same math in a few instructions per element, without branches:
//   z = -2u log2(e) = x (A + B x^2)                 A = -2 sqrt(2/pi) log2(e), B = 0.044715 A
//   e = 2^z   (ex2.approx.ftz: one MUFU.EX2, ~2 ulp)
//   s = 1 / (1 + e)   (rcp.approx.ftz: one MUFU.RCP, ~1 ulp)   y = x s
// Accuracy: 2 + 1 ulp from the two MUFU ops, and the error of z (a few ulp of |z|) that any float32
// evaluation has: exp amplifies it by |z| ln 2 where GELU is tiny (x ~ -8: ~1e-5 relative; the same
// for expf). The tests check < 5e-6 relative on [-3, 3] against float64. Extremes, no NaN for
// finite x: x < ~-10: e = inf (or 1 + e > 2^126, whose rcp.approx.ftz flushes to 0), s = 0, y = -0;
// x > ~5: 1 + e rounds to 1 and s = 1 exactly (selected, not rcp(1), so y == x bit for bit: MUFU.RCP
// is only promised within 1 ulp). x = -inf gives NaN (-inf * 0), as the tanh formula does.
// Shape: one pass, no grid-stride loop. Each thread takes UNROLL = 2 packs (32 bytes per input),
// issues all its loads before any arithmetic (more bytes in flight per thread), and the grid covers
// the array once: blocks that finish are replaced by the hardware, so the grid does not have to be
// sized to the number of resident blocks (a grid-stride grid of 8 blocks per SM runs in two waves
// as soon as registers allow fewer than 8 resident blocks). Pack k of a thread is
// block_base + threadIdx.x + k * 256: consecutive threads, consecutive 16-byte packs (coalesced).
// 16-bit storage converts two elements at a time (bf16 -> fp32 is a shift or a mask; fp32 -> bf16x2
// is one cvt.rn.bf16x2.f32).

#define GELU_FAST_A -2.302208198144325f    // -2 sqrt(2/pi) / ln 2
#define GELU_FAST_B -0.1029432395800235f   // 0.044715 * GELU_FAST_A
#define GELU_FAST_C1 1.5957691216057308f   // 2u' = C1 + C2 x^2 = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)
#define GELU_FAST_C2 0.21406444881780076f
#define GELU_FAST_UNROLL 2
#define GELU_FAST_THREADS 256

__device__ __forceinline__ float gelu_rcp(float d) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    return __builtin_amdgcn_rcpf(d);  // v_rcp_f32, AMD's approximate reciprocal (HIP compile check)
#else
    float r;  // NVIDIA-only fast path (inline PTX)
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
#endif
}

// s = sigmoid(2u) = 1 / (1 + e), e = 2^z = exp(-2u).
__device__ __forceinline__ float gelu_fast_sigmoid(float x, float x2, float& e) {
    e = fast_exp2(x * fmaf(GELU_FAST_B, x2, GELU_FAST_A));
    const float d = 1.0f + e;
    return d == 1.0f ? 1.0f : gelu_rcp(d);  // no branch: a predicated MUFU.RCP in SASS
}

__device__ __forceinline__ float gelu_fast_value(float x) {
    float e;
    return x * gelu_fast_sigmoid(x, x * x, e);
}

// dy/dx = s + x 2u' s (1 - s) = s + (s x (1 - s)) 2u',  1 - s = e s  (no cancellation for x > 0,
// where 1 - s is tiny). Degenerate ends: e = inf gives s = 0 and e s = NaN, which fminf turns into 1;
// at either saturated end s x (1 - s) is exactly 0 for finite x (g = s: 0 or 1), and x^2 is clamped
// in 2u' so that 0 * 2u' stays 0 when x^2 overflows. For x = +-inf, s x (1 - s) is inf * 0 = NaN:
// g = NaN, as the other kernels and the reference give (gelu_grad). A NaN x gives NaN through s.
__device__ __forceinline__ float gelu_fast_grad(float x) {
    const float x2 = x * x;
    float e;
    const float s = gelu_fast_sigmoid(x, x2, e);
    const float one_minus_s = fminf(e * s, 1.0f);
    const float sxo = s * (x * one_minus_s);
    return fmaf(sxo, fmaf(GELU_FAST_C2, fminf(x2, 1e30f), GELU_FAST_C1), s);
}

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
