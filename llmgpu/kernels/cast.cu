// cast.cu: element-wise dtype conversion fp32 <-> bf16 <-> fp16 (chapter 5).
//
// Casting the fp32 master weights to the bf16 working copy (and activations or gradients between
// precisions) is pure data movement: 4 + 2 bytes per element. The kernel goes through float:
// 16-bit -> float is exact, float -> 16-bit rounds to nearest-even (__float2bfloat16_rn,
// __float2half_rn), so fp16 values beyond 65504 (+ half an ulp) become inf, as NumPy's astype does.
// Vector path: 4 elements per access (16 bytes of fp32, 8 of a 16-bit type), two groups per thread
// and iteration; the host enables it only when both pointers are aligned to 4 elements.
#include "common.cuh"

// llmgpu:kernel cast_kernel<{float,__half,__nv_bfloat16}, {float,__half,__nv_bfloat16}>

#if defined(__HIP_PLATFORM_AMD__)
#define LDCS(p) (*(p))
#define STCS(p, x) (*(p) = (x))
#else
#define LDCS(p) __ldcs(p)
#define STCS(p, x) __stcs((p), (x))
#endif

__device__ __forceinline__ void load4(const float* p, float o[4]) {
    float4 a = LDCS(reinterpret_cast<const float4*>(p));
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
__device__ __forceinline__ void store4(float* p, const float o[4]) {
    STCS(reinterpret_cast<float4*>(p), make_float4(o[0], o[1], o[2], o[3]));
}
template <typename T>
__device__ __forceinline__ void load4(const T* p, float o[4]) {
    uint2 raw = LDCS(reinterpret_cast<const uint2*>(p));
    T h[4];
    *reinterpret_cast<uint2*>(h) = raw;
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = to_float(h[k]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float o[4]) {
    T h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = from_float<T>(o[k]);
    STCS(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(h));
}

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(256) cast_kernel(const Tin* __restrict__ x, Tout* __restrict__ y, long long n,
                                                   int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const long long n4 = vec ? n / 4 : 0;
    for (long long i0 = tid; i0 < n4; i0 += 2 * nthreads) {
        const long long i1 = i0 + nthreads;
        float a[4], b[4];
        load4(x + 4 * i0, a);
        if (i1 < n4) load4(x + 4 * i1, b);
        store4(y + 4 * i0, a);
        if (i1 < n4) store4(y + 4 * i1, b);
    }
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) y[i] = from_float<Tout>(to_float(x[i]));
}
