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

// a / b for non-negative indices; `narrow` (the same for the whole grid: every index below 2^32) takes the
// 32-bit division, a few instructions against the 64-bit one's emulated loop.
__device__ __forceinline__ long long index_div(long long a, long long b, bool narrow) {
    return narrow ? (long long)((unsigned)a / (unsigned)b) : a / b;
}
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

// 16-byte pack <-> W floats without going through 16-bit registers: 16-bit types go two at a time
// through 32-bit words (element 2i is the low half of word i, little endian, as
// __floats2bfloat162_rn / __floats2half2_rn pack them); bf16 -> fp32 is a shift or a mask. The fast
// kernels (gelu.cu, cross_entropy.cu, layernorm.cu through pack_elem) use these where load_pack's
// per-element conversions cost instructions (or registers) they do not have.
template <typename T>
__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi);
template <>
__device__ __forceinline__ void unpack2<__nv_bfloat16>(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);  // bf16 is the top half of an fp32
    hi = __uint_as_float(w & 0xffff0000u);
}
template <>
__device__ __forceinline__ void unpack2<__half>(unsigned w, float& lo, float& hi) {
    __half2 h;
    memcpy(&h, &w, 4);
    const float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
}

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32 on sm_80+
    unsigned w;
    memcpy(&w, &h, 4);
    return w;
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    unsigned w;
    memcpy(&w, &h, 4);
    return w;
}

// W = 16 / sizeof(T) elements from a 16-byte-aligned p (W = 1: one element, any alignment).
template <typename T, int W>
__device__ __forceinline__ void load_pack16(const T* __restrict__ p, float (&v)[W]) {
    if constexpr (W == 1) {
        v[0] = to_float(*p);
    } else if constexpr (sizeof(T) == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    } else {
        const uint4 q = *reinterpret_cast<const uint4*>(p);
        unpack2<T>(q.x, v[0], v[1]);
        unpack2<T>(q.y, v[2], v[3]);
        unpack2<T>(q.z, v[4], v[5]);
        unpack2<T>(q.w, v[6], v[7]);
    }
}

template <typename T, int W>
__device__ __forceinline__ void store_pack16(T* __restrict__ p, const float (&v)[W]) {
    if constexpr (W == 1) {
        *p = from_float<T>(v[0]);
    } else if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        *reinterpret_cast<uint4*>(p) = make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]),
                                                  pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
    }
}

// ------------------------------------------------------------------ streaming (evict-first) accesses
//
// For bytes a kernel touches exactly once (optimizer state, casts, the rows of a bandwidth-bound
// pass): ld.global.cs / st.global.cs through __ldcs / __stcs, so they do not evict lines that other
// accesses reuse. HIP has neither; there they are plain loads and stores (the hint is only a hint).
// V is the access type (float4, uint4, uint2, ...): one instruction per call.
template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    return *p;
#else
    return __ldcs(p);
#endif
}

template <typename V>
__device__ __forceinline__ void store_stream(V* p, V x) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    *p = x;
#else
    __stcs(p, x);
#endif
}

// 4 consecutive elements in one streaming access (16 bytes of fp32, 8 of a 16-bit type), converted
// to / from float at the edge. p must be aligned to the access (4 elements).
__device__ __forceinline__ void load4_stream(const float* p, float o[4]) {
    float4 a = load_stream(reinterpret_cast<const float4*>(p));
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
__device__ __forceinline__ void store4_stream(float* p, const float o[4]) {
    store_stream(reinterpret_cast<float4*>(p), make_float4(o[0], o[1], o[2], o[3]));
}
template <typename T>  // 16-bit types: 4 x 2 bytes = one 8-byte access
__device__ __forceinline__ void load4_stream(const T* p, float o[4]) {
    uint2 raw = load_stream(reinterpret_cast<const uint2*>(p));
    T h[4];
    *reinterpret_cast<uint2*>(h) = raw;
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = to_float(h[k]);
}
template <typename T>
__device__ __forceinline__ void store4_stream(T* p, const float o[4]) {
    T h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = from_float<T>(o[k]);
    store_stream(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(h));
}

// One 16-byte pack from a 16-byte-aligned p with a streaming load, kept raw: 4 registers whatever T
// is (half the registers of holding 8 16-bit elements as fp32); pack_elem converts on use.
template <typename T>
__device__ __forceinline__ Packed<T, 16 / (int)sizeof(T)> load_raw16_stream(const T* p) {
    Packed<T, 16 / (int)sizeof(T)> r;
    *reinterpret_cast<uint4*>(&r) = load_stream(reinterpret_cast<const uint4*>(p));
    return r;
}

// Element k of a raw pack as fp32 (k a constant after unrolling). 16-bit types go through unpack2 on
// the 32-bit word that holds the pair: for bf16 a shift or a mask, where sm_90's cvt.f32.bf16 path
// first moves the 16-bit halves into registers of their own (registers the kernels holding raw
// packs are short of).
template <typename T, int W>
__device__ __forceinline__ float pack_elem(const Packed<T, W>& p, int k) {
    if constexpr (sizeof(T) == 2 && W % 2 == 0) {
        float lo, hi;
        unpack2<T>(reinterpret_cast<const unsigned*>(&p)[k >> 1], lo, hi);
        return (k & 1) ? hi : lo;
    } else {
        return to_float(p.v[k]);
    }
}

// 2^z with one MUFU.EX2 (ex2.approx.ftz.f32: ~2 ulp, denormal results flushed to zero), for the fast
// kernels whose arithmetic budget per element has no room for exp2f's range reduction.
// NVIDIA-only fast path (inline PTX); HIP builds (tools/checks/hip_compile_check.py) get the library exp2f.
__device__ __forceinline__ float fast_exp2(float z) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    return exp2f(z);
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(z));
    return r;
#endif
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
