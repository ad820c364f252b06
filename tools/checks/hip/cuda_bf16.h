// HIP stand-in for <cuda_bf16.h> (tools/checks/hip_compile_check.py).
//
// ROCm 5.2, Debian's HIP, has only `hip_bfloat16` (hip/hip_bfloat16.h), not CUDA's __nv_bfloat16 API
// (ROCm 6 has it as __hip_bfloat16 in hip/hip_bf16.h). This is the part of that API our kernels use, in
// plain C++: bf16 is the top 16 bits of an fp32; conversion rounds to nearest, ties to even, NaN stays NaN.
#pragma once
#include <hip/hip_runtime.h>

struct __nv_bfloat16 {
    unsigned short x;
    __nv_bfloat16() = default;
    __host__ __device__ __nv_bfloat16(float f);
    __host__ __device__ operator float() const;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

__host__ __device__ inline float __bfloat162float(__nv_bfloat16 b) {
    return __uint_as_float(static_cast<unsigned>(b.x) << 16);
}
__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = static_cast<unsigned short>((u >> 16) | 0x40u);  // NaN: keep it a (quiet) NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
        b.x = static_cast<unsigned short>(u >> 16);
    }
    return b;
}
__host__ __device__ inline __nv_bfloat16::__nv_bfloat16(float f) : x(__float2bfloat16_rn(f).x) {}
__host__ __device__ inline __nv_bfloat16::operator float() const { return __bfloat162float(*this); }
__host__ __device__ inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
