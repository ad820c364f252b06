// cast.cu: element-wise dtype conversion fp32 <-> bf16 <-> fp16 (chapter 5).
//
// Casting the fp32 master weights to the bf16 working copy (and activations or gradients between
// precisions) is pure data movement: 4 + 2 bytes per element. The kernel goes through float:
// 16-bit -> float is exact, float -> 16-bit rounds to nearest-even (__float2bfloat16_rn,
// __float2half_rn), so fp16 values beyond 65504 (+ half an ulp) become inf, as NumPy's astype does.
// Vector path: 4 elements per access (16 bytes of fp32, 8 of a 16-bit type), two groups per thread
// and iteration, streaming (load4_stream / store4_stream, common.cuh: each byte is moved once); the
// host enables it only when both pointers are aligned to 4 elements.
#include "common.cuh"

// llmgpu:kernel cast_kernel<{float,__half,__nv_bfloat16}, {float,__half,__nv_bfloat16}>

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(256) cast_kernel(const Tin* __restrict__ x, Tout* __restrict__ y, long long n,
                                                   int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const long long n4 = vec ? n / 4 : 0;
    for (long long i0 = tid; i0 < n4; i0 += 2 * nthreads) {
        const long long i1 = i0 + nthreads;
        float a[4], b[4];
        load4_stream(x + 4 * i0, a);
        if (i1 < n4) load4_stream(x + 4 * i1, b);
        store4_stream(y + 4 * i0, a);
        if (i1 < n4) store4_stream(y + 4 * i1, b);
    }
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) y[i] = from_float<Tout>(to_float(x[i]));
}
