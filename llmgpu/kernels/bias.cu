// bias.cu: the bias of a linear layer, forward (y += b) and backward (db = sum of dy over rows).
//
// Both are memory-bound: one add per element moved. What decides their speed is how memory is
// touched, so both kernels
//   * give each thread W consecutive elements of a row and move them as one 16-byte access
//     (W = 4 for float, 8 for __half/__nv_bfloat16; the idea of llm.c's Packed128). W = 1 is the
//     scalar fallback the host picks when a row length is not a multiple of W or a pointer is not
//     16-byte aligned;
//   * let consecutive threads of a warp walk consecutive columns of a row, so a warp's loads are
//     one contiguous 512-byte span (coalesced);
//   * compute in float whatever the storage type.
//
// The bias gradient is a column sum of dy [rows, C]. Float atomics (atomicAdd per column) would be
// short to write, but their order, and so the rounding, changes from run to run. Here the order is
// fixed by the shapes alone, so db is bitwise identical run to run:
//   stage 1, bias_grad_partial: block (x: 32 threads over columns, y: 8 threads over rows) owns a
//            tile of 32*W columns and a chunk of rows; thread y sums rows y, y+8, y+16, ... of the
//            chunk in order, the 8 partial sums are added in shared memory in order y = 0..7, and
//            the block writes one row of an fp32 scratch `partial [chunks, C]`;
//   stage 2, bias_grad_final: sums `partial` over chunks (again 8 row-threads, then a fixed-order
//            add), optionally adds the existing gradient (accumulation), rounds once to the output.
#include "common.cuh"

// llmgpu:kernel bias_add<float, {1,4}>
// llmgpu:kernel bias_add<{__half,__nv_bfloat16}, {1,8}>
// llmgpu:kernel bias_grad_partial<float, {1,4}>
// llmgpu:kernel bias_grad_partial<{__half,__nv_bfloat16}, {1,8}>
// llmgpu:kernel bias_grad_final<{float,__half,__nv_bfloat16}>

// W consecutive elements moved as one access: 16 bytes when sizeof(T) * W == 16.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T, W>*>(p);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& v) {
    *reinterpret_cast<Pack<T, W>*>(p) = v;
}

// y[r, c] += b[c] in place, y [rows, C] row-major. A grid-stride loop over packs of W elements;
// with W > 1 the host guarantees C % W == 0 and 16-byte aligned y and b, so a pack never straddles
// two rows and its column c is a multiple of W.
template <typename T, int W>
__global__ void bias_add(T* __restrict__ y, const T* __restrict__ b, long long rows, int C) {
    const int packs_per_row = C / W;
    const long long n = rows * packs_per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int c = (int)(i % packs_per_row) * W;
        Pack<T, W> yv = load_pack<T, W>(y + i * W);
        const Pack<T, W> bv = load_pack<T, W>(b + c);
#pragma unroll
        for (int k = 0; k < W; ++k) yv.v[k] = from_float<T>(to_float(yv.v[k]) + to_float(bv.v[k]));
        store_pack<T, W>(y + i * W, yv);
    }
}

#define BIAS_ROW_THREADS 8  // blockDim.y of both bias_grad kernels (the host launches (32, BIAS_ROW_THREADS))

// Stage 1 of db = sum over rows of dy: partial[chunk, c] = sum of dy[r, c] over the chunk's rows.
// Block (32, 8); grid (ceil(C / (32 W)), chunks). Rows of chunk j: [j * rows_per_chunk, ...).
template <typename T, int W>
__global__ void __launch_bounds__(32 * BIAS_ROW_THREADS) bias_grad_partial(const T* __restrict__ dy,
                                                                           float* __restrict__ partial, long long rows,
                                                                           int C, long long rows_per_chunk) {
    constexpr int ROW_THREADS = BIAS_ROW_THREADS;
    constexpr int TILE = 32 * W;  // columns per block
    // sums[ty][k][tx] holds column c0 + tx * W + k of row-thread ty; +1 padding against bank conflicts
    __shared__ float sums[ROW_THREADS * W * 33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c0 = blockIdx.x * TILE;
    const int c = c0 + tx * W;  // first of this thread's W columns (C % W == 0 when W > 1)
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = min(rows, r0 + rows_per_chunk);

    float acc[W];
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = 0.0f;
    if (c < C) {
        long long r = r0 + ty;
        // Four rows per iteration: four independent 16-byte loads in flight per thread. The adds
        // still happen in row order, so unrolling does not change the result.
        for (; r + 3 * ROW_THREADS < r1; r += 4 * ROW_THREADS) {
            Pack<T, W> p[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) p[u] = load_pack<T, W>(dy + (r + u * ROW_THREADS) * C + c);
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int k = 0; k < W; ++k) acc[k] += to_float(p[u].v[k]);
        }
        for (; r < r1; r += ROW_THREADS) {
            const Pack<T, W> p = load_pack<T, W>(dy + r * C + c);
#pragma unroll
            for (int k = 0; k < W; ++k) acc[k] += to_float(p.v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < W; ++k) sums[(ty * W + k) * 33 + tx] = acc[k];
    __syncthreads();
    // The 256 threads now take one column each (tid -> column c0 + tid) and add the 8 row-thread
    // sums in the order 0..7: consecutive threads write consecutive floats of partial.
    const int tid = ty * 32 + tx;
    for (int col = tid; col < TILE; col += 32 * ROW_THREADS) {
        const int t = col / W, k = col % W;
        float s = 0.0f;
#pragma unroll
        for (int y = 0; y < ROW_THREADS; ++y) s += sums[(y * W + k) * 33 + t];
        if (c0 + col < C) partial[(long long)blockIdx.y * C + c0 + col] = s;
    }
}

// Stage 2: db[c] = sum over chunks of partial[chunk, c] (+ db[c] when accumulate), rounded once to
// the output type. Block (32, 8): 32 columns per block, 8 threads share the chunks of a column.
template <typename TO>
__global__ void __launch_bounds__(32 * BIAS_ROW_THREADS) bias_grad_final(const float* __restrict__ partial,
                                                                         TO* __restrict__ db, int chunks, int C,
                                                                         int accumulate) {
    __shared__ float sums[BIAS_ROW_THREADS][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * 32 + tx;
    float s = 0.0f;
    if (c < C) {
        for (int j = ty; j < chunks; j += BIAS_ROW_THREADS) s += partial[(long long)j * C + c];
    }
    sums[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < C) {
        float total = 0.0f;
#pragma unroll
        for (int y = 0; y < BIAS_ROW_THREADS; ++y) total += sums[y][tx];
        if (accumulate) total += to_float(db[c]);
        db[c] = from_float<TO>(total);
    }
}
