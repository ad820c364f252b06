// matmul.cu: C = A @ B for row-major fp32 matrices, A [M, K], B [K, N], C [M, N].
//
// Three steps of the classic climb, each a kernel the introduction times against cuBLAS:
//   matmul_naive     one thread per output; every thread streams a row of A and a column of B from
//                    global memory, so each input element is read M or N times.
//   matmul_tiled     a block computes a TILE x TILE patch; the K loop walks tiles of A and B staged
//                    in shared memory, so each element is read from global memory K/TILE times less.
//   matmul_blocked   a BM x BN patch per 256-thread block and a TM x TN patch of outputs per thread:
//                    each shared-memory value loaded into a register feeds TN (or TM) multiply-adds
//                    instead of 1, which moves the kernel from shared-memory bound toward the FMA
//                    units (the idea behind every fast GEMM; cuBLAS adds tensor cores and pipelining).
//                    Two instantiations: 64 x 64 tiles with 4 x 4 per thread, 128 x 128 with 8 x 8.
// All three handle any M, N, K (bounds checks, zero padding of partial tiles).
#include "common.cuh"

// llmgpu:kernel matmul_naive
// llmgpu:kernel matmul_tiled<{16,32}>
// llmgpu:kernel matmul_blocked<64, 64, 16, 4, 4>
// llmgpu:kernel matmul_blocked<128, 128, 8, 8, 8>

__global__ void matmul_naive(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                             int M, int N, int K) {
    // x walks columns so that a warp's threads read consecutive B elements and write consecutive C.
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[(long long)row * K + k] * B[(long long)k * N + col];
    C[(long long)row * N + col] = acc;
}

template <int TILE>
__global__ void matmul_tiled(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                             int M, int N, int K) {
    // +1 column of padding: a warp reading a column of As would otherwise hit one bank 32 times.
    __shared__ float As[TILE][TILE + 1];
    __shared__ float Bs[TILE][TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Each thread stages one element of each tile; out-of-range elements are zeros, which
        // contribute nothing to the dot product, so no check is needed in the inner loop.
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(long long)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(long long)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();  // before the next iteration overwrites the tiles
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}

template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__(256) matmul_blocked(const float* __restrict__ A, const float* __restrict__ B,
                                                      float* __restrict__ C, int M, int N, int K) {
    // A is stored transposed in shared memory (As[k][m]) so the inner loop reads both tiles along
    // their contiguous axis. With 16 x 16 threads, thread (tx, ty) owns rows ty + 16 i and columns
    // tx + 16 j: strided ownership keeps a warp's shared-memory reads on distinct banks (or
    // broadcasts) and its global stores of C coalesced in runs of 16. The +4 padding spreads the
    // transposed stores of A over the banks.
    static_assert((BM / TM) * (BN / TN) == 256 && BM / TM == 16 && BN / TN == 16, "16 x 16 threads");
    static_assert((BM * BK) % 256 == 0 && (BN * BK) % 256 == 0, "tiles load evenly");
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[BK][BN + 4];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int l = 0; l < BM * BK / 256; ++l) {
            const int idx = threadIdx.x + l * 256;
            const int am = idx / BK, ak = idx % BK;  // consecutive threads walk k: contiguous in A
            const int gr = row0 + am, gk = k0 + ak;
            As[ak][am] = (gr < M && gk < K) ? A[(long long)gr * K + gk] : 0.0f;
        }
#pragma unroll
        for (int l = 0; l < BN * BK / 256; ++l) {
            const int idx = threadIdx.x + l * 256;
            const int bk = idx / BN, bn = idx % BN;  // consecutive threads walk n: contiguous in B
            const int gk = k0 + bk, gc = col0 + bn;
            Bs[bk][bn] = (gk < K && gc < N) ? B[(long long)gk * N + gc] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();  // before the next iteration overwrites the tiles
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int r = row0 + ty + 16 * i;
        if (r >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int c = col0 + tx + 16 * j;
            if (c < N) C[(long long)r * N + c] = acc[i][j];
        }
    }
}
