// fp8_cast_transpose_regs.cu: the FP8 step's transposing casts (delayed scaling: one pass) with the transpose done in
// registers instead of through a shared-memory tile (issue 37), checked and timed against llmgpu/kernels/fp8.cu's
// shared-tile fp8_cast_transpose_kernel by fp8_cast_transpose_regs.py.
//
// Each thread owns an 8 x 8 block of x: eight 16-byte loads (one per row, all issued before any is used), the cast
// of its 64 values, eight 8-byte stores of y, a byte transpose of the 8 x 8 bytes in registers (__byte_perm), and
// eight 8-byte stores of y^T. A warp's lanes are 4 row groups x 8 column groups, so a warp covers 32 rows x 64
// columns: each load instruction reads four whole 128-byte lines, each y store two whole 32-byte sectors per row,
// each y^T store (4 lanes, 32 consecutive rows of one column) one whole sector. No shared tile, no barrier before
// the stores; only the amax and the column sums (a bias gradient's tile share) reduce across the block at the end.
// The block's 8 warps stack in rows: a block tile is 256 rows x 64 columns (fp8_column_sums_kernel adds the
// blocks' partial sums in blockIdx.x order, as it does the package's 64-row tiles).
//
// The hypothesis, as written before a GPU ran it: the package's cast keeps four 8-byte loads in flight per thread
// and moves the bytes twice through shared memory byte by byte; on an H100 at d36 its three step casts run at
// 58-66 % of the copy rate (chapter 5b's profile). Sixteen times the bytes in flight per thread and no shared tile
// should reach 80-90 %, saving 4-6 ms of the d36 FP8 step's ~141 ms on an H100.
// Same bytes and amax as the package's (fp8.cu's rounding, NaN and amax helpers); the column sums add the same
// values in another fixed order.
#include "fp8.cu"

// llmgpu:kernel fp8_cast_transpose_regs<__nv_bfloat16, {__NV_E4M3,__NV_E5M2}, {0,1,2}, {0,1}, 2>
// llmgpu:kernel fp8_cast_transpose_regs<__nv_bfloat16, {__NV_E4M3,__NV_E5M2}, {1,2}, {0,1}, 3>

#define REGS_ROWS 256  // a block tile's rows: 8 warps x 32
#define REGS_COLS 64   // its columns: 8 lane groups x 8

// transpose4x4_bytes is fp8.cu's: the package's fp8_cast_transpose_8x8_kernel took this experiment's transpose
// (this file keeps the MIN_BLOCKS sweep that chose its launch bounds).

// x [R, C] bf16 -> y [R, C], yt [C, R] (either may be nullptr), amax, scale_inv and (SUMS) partial column sums
// part[blockIdx.x * C + col], of ACT's value (pre [R, C] for FP8_ACT_DGELU, bias [C] optional with an ACT): the
// package kernel's contract with R % 8 == 0, C % 8 == 0 and x, pre 16-byte aligned, y, yt 8-byte aligned (the
// script checks). Grid (ceil(R / 256), ceil(C / 64)), 256 threads. MIN_BLOCKS: resident blocks per SM asked of
// ptxas (2: at most 128 registers; without a bound it gives the plain cast 185; 3 spills there).
template <typename T, __nv_fp8_interpretation_t FMT, int ACT, int SUMS, int MIN_BLOCKS>
__global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS)
fp8_cast_transpose_regs(const T* __restrict__ x, const T* __restrict__ pre, const T* __restrict__ bias,
                        unsigned char* __restrict__ y, unsigned char* __restrict__ yt, long long R, long long C,
                        const float* __restrict__ scale, float* __restrict__ scale_inv, float* __restrict__ amax,
                        float* __restrict__ part) {
    static_assert(sizeof(T) == 2, "16-bit x: one 16-byte load is a thread's 8 columns of a row");
    __shared__ float warp_sums[SUMS ? FP8_THREADS / 32 : 1][REGS_COLS];
    const float s = *scale;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cg = lane & 7, rg = lane >> 3;
    const long long row = (long long)blockIdx.x * REGS_ROWS + warp * 32 + rg * 8;
    const long long col = (long long)blockIdx.y * REGS_COLS + cg * 8;
    const bool inside = row < R && col < C;  // R % 8 == 0, C % 8 == 0: a thread's block is wholly in or out
    unsigned m = 0;
    float csum[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) csum[k] = 0.0f;
    if (inside) {
        uint4 raw[8], raw_pre[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            raw[i] = *reinterpret_cast<const uint4*>(x + (row + i) * C + col);
            if constexpr (ACT == FP8_ACT_DGELU) raw_pre[i] = *reinterpret_cast<const uint4*>(pre + (row + i) * C + col);
        }
        float b[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) b[k] = act_bias<ACT>(bias, col + k);
        unsigned lo[8], hi[8];  // row i's bytes of columns 0..3 and 4..7
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v[8], p[8];
            unpack2<T>(raw[i].x, v[0], v[1]);
            unpack2<T>(raw[i].y, v[2], v[3]);
            unpack2<T>(raw[i].z, v[4], v[5]);
            unpack2<T>(raw[i].w, v[6], v[7]);
            if constexpr (ACT == FP8_ACT_DGELU) {
                unpack2<T>(raw_pre[i].x, p[0], p[1]);
                unpack2<T>(raw_pre[i].y, p[2], p[3]);
                unpack2<T>(raw_pre[i].z, p[4], p[5]);
                unpack2<T>(raw_pre[i].w, p[6], p[7]);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                v[k] = act_value<ACT>(v[k], ACT == FP8_ACT_DGELU ? p[k] : 0.0f, b[k]);
                m = max(m, abs_bits(v[k]));
                if constexpr (SUMS) csum[k] += v[k];
            }
            const float v0[4] = {v[0], v[1], v[2], v[3]}, v1[4] = {v[4], v[5], v[6], v[7]};
            lo[i] = to_fp8x4<FMT>(v0, s);
            hi[i] = to_fp8x4<FMT>(v1, s);
            if (y) *reinterpret_cast<uint2*>(y + (row + i) * C + col) = make_uint2(lo[i], hi[i]);
        }
        if (yt) {
            // four 4 x 4 transposes: afterwards a[k] / c[k] hold column k's rows 0..3 / 4..7, d[k] / e[k]
            // column 4 + k's (k < 4)
            unsigned a[4] = {lo[0], lo[1], lo[2], lo[3]}, c[4] = {lo[4], lo[5], lo[6], lo[7]};
            unsigned d[4] = {hi[0], hi[1], hi[2], hi[3]}, e[4] = {hi[4], hi[5], hi[6], hi[7]};
            transpose4x4_bytes(a[0], a[1], a[2], a[3]);  // rows 0-3, columns 0-3
            transpose4x4_bytes(c[0], c[1], c[2], c[3]);  // rows 4-7, columns 0-3
            transpose4x4_bytes(d[0], d[1], d[2], d[3]);  // rows 0-3, columns 4-7
            transpose4x4_bytes(e[0], e[1], e[2], e[3]);  // rows 4-7, columns 4-7
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                *reinterpret_cast<uint2*>(yt + (col + k) * R + row) = make_uint2(a[k], c[k]);
                *reinterpret_cast<uint2*>(yt + (col + 4 + k) * R + row) = make_uint2(d[k], e[k]);
            }
        }
    }
    if constexpr (SUMS) {
        if (part) {
            // the 4 row groups of a column group (lanes cg, cg + 8, cg + 16, cg + 24), then the 8 warps in order
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                csum[k] += __shfl_xor_sync(0xffffffffu, csum[k], 8);
                csum[k] += __shfl_xor_sync(0xffffffffu, csum[k], 16);
            }
            if (rg == 0) {
#pragma unroll
                for (int k = 0; k < 8; ++k) warp_sums[warp][cg * 8 + k] = csum[k];
            }
            __syncthreads();
            const long long c = (long long)blockIdx.y * REGS_COLS + threadIdx.x;
            if (threadIdx.x < REGS_COLS && c < C) {
                float t = 0.0f;
#pragma unroll
                for (int w = 0; w < FP8_THREADS / 32; ++w) t += warp_sums[w][threadIdx.x];
                part[(long long)blockIdx.x * C + c] = t;
            }
        }
    }
    if (amax) block_amax_to(m, amax);
}
