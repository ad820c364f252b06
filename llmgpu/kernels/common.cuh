// common.cuh: small helpers shared by every llmgpu kernel.
//
// Kernels are templated on the storage type T (float, __half, __nv_bfloat16) and always do their
// arithmetic in float: the reductions in a layer's backward pass (sums over rows, over the batch)
// lose too much in 16-bit. load/store convert at the edges, so one kernel body serves all dtypes.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <math.h>; +inf spelled through its bit pattern.
#define LLMGPU_INF __int_as_float(0x7f800000)

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// W consecutive elements moved as one access (16 bytes when sizeof(T) * W == 16, as llm.c's
// Packed128; W = 1 is the scalar fallback for rows or pointers that are not 16-byte aligned).
template <typename T, int W>
struct alignas(sizeof(T) * W) Packed {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[W]) {
    const Packed<T, W> raw = *reinterpret_cast<const Packed<T, W>*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(raw.v[k]);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[W]) {
    Packed<T, W> raw;
#pragma unroll
    for (int k = 0; k < W; ++k) raw.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<Packed<T, W>*>(p) = raw;
}

// Butterfly reductions inside one warp: after the loop every lane holds the result.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the result.
// `scratch` must hold 32 floats of shared memory; the trailing barrier lets callers reuse it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : -LLMGPU_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}
