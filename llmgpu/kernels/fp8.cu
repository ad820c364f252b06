// fp8.cu: scaled casts to FP8 that also measure amax, and the scale update of delayed scaling (chapter 5, Hopper).
//
// An FP8 tensor is its bytes (the host keeps them as uint8 arrays: CuPy has no float8 dtype) plus one fp32
// scale: q = fp8(x * scale), x ~ q * scale_inv. Every kernel here reads the scale from device memory and
// writes amax = max |x| to device memory, so a training step that picks its scales on the GPU stays free of
// host synchronisation and capturable in a CUDA graph.
//
// * Rounding: x * scale in fp32 (one IEEE multiply), then one round-to-nearest-even to the format
//   (cvt.rn.satfinite on sm_89+, cuda_fp8.h's bit-exact emulation on sm_80).
// * Saturating: |x * scale| beyond the format's largest finite value (448 for E4M3, 57344 for E5M2) and
//   +-inf become +-that value (__NV_SATFINITE): an outlier costs precision, never an inf or NaN in the GEMM.
// * NaN in, NaN out: always the byte FP8_NAN_BITS (a NaN in both formats), whatever the input's payload or sign.
// * amax: max |x| over the input *before* scaling, as fp32. NaN propagates: one NaN input makes amax the
//   canonical quiet NaN (bits 0x7fc00000), so the scale update and the trainer's finiteness check see it.
//   The reduction works on the bit patterns of |x| as unsigned integers: for non-negative floats that order
//   is the numeric order, +inf (0x7f800000) sits above every finite value and the canonical NaN above +inf.
//   Each block reduces its part, then one atomicMax per block: max is order-independent, so the result is
//   deterministic (bit-identical run to run). The host zeroes amax first (or leaves it, to accumulate).
// * Transposed copy: cuBLASLt's FP8 GEMMs take only the "TN" layout, in row-major words out = a @ b^T with
//   both operands contiguous along K. The backward GEMMs need x^T, dy^T and W^T, so the tiled cast writes
//   y [R, C] and y^T [C, R] from one read of x (either output may be skipped).
// * The value cast (ACT, the amax pass and the transposing cast): x itself, GELU(x + b) (x holds the MLP's
//   product x W^T, b its bias: the forward casts GELU's output without writing it, or the biased pre-activation,
//   in bf16 first) or x * GELU'(pre + b) (x holds the gradient of GELU's output: the backward casts the
//   pre-activation's gradient without writing it first), computed in fp32 with gelu.cuh's fast form; b (one
//   per column, optional) is read from the bias vector.
// * Column sums (SUMS, the transposing cast): the per-tile column sums of the values cast, the bias gradient when
//   they are a layer's output gradient; fp8_column_sums_kernel adds the tiles' sums up in a fixed order, so the
//   bias gradient is deterministic and no separate pass reads the gradient for it.
// NVIDIA-only (cuda_fp8.h; tools/checks/hip_compile_check.py says why). Ideas from NVIDIA Transformer Engine
// (cast + transpose + amax in one pass; delayed scaling with an amax history) and Micikevicius et al. 2022,
// "FP8 Formats for Deep Learning" (the two formats, per-tensor scales).
#include "common.cuh"
#include "gelu.cuh"
#include "layernorm.cuh"
#include <cuda_fp8.h>

// llmgpu:kernel fp8_cast_kernel<{float,__half,__nv_bfloat16}, {__NV_E4M3,__NV_E5M2}>
// llmgpu:kernel fp8_cast_transpose_kernel<{float,__half,__nv_bfloat16}, {__NV_E4M3,__NV_E5M2}, {1,4}, 0, 0>
// llmgpu:kernel fp8_cast_transpose_kernel<{float,__nv_bfloat16}, {__NV_E4M3,__NV_E5M2}, {1,4}, {1,2}, 0>
// llmgpu:kernel fp8_cast_transpose_kernel<{float,__nv_bfloat16}, {__NV_E4M3,__NV_E5M2}, {1,4}, {0,1,2}, 1>
// llmgpu:kernel fp8_cast_transpose_8x8_kernel<__half, {__NV_E4M3,__NV_E5M2}, 0, 0>
// llmgpu:kernel fp8_cast_transpose_8x8_kernel<__nv_bfloat16, {__NV_E4M3,__NV_E5M2}, {0,1,2}, {0,1}>
// llmgpu:kernel fp8_amax_kernel<{float,__half,__nv_bfloat16}, 0>
// llmgpu:kernel fp8_amax_kernel<{float,__nv_bfloat16}, {1,2}>
// llmgpu:kernel fp8_transpose_kernel<{1,4}>
// llmgpu:kernel fp8_add_layernorm_kernel<{float,__nv_bfloat16}, {1,2,3,4,6,8}, __NV_E4M3>
// llmgpu:kernel fp8_column_sums_kernel
// llmgpu:kernel fp8_update_scale_kernel
// llmgpu:kernel fp8_update_scales_kernel

#define FP8_NAN_BITS 127         // 0x7f: NaN in E4M3 (S.1111.111) and in E5M2 (S.11111.11)
#define FP8_SCALE_EXP_LIMIT 126  // scales are clamped to [2^-126, 2^126], so 1/scale is a finite normal float
#define FP8_TILE 64              // the transposing cast's tile: 64 x 64 elements per block
#define FP8_TILE_PITCH 65        // its row pitch in shared memory (bytes): a warp's column gathers hit 32 banks
#define FP8_THREADS 256          // block size of every kernel here (the host reads it)
#define FP8_8X8_ROWS 256         // fp8_cast_transpose_8x8_kernel's block tile: 8 warps x 32 rows
#define FP8_8X8_COLS 64          //   x 8 lane groups x 8 columns
#define FP8_ACT_NONE 0           // ACT: the value cast is x
#define FP8_ACT_GELU 1           //      GELU(x + b)
#define FP8_ACT_DGELU 2          //      x * GELU'(pre + b)
#define FP8_STATE_WORDS 4        // fp8_update_scales_kernel: a state's scalars 16 bytes apart (cuBLASLt refuses
                                 // scale pointers off 16-byte boundaries: CUBLAS_STATUS_NOT_SUPPORTED)

constexpr unsigned FP8_QNAN_BITS = 0x7fc00000u;  // the canonical quiet NaN, what NaN inputs make amax

// |v| as ordered bits: the unsigned order of these is the numeric order of |v|, NaN on top.
__device__ __forceinline__ unsigned abs_bits(float v) {
    return v != v ? FP8_QNAN_BITS : (__float_as_uint(v) & 0x7fffffffu);
}

template <__nv_fp8_interpretation_t FMT>
__device__ __forceinline__ unsigned char to_fp8(float v, float scale) {
    const float s = v * scale;
    return s != s ? (unsigned char)FP8_NAN_BITS : (unsigned char)__nv_cvt_float_to_fp8(s, __NV_SATFINITE, FMT);
}

template <int ACT>
__device__ __forceinline__ float act_value(float x, float pre, float b) {
    if constexpr (ACT == FP8_ACT_GELU) return gelu_fast_value(x + b);
    else if constexpr (ACT == FP8_ACT_DGELU) return x * gelu_fast_grad(pre + b);
    else return x;
}

// ACT's second input and bias at element i of a row-major [*, C] tensor (0 where the kernel has none).
template <int ACT, typename T>
__device__ __forceinline__ float act_pre(const T* __restrict__ pre, long long i) {
    return ACT == FP8_ACT_DGELU ? to_float(pre[i]) : 0.0f;
}
template <int ACT, typename T>
__device__ __forceinline__ float act_bias(const T* __restrict__ bias, long long col) {
    return ACT != FP8_ACT_NONE && bias ? to_float(bias[col]) : 0.0f;
}

// Four elements to four bytes (element 0 in the low byte, as they lie in memory), two per conversion.
template <__nv_fp8_interpretation_t FMT>
__device__ __forceinline__ unsigned to_fp8x4(const float (&v)[4], float scale) {
    float s[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = v[k] * scale;
    unsigned w = (unsigned)__nv_cvt_float2_to_fp8x2(make_float2(s[0], s[1]), __NV_SATFINITE, FMT) |
                 ((unsigned)__nv_cvt_float2_to_fp8x2(make_float2(s[2], s[3]), __NV_SATFINITE, FMT) << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (s[k] != s[k]) w = (w & ~(0xffu << (8 * k))) | ((unsigned)FP8_NAN_BITS << (8 * k));
    return w;
}

// The block's max of `m` (bits of |x|), then one atomicMax into amax (skipped when there is nothing to raise).
__device__ __forceinline__ void block_amax_to(unsigned m, float* amax) {
    __shared__ unsigned warp_max_bits[32];
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x * blockDim.y) >> 5;
    if (lane == 0) warp_max_bits[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? warp_max_bits[lane] : 0u;
        for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
        if (lane == 0 && m) atomicMax(reinterpret_cast<unsigned*>(amax), m);
    }
}

// Flat cast: y[i] = fp8(x[i] * scale) for any shape; amax (optional: nullptr skips it) of |x|; thread 0 of
// block 0 writes scale_inv = 1 / scale (the dequantization factor the GEMM reads; optional too).
// vec: the host says x and y are aligned to 4 elements, so 4 elements move per access.
template <typename T, __nv_fp8_interpretation_t FMT>
__global__ void __launch_bounds__(FP8_THREADS)
fp8_cast_kernel(const T* __restrict__ x, unsigned char* __restrict__ y, long long n, const float* __restrict__ scale,
                float* __restrict__ scale_inv, float* __restrict__ amax, int vec) {
    const float s = *scale;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    if (tid == 0 && scale_inv) *scale_inv = 1.0f / s;
    unsigned m = 0;
    const long long n4 = vec ? n / 4 : 0;
    for (long long i = tid; i < n4; i += nthreads) {
        float v[4];
        load4_stream(x + 4 * i, v);
#pragma unroll
        for (int k = 0; k < 4; ++k) m = max(m, abs_bits(v[k]));
        store_stream(reinterpret_cast<unsigned*>(y) + i, to_fp8x4<FMT>(v, s));
    }
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) {
        const float v = to_float(x[i]);
        m = max(m, abs_bits(v));
        y[i] = to_fp8<FMT>(v, s);
    }
    if (amax) block_amax_to(m, amax);
}

// amax only (current scaling measures the tensor before it picks the scale that casts it), of ACT's value
// (pre: GELU's input for FP8_ACT_DGELU, else unused; bias [C]: optional, with an ACT; C: x's last axis).
// vec: x and pre aligned to 4 elements and, with a bias, C % 4 == 0 (a pack's 4 elements share a row).
template <typename T, int ACT>
__global__ void __launch_bounds__(FP8_THREADS)
fp8_amax_kernel(const T* __restrict__ x, const T* __restrict__ pre, const T* __restrict__ bias, long long n,
                long long C, float* __restrict__ amax, int vec) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    unsigned m = 0;
    const long long n4 = vec ? n / 4 : 0;
    for (long long i = tid; i < n4; i += nthreads) {
        float v[4], p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        load4_stream(x + 4 * i, v);
        if constexpr (ACT == FP8_ACT_DGELU) load4_stream(pre + 4 * i, p);
        const long long col = ACT != FP8_ACT_NONE && bias ? (4 * i) % C : 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) m = max(m, abs_bits(act_value<ACT>(v[k], p[k], act_bias<ACT>(bias, col + k))));
    }
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) {
        const long long col = ACT != FP8_ACT_NONE && bias ? i % C : 0;
        m = max(m, abs_bits(act_value<ACT>(to_float(x[i]), act_pre<ACT>(pre, i), act_bias<ACT>(bias, col))));
    }
    block_amax_to(m, amax);
}

// The second half of a transposing pass: a 64 x 64 tile of bytes in shared memory (row pitch FP8_TILE_PITCH, rows
// r0.., columns c0.. of an [R, C] tensor) stored as rows of yt [C, R]. Each thread gathers VEC consecutive *rows*
// of one column and writes them as one access of yt's row. The caller has put the tile and passed a barrier.
template <int VEC>
__device__ __forceinline__ void store_tile_transposed(const unsigned char* tile, unsigned char* __restrict__ yt,
                                                      long long r0, long long c0, long long R, long long C) {
    constexpr int GROUPS = FP8_TILE / VEC;
#pragma unroll 4
    for (int it = 0; it < FP8_TILE * GROUPS / FP8_THREADS; ++it) {
        const int g = threadIdx.x + it * FP8_THREADS;
        const int c = g / GROUPS, r = (g % GROUPS) * VEC;  // yt's row c (x's column), x's rows r .. r+VEC-1
        const long long col = c0 + c, row = r0 + r;
        if (row >= R || col >= C) continue;  // VEC = 4: R % 4 == 0
        if constexpr (VEC == 4) {
            unsigned w = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) w |= (unsigned)tile[(r + k) * FP8_TILE_PITCH + c] << (8 * k);
            *reinterpret_cast<unsigned*>(yt + col * R + row) = w;
        } else {
            yt[col * R + row] = tile[r * FP8_TILE_PITCH + c];
        }
    }
}

// Cast + transpose: x [R, C] row-major -> y [R, C] and yt [C, R] (either may be nullptr), amax, scale_inv, of
// ACT's value (pre [R, C]: GELU's input for FP8_ACT_DGELU, else unused; bias [C]: optional, with an ACT). One
// block per 64 x 64 tile (grid.x over row tiles, grid.y over column tiles), 256 threads. Each thread reads VEC
// consecutive elements of a row (coalesced), writes their bytes to y and to a shared tile; after the barrier it
// gathers VEC consecutive *rows* of one column from the tile and writes them as one access of yt's row. VEC = 4
// needs C % 4 == 0, R % 4 == 0 and x, pre, y, yt aligned to 4 elements (the host checks); VEC = 1 takes any
// shape. The tile's row pitch (FP8_TILE_PITCH, 65 bytes) puts the column gathers of a warp into different banks.
// SUMS = 1, colsum (optional): colsum[blockIdx.x * C + col] = the fp32 sum of the values cast in the tile's column
// col (its rows in a fixed order; the tile's share of a bias gradient): a thread's groups all sit in the same VEC
// columns, so each thread sums its rows, then one thread per column adds the SHARE threads' sums of its column in
// thread order. (A template argument: the sums cost a plain cast 8 registers, a quarter of its occupancy.)
template <typename T, __nv_fp8_interpretation_t FMT, int VEC, int ACT, int SUMS>
__global__ void __launch_bounds__(FP8_THREADS)
fp8_cast_transpose_kernel(const T* __restrict__ x, const T* __restrict__ pre, const T* __restrict__ bias,
                          unsigned char* __restrict__ y, unsigned char* __restrict__ yt, long long R, long long C,
                          const float* __restrict__ scale, float* __restrict__ scale_inv, float* __restrict__ amax,
                          float* __restrict__ colsum) {
    constexpr int GROUPS = FP8_TILE / VEC;                      // VEC-wide groups per tile row
    constexpr int ITERS = FP8_TILE * GROUPS / FP8_THREADS;      // groups per thread
    constexpr int SHARE = FP8_THREADS / GROUPS;                 // threads whose groups sit in the same columns
    static_assert(FP8_THREADS % GROUPS == 0, "a thread's groups must keep to the same columns");
    __shared__ unsigned char tile[FP8_TILE * FP8_TILE_PITCH];
    __shared__ float col_part[SUMS ? SHARE : 1][FP8_TILE];
    const float s = *scale;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / s;
    const long long r0 = (long long)blockIdx.x * FP8_TILE, c0 = (long long)blockIdx.y * FP8_TILE;
    unsigned m = 0;
    float csum[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) csum[k] = 0.0f;
#pragma unroll 4  // VEC = 1 has 16 iterations: unrolling them all costs ~110 registers
    for (int it = 0; it < ITERS; ++it) {
        const int g = threadIdx.x + it * FP8_THREADS;
        const int r = g / GROUPS, c = (g % GROUPS) * VEC;
        const long long row = r0 + r, col = c0 + c;
        if (row >= R || col >= C) continue;  // VEC = 4: C % 4 == 0, so a group is wholly in or out
        const long long i = row * C + col;
        unsigned char q[VEC];
        if constexpr (VEC == 4) {
            float v[4], p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            load_pack<T, 4>(x + i, v);
            if constexpr (ACT == FP8_ACT_DGELU) load_pack<T, 4>(pre + i, p);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[k] = act_value<ACT>(v[k], p[k], act_bias<ACT>(bias, col + k));
                m = max(m, abs_bits(v[k]));
                if constexpr (SUMS) csum[k] += v[k];
            }
            const unsigned w = to_fp8x4<FMT>(v, s);
            if (y) *reinterpret_cast<unsigned*>(y + i) = w;
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k] = (unsigned char)(w >> (8 * k));
        } else {
            const float v = act_value<ACT>(to_float(x[i]), act_pre<ACT>(pre, i), act_bias<ACT>(bias, col));
            m = max(m, abs_bits(v));
            if constexpr (SUMS) csum[0] += v;
            q[0] = to_fp8<FMT>(v, s);
            if (y) y[i] = q[0];
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) tile[r * FP8_TILE_PITCH + c + k] = q[k];
    }
    if constexpr (SUMS) {
        if (colsum) {
            const int c = (threadIdx.x % GROUPS) * VEC;
#pragma unroll
            for (int k = 0; k < VEC; ++k) col_part[threadIdx.x / GROUPS][c + k] = csum[k];
        }
    }
    if (yt || (SUMS && colsum)) __syncthreads();
    if constexpr (SUMS) {
        if (colsum && threadIdx.x < FP8_TILE && c0 + threadIdx.x < C) {
            float t = 0.0f;
#pragma unroll
            for (int j = 0; j < SHARE; ++j) t += col_part[j][threadIdx.x];
            colsum[(long long)blockIdx.x * C + c0 + threadIdx.x] = t;
        }
    }
    if (yt) store_tile_transposed<VEC>(tile, yt, r0, c0, R, C);
    if (amax) block_amax_to(m, amax);  // its own shared scratch: no race with the tile
}

// Rows a0..a3 (bytes = columns 0..3) of a 4 x 4 byte block -> its columns, in place (column j in a[j], row i in
// byte i).
__device__ __forceinline__ void transpose4x4_bytes(unsigned& a0, unsigned& a1, unsigned& a2, unsigned& a3) {
    const unsigned t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a2, a3, 0x5140);  // r0c0 r1c0 r0c1 r1c1
    const unsigned t2 = __byte_perm(a0, a1, 0x7362), t3 = __byte_perm(a2, a3, 0x7362);  // r0c2 r1c2 r0c3 r1c3
    a0 = __byte_perm(t0, t1, 0x5410);
    a1 = __byte_perm(t0, t1, 0x7632);
    a2 = __byte_perm(t2, t3, 0x5410);
    a3 = __byte_perm(t2, t3, 0x7632);
}

// The transposing cast for 16-bit x with R % 8 == 0 and C % 8 == 0 (x, pre 16-byte aligned, y, yt 8-byte aligned:
// the host checks): fp8_cast_transpose_kernel's contract, with the transpose in registers. Each thread owns an 8 x 8
// block: eight 16-byte loads (one per row, all in flight before any is used), the cast of its 64 values, eight
// 8-byte stores of y, a byte transpose in registers, eight 8-byte stores of y^T. A warp's lanes are 4 row groups x
// 8 column groups (32 rows x 64 columns): a load instruction reads four whole 128-byte lines, a y^T store (4 lanes,
// 32 consecutive rows of one column) one whole 32-byte sector. No shared tile and no barrier before the stores;
// only amax and the column sums reduce across the block at the end. The 8 warps stack in rows: a block tile is
// FP8_8X8_ROWS x FP8_8X8_COLS, grid (ceil(R / FP8_8X8_ROWS), ceil(C / FP8_8X8_COLS)), and the column sums'
// partials are part[blockIdx.x * C + col] as the tiled cast's. MIN_BLOCKS, the resident blocks per SM asked of
// ptxas: by default 2 for the plain cast (at most 128 registers; unbounded, ptxas takes 185 and a quarter of the
// occupancy; at 3 it spills), fp8_8x8_act_blocks for the GELU casts (3: fewer registers, more blocks in flight,
// faster on an H100); dev/cuda/fp8_cast_transpose_regs.cu instantiates other values to compare.
// The idea of many bytes in flight per thread and a register transpose: Transformer Engine's cast_transpose.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr int fp8_8x8_act_blocks = 2;  // sm_80 emulates the FP8 conversion: at 3 blocks the GELU casts spill
#else
constexpr int fp8_8x8_act_blocks = 3;
#endif
template <typename T, __nv_fp8_interpretation_t FMT, int ACT, int SUMS,
          int MIN_BLOCKS = (ACT == FP8_ACT_NONE ? 2 : fp8_8x8_act_blocks)>
__global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS)
fp8_cast_transpose_8x8_kernel(const T* __restrict__ x, const T* __restrict__ pre, const T* __restrict__ bias,
                        unsigned char* __restrict__ y, unsigned char* __restrict__ yt, long long R, long long C,
                        const float* __restrict__ scale, float* __restrict__ scale_inv, float* __restrict__ amax,
                        float* __restrict__ part) {
    static_assert(sizeof(T) == 2, "16-bit x: one 16-byte load is a thread's 8 columns of a row");
    __shared__ float warp_sums[SUMS ? FP8_THREADS / 32 : 1][FP8_8X8_COLS];
    const float s = *scale;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cg = lane & 7, rg = lane >> 3;
    const long long row = (long long)blockIdx.x * FP8_8X8_ROWS + warp * 32 + rg * 8;
    const long long col = (long long)blockIdx.y * FP8_8X8_COLS + cg * 8;
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
            const long long c = (long long)blockIdx.y * FP8_8X8_COLS + threadIdx.x;
            if (threadIdx.x < FP8_8X8_COLS && c < C) {
                float t = 0.0f;
#pragma unroll
                for (int w = 0; w < FP8_THREADS / 32; ++w) t += warp_sums[w][threadIdx.x];
                part[(long long)blockIdx.x * C + c] = t;
            }
        }
    }
    if (amax) block_amax_to(m, amax);
}

// The transposed bytes of FP8 bytes: x [R, C] -> xt [C, R], the transposing cast's tiles and stores without the
// cast (fp8_add_layernorm_kernel writes LayerNorm's output as FP8 rows; the weight gradient also needs their
// transpose). VEC = 4: C % 4 == 0, R % 4 == 0, x and xt aligned to 4 bytes (the host checks).
template <int VEC>
__global__ void __launch_bounds__(FP8_THREADS)
fp8_transpose_kernel(const unsigned char* __restrict__ x, unsigned char* __restrict__ xt, long long R, long long C) {
    __shared__ unsigned char tile[FP8_TILE * FP8_TILE_PITCH];
    const long long r0 = (long long)blockIdx.x * FP8_TILE, c0 = (long long)blockIdx.y * FP8_TILE;
#pragma unroll 4
    for (int it = 0; it < FP8_TILE * FP8_TILE / VEC / FP8_THREADS; ++it) {
        const int g = threadIdx.x + it * FP8_THREADS;
        const int r = g / (FP8_TILE / VEC), c = (g % (FP8_TILE / VEC)) * VEC;
        const long long row = r0 + r, col = c0 + c;
        if (row >= R || col >= C) continue;
        if constexpr (VEC == 4) {
            const unsigned w = *reinterpret_cast<const unsigned*>(x + row * C + col);
#pragma unroll
            for (int k = 0; k < 4; ++k) tile[r * FP8_TILE_PITCH + c + k] = (unsigned char)(w >> (8 * k));
        } else {
            tile[r * FP8_TILE_PITCH + c] = x[row * C + col];
        }
    }
    __syncthreads();
    store_tile_transposed<VEC>(tile, xt, r0, c0, R, C);
}

// Residual add + LayerNorm writing y as FP8 bytes (delayed scaling: the scale is known before the pass), for the
// LayerNorms whose output only FP8 GEMMs read: s = a + b (rounded to T, written to s), y = fp8(LN(s) * scale)
// from the fp32 LayerNorm value (no rounding to T between), amax of those values (optional), mean and rstd. The
// bf16 output and the cast's read of it are never made. One warp per row, the row in registers (layernorm.cuh;
// add_layernorm_forward_warp's layout and arithmetic, so mean, rstd and s are its bits); 16-byte packs of T
// (C % W == 0, the inputs 16-byte aligned, y aligned to W bytes: the host checks), P packs per lane. No early
// return for rows past N: the whole block reduces amax at the end.
template <typename T, int P, __nv_fp8_interpretation_t FMT>
__global__ void __launch_bounds__(256)
fp8_add_layernorm_kernel(const T* a, const T* b, const T* __restrict__ gamma, const T* __restrict__ beta, T* s,
                         unsigned char* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int N,
                         int C, float eps, const float* __restrict__ scale, float* __restrict__ scale_inv,
                         float* __restrict__ amax) {
    constexpr int W = 16 / (int)sizeof(T);  // elements per pack: W bytes of y
    static_assert(W % 4 == 0, "a pack's bytes go out as 4-byte words");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (blockDim.x >> 5) + warp;
    const float sc = *scale;
    if (blockIdx.x == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / sc;
    unsigned mx = 0;
    if (row < N) {
        const int nvec = C / W;
        const long long off = (long long)row * C;
        float v[P][W], m, r;
        add_layernorm_row<T, P>(a, b, s, off, lane, nvec, C, eps, v, m, r);
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                float g[W], bb[W];
                load_pack<T, W>(gamma + j * W, g);
                load_pack<T, W>(beta + j * W, bb);
                unsigned words[W / 4];
#pragma unroll
                for (int q = 0; q < W / 4; ++q) {
                    float o[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int e = 4 * q + k;
                        o[k] = (v[p][e] - m) * r * g[e] + bb[e];
                        mx = max(mx, abs_bits(o[k]));
                    }
                    words[q] = to_fp8x4<FMT>(o, sc);
                }
                unsigned char* yp = y + off + j * W;
                if constexpr (W == 8) *reinterpret_cast<uint2*>(yp) = make_uint2(words[0], words[1]);
                else *reinterpret_cast<unsigned*>(yp) = words[0];
            }
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    }
    if (amax) block_amax_to(mx, amax);
}

// out[c] (+)= sum over the row tiles t of colsum[t * C + c], in the order t = 0, 1, ...: the column sums of a
// transposing cast's tiles added up deterministically (one thread per column; consecutive threads read
// consecutive columns). accumulate: add to out (a gradient buffer) instead of overwriting it.
__global__ void __launch_bounds__(FP8_THREADS)
fp8_column_sums_kernel(const float* __restrict__ colsum, int tiles, long long C, float* __restrict__ out,
                       int accumulate) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float t = 0.0f;
    for (int j = 0; j < tiles; ++j) t += colsum[(long long)j * C + c];
    out[c] = accumulate ? out[c] + t : t;
}

// Delayed scaling's bookkeeping for one tensor, by one whole block: history[pos] = *amax, pos = (pos + 1) % n,
// then the scale from the max of the whole history: scale = fp8_max / amax_max * margin_factor (margin_factor =
// 2^-margin), clamped to [2^-126, 2^126], rounded down to a power of two when pow2 (exact dequantization); a
// history max that is 0, inf or NaN keeps the previous scale. scale_inv = 1 / scale. Current scaling is n = 1.
// Thread 0 does the single-value reads and writes; the whole block reduces the history.
__device__ __forceinline__ void update_scale(float* __restrict__ history, int n, int* __restrict__ pos,
                                             const float* __restrict__ amax, float* __restrict__ scale,
                                             float* __restrict__ scale_inv, float fp8_max, float margin_factor,
                                             int pow2) {
    __shared__ unsigned warp_max_bits[32];
    if (threadIdx.x == 0) history[*pos] = *amax;
    __syncthreads();  // the block sees the new entry before it reduces
    unsigned m = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = max(m, abs_bits(history[i]));
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max_bits[warp] = m;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = max(m, warp_max_bits[w]);
    const float a = __uint_as_float(m);
    float sc = *scale;
    if (m != 0u && m < 0x7f800000u) {  // finite and > 0
        const float lo = __uint_as_float((unsigned)(127 - FP8_SCALE_EXP_LIMIT) << 23);
        const float hi = __uint_as_float((unsigned)(127 + FP8_SCALE_EXP_LIMIT) << 23);
        sc = fp8_max / a;  // IEEE division (no fast math): the NumPy reference gets the same bits
        sc = sc * margin_factor;
        sc = fminf(fmaxf(sc, lo), hi);
        if (pow2) sc = __uint_as_float(__float_as_uint(sc) & 0x7f800000u);
    }
    *scale = sc;
    *scale_inv = 1.0f / sc;
    *pos = (*pos + 1) % n;
}

// One tensor's update (update_scale), one block: AmaxHistory.update().
__global__ void __launch_bounds__(FP8_THREADS)
fp8_update_scale_kernel(float* __restrict__ history, int n, int* __restrict__ pos, const float* __restrict__ amax,
                        float* __restrict__ scale, float* __restrict__ scale_inv, float fp8_max, float margin_factor,
                        int pow2) {
    update_scale(history, n, pos, amax, scale, scale_inv, fp8_max, margin_factor, pow2);
}

// The end of a delayed-scaling step for S tensors in one launch (AmaxHistories.update_and_clear), instead of an
// update and a memset per tensor: block s runs update_scale on state s, whose arrays are row s of the flat
// buffers (history [S, n]; pos, amax, scale, scale_inv [S, FP8_STATE_WORDS], element 0 of each row) and whose
// format's largest value is fp8_max[s] (E4M3 and E5M2 tensors share the launch), then zeroes its amax, which the
// next step's casts raise again.
__global__ void __launch_bounds__(FP8_THREADS)
fp8_update_scales_kernel(float* __restrict__ history, int n, int* __restrict__ pos, float* __restrict__ amax,
                         float* __restrict__ scale, float* __restrict__ scale_inv, const float* __restrict__ fp8_max,
                         float margin_factor, int pow2) {
    const int s = blockIdx.x, w = s * FP8_STATE_WORDS;
    update_scale(history + (long long)s * n, n, pos + w, amax + w, scale + w, scale_inv + w, fp8_max[s],
                 margin_factor, pow2);
    if (threadIdx.x == 0) amax[w] = 0.0f;  // after update_scale's read of it, in the same thread
}
