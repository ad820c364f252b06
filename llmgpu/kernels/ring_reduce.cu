// ring_reduce.cu: acc += incoming, the reduction step of our ring all-reduce (chapter 9).
//
// In the reduce-scatter half of a ring all-reduce every rank receives a chunk from its left
// neighbour and adds it into its own copy of that chunk; this kernel is that add. It is the
// simplest memory-bound kernel there is (read 2, write 1 element; one add each), so what matters
// is that it runs at copy bandwidth and that it is short: it runs on the compute stream while the
// communication stream already receives the next chunk (llmgpu/dist/ring.py).
//
// 16-bit types are added in fp32 and rounded once per step (round to nearest even), as NCCL does:
// a ring of N ranks rounds each element N-1 times, a tree or one big fp32 sum would round fewer
// times, so a 16-bit ring result can differ from the fp32 sum by about (N-1) half-ulps.
// Vector path: one 16-byte access per operand (4 fp32 or 8 bf16/fp16 elements) when the host says
// both pointers are 16-byte aligned (vec = 1); the incoming chunk is read once, with a streaming
// load; the scalar loop does the tail (and everything when vec = 0).
#include "common.cuh"

// llmgpu:kernel ring_reduce_add<{float,__half,__nv_bfloat16}>

template <typename T>
__global__ void __launch_bounds__(256) ring_reduce_add(T* __restrict__ acc, const T* __restrict__ incoming,
                                                       long long n, int vec) {
    constexpr int W = 16 / sizeof(T);
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const long long nv = vec ? n / W : 0;
    for (long long i = tid; i < nv; i += nthreads) {
        float a[W], b[W];
        load_pack16<T, W>(acc + W * i, a);
        const uint4 raw = load_stream(reinterpret_cast<const uint4*>(incoming + W * i));
        load_pack16<T, W>(reinterpret_cast<const T*>(&raw), b);
#pragma unroll
        for (int k = 0; k < W; ++k) a[k] += b[k];
        store_pack16<T, W>(acc + W * i, a);
    }
    for (long long i = W * nv + tid; i < n; i += nthreads) acc[i] = from_float<T>(to_float(acc[i]) + to_float(incoming[i]));
}
