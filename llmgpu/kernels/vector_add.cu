// vector_add.cu: the first kernel of the book, c = a + b.
//
// One thread per element would need a grid as large as the array; a grid-stride loop lets a fixed
// grid (a few blocks per SM) cover any n, and keeps each thread's loads independent so many are in
// flight at once. The arithmetic is one add per 12 bytes moved (fp32): this kernel measures memory
// bandwidth, nothing else, which is why the book compares it with a plain device-to-device copy.
#include "common.cuh"

// llmgpu:kernel vector_add<{float,__half,__nv_bfloat16}>

template <typename T>
__global__ void vector_add(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        c[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
    }
}
