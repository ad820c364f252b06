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
// leaves y with a large *relative* error where GELU is tiny (measured on the H200: 5e-5 in fp32
// with a fast tanh); the sigmoid form has no such subtraction. expf, not __expf: the accurate
// exponential costs a few instructions, and an fp32 element still takes longer to load than to
// compute. At the extremes exp(-2u) = inf gives s = 0 and y = -0, exp(-2u) = 0 gives s = 1.
#include "common.cuh"

// llmgpu:kernel gelu_forward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel gelu_backward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel gelu_forward<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel gelu_backward<{float,__half,__nv_bfloat16}, {0,1}>

#define GELU_SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_CUBIC 0.044715f

template <typename T, int W>
struct alignas(sizeof(T) * W) GeluPack {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[W]) {
    const GeluPack<T, W> raw = *reinterpret_cast<const GeluPack<T, W>*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(raw.v[k]);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[W]) {
    GeluPack<T, W> raw;
#pragma unroll
    for (int k = 0; k < W; ++k) raw.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<GeluPack<T, W>*>(p) = raw;
}

__device__ __forceinline__ float sigmoid_2u(float x, float x2) {
    const float u = GELU_SQRT_2_OVER_PI * (x + GELU_CUBIC * x2 * x);
    return 1.0f / (1.0f + expf(-2.0f * u));
}

__device__ __forceinline__ float gelu_value(float x) {
    return x * sigmoid_2u(x, x * x);
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float s = sigmoid_2u(x, x2);
    const float du = GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_CUBIC * x2);
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
