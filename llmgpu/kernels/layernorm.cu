// layernorm.cu: LayerNorm forward and backward over the last axis (chapter 3).
//
//   forward   mean = sum(x) / C,  rstd = 1 / sqrt(sum((x - mean)^2) / C + eps)
//             y = (x - mean) * rstd * gamma + beta          (mean[N], rstd[N] saved in fp32)
//   backward  xhat = (x - mean) * rstd,  g = dy * gamma
//             dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//             dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy
//
// The saved statistics are the whole trick of the backward: with mean and rstd in hand, xhat is one
// subtract and one multiply away, so the backward reads x and dy once each (plus 8 bytes per row)
// instead of recomputing two reductions per row.
//
// Two generations of kernels:
//   *_naive   one thread per row (forward, dx) or per column (dgamma/dbeta). Neighbouring threads
//             touch addresses C elements apart, so a warp's 32 loads hit 32 different cache lines:
//             uncoalesced, and the per-column kernel loops over all N rows with only C threads.
//   *_warp    one warp per row. Lane l owns the W-element packs j = l, l + 32, l + 64, ... of the
//             row (16-byte loads: W = 4 fp32, 8 fp16/bf16; W = 1 is the scalar fallback the host
//             picks when C % W != 0 or a pointer is not 16-byte aligned), so a warp moves 512
//             contiguous bytes per instruction. Row sums are warp shuffles, no shared memory.
//             P (template) is how many packs per lane are held in registers: P > 0 covers rows of
//             up to 32 * P * W elements entirely in registers (the host picks the smallest P of
//             1, 2, 3, 4, 6, 8 that fits); P = 0 keeps the row (forward) or the per-warp gradient
//             accumulators (backward) in shared memory; P = -1 (forward only, very long rows)
//             re-reads x from global memory (L1/L2) instead of caching it.
//
// The forward reads x from global memory once: the first pass keeps the row (registers or shared
// memory), the mean, the variance (two-pass formula, sum of (x - mean)^2: no cancellation) and y
// all come from that copy.
//
// dgamma and dbeta are column sums over all N rows. Float atomics would make their rounding depend
// on the order blocks happen to finish in; here every sum has an order fixed by the shapes alone,
// so the result is bitwise identical run to run:
//   1. layernorm_backward_warp: warp w of block b handles rows b * wpb + w, then + gridDim.x * wpb,
//      ... and accumulates its lanes' columns in order (registers or per-warp shared memory). At the
//      end the block adds its warps in order w = 0, 1, ... and writes one row of an fp32 scratch
//      `partial [gridDim.x, 2, C]` (dgamma half, dbeta half);
//   2. layernorm_param_grad_reduce: sums `partial` over blocks, each thread a fixed subset in order,
//      the 16 thread partials added in order, and rounds once to the parameter dtype.
// (llm.c's layernorm_backward accumulates in shared memory with atomics instead; Apex and PyTorch
// use a separate column-reduction kernel that reads x and dy a second time.)
//
// A third generation, at the end of the file, is written for bandwidth first:
//   layernorm_backward_fast      the backward with the row held in registers, the next row's loads
//                                issued before the current row is reduced (two rows in flight per
//                                warp), gamma in shared memory, optional dresidual added into dx;
//   layernorm_param_grad_finish  the second stage for it (many loads in flight per thread; can add
//                                into fp32 gradient buffers);
//   add_layernorm_forward_warp   residual add + LayerNorm in one pass (s = a + b, y = LN(s)).
#include "common.cuh"
#include "layernorm.cuh"

// llmgpu:kernel layernorm_forward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_forward_warp<{float,__half,__nv_bfloat16}, 1, {-1,0,1,2,3,4,6,8}>
// llmgpu:kernel layernorm_forward_warp<{float,__half,__nv_bfloat16}, 0, {-1,0}>
// llmgpu:kernel layernorm_backward_naive_dx<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_backward_naive_dparams<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_backward_warp<{float,__half,__nv_bfloat16}, 1, {0,1,2,3,4,6,8}>
// llmgpu:kernel layernorm_backward_warp<{float,__half,__nv_bfloat16}, 0, 0>
// llmgpu:kernel layernorm_param_grad_reduce<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_backward_fast<{__half,__nv_bfloat16}, {1,2,3,4}, {0,1}, {0,1}>
// llmgpu:kernel layernorm_backward_fast<{__half,__nv_bfloat16}, {5,6,7,8}, {0,1}, 1>
// llmgpu:kernel layernorm_backward_fast<float, {1,2,3,4,6}, {0,1}, 0>
// llmgpu:kernel layernorm_param_grad_finish<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel add_layernorm_forward_warp<{float,__half,__nv_bfloat16}, {1,2,3,4,6,8}>

template <typename T, int VEC>
struct LnWidth {
    static constexpr int value = VEC ? 16 / (int)sizeof(T) : 1;
};

// ------------------------------------------------------------------------------------ forward

// One thread per row: the textbook loops, three passes over the row (mean, variance, output).
template <typename T>
__global__ void layernorm_forward_naive(const T* __restrict__ x, const T* __restrict__ gamma,
                                        const T* __restrict__ beta, T* __restrict__ y, float* __restrict__ mean,
                                        float* __restrict__ rstd, int N, int C, float eps) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const T* xr = x + (long long)row * C;
    T* yr = y + (long long)row * C;
    float sum = 0.0f;
    for (int i = 0; i < C; ++i) sum += to_float(xr[i]);
    const float m = sum / (float)C;
    float ss = 0.0f;
    for (int i = 0; i < C; ++i) {
        const float d = to_float(xr[i]) - m;
        ss += d * d;
    }
    const float s = rsqrtf(ss / (float)C + eps);
    for (int i = 0; i < C; ++i) {
        yr[i] = from_float<T>((to_float(xr[i]) - m) * s * to_float(gamma[i]) + to_float(beta[i]));
    }
    mean[row] = m;
    rstd[row] = s;
}

// One warp per row, rows blockIdx.x * wpb + warp (wpb = blockDim.x / 32). Shared memory (P == 0
// only): wpb * C floats, the row of each warp stored pack-major (element k of pack j at k * nvec + j)
// so that the 32 lanes of a warp touch 32 consecutive words (no bank conflicts). Every lane reads
// back only what it wrote itself, so no barrier is needed.
template <typename T, int VEC, int P>
__global__ void __launch_bounds__(256) layernorm_forward_warp(const T* __restrict__ x, const T* __restrict__ gamma,
                                                              const T* __restrict__ beta, T* __restrict__ y,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int N, int C, float eps) {
    constexpr int W = LnWidth<T, VEC>::value;
    constexpr int R = P > 0 ? P : 1;  // register packs per lane
    extern __shared__ float ln_row_cache[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= N) return;  // whole warps leave together; no block barrier follows
    const int nvec = C / W;  // the host guarantees C % W == 0
    const T* xr = x + (long long)row * C;
    T* yr = y + (long long)row * C;
    float* cache = ln_row_cache + warp * C;

    // pass 1 (the only read of x): row sum, and keep the row
    float v[R][W];
    float sum = 0.0f;
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                load_pack<T, W>(xr + (long long)j * W, v[p]);
            } else {
#pragma unroll
                for (int k = 0; k < W; ++k) v[p][k] = 0.0f;  // past the row end: adds nothing
            }
#pragma unroll
            for (int k = 0; k < W; ++k) sum += v[p][k];
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
            float t[W];
            load_pack<T, W>(xr + (long long)j * W, t);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                sum += t[k];
                if constexpr (P == 0) cache[k * nvec + j] = t[k];
            }
        }
    }
    const float m = warp_sum(sum) / (float)C;

    // pass 2: variance from the kept row
    float s;
    if constexpr (P > 0) {
        s = kept_row_rstd(v, m, lane, nvec, C, eps);
    } else {
        float ss = 0.0f;
        for (int j = lane; j < nvec; j += 32) {
            float t[W];
            if constexpr (P == 0) {
#pragma unroll
                for (int k = 0; k < W; ++k) t[k] = cache[k * nvec + j];
            } else {
                load_pack<T, W>(xr + (long long)j * W, t);
            }
#pragma unroll
            for (int k = 0; k < W; ++k) {
                const float d = t[k] - m;
                ss += d * d;
            }
        }
        s = rsqrtf(warp_sum(ss) / (float)C + eps);
    }

    // pass 3: normalize, scale, shift, one 16-byte store per pack
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                float g[W], b[W], o[W];
                load_pack<T, W>(gamma + j * W, g);
                load_pack<T, W>(beta + j * W, b);
#pragma unroll
                for (int k = 0; k < W; ++k) o[k] = (v[p][k] - m) * s * g[k] + b[k];
                store_pack<T, W>(yr + (long long)j * W, o);
            }
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
            float t[W], g[W], b[W], o[W];
            if constexpr (P == 0) {
#pragma unroll
                for (int k = 0; k < W; ++k) t[k] = cache[k * nvec + j];
            } else {
                load_pack<T, W>(xr + (long long)j * W, t);
            }
            load_pack<T, W>(gamma + j * W, g);
            load_pack<T, W>(beta + j * W, b);
#pragma unroll
            for (int k = 0; k < W; ++k) o[k] = (t[k] - m) * s * g[k] + b[k];
            store_pack<T, W>(yr + (long long)j * W, o);
        }
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// ------------------------------------------------------------------------------------ backward

// One thread per row: dx only (dgamma/dbeta come from layernorm_backward_naive_dparams).
template <typename T>
__global__ void layernorm_backward_naive_dx(const T* __restrict__ dy, const T* __restrict__ x,
                                            const T* __restrict__ gamma, const float* __restrict__ mean,
                                            const float* __restrict__ rstd, T* __restrict__ dx, int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const long long off = (long long)row * C;
    const float m = mean[row], s = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int i = 0; i < C; ++i) {
        const float xh = (to_float(x[off + i]) - m) * s;
        const float g = to_float(dy[off + i]) * to_float(gamma[i]);
        sum_g += g;
        sum_gx += g * xh;
    }
    const float mg = sum_g / (float)C, mgx = sum_gx / (float)C;
    for (int i = 0; i < C; ++i) {
        const float xh = (to_float(x[off + i]) - m) * s;
        const float g = to_float(dy[off + i]) * to_float(gamma[i]);
        dx[off + i] = from_float<T>(s * (g - mg - xh * mgx));
    }
}

// One thread per column: dgamma[c], dbeta[c] summed over rows 0..N-1 in order (deterministic, but
// only C threads do all the work, and dy, x are read a second time).
template <typename T>
__global__ void layernorm_backward_naive_dparams(const T* __restrict__ dy, const T* __restrict__ x,
                                                 const float* __restrict__ mean, const float* __restrict__ rstd,
                                                 T* __restrict__ dgamma, T* __restrict__ dbeta, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dg = 0.0f, db = 0.0f;
    for (int row = 0; row < N; ++row) {
        const long long i = (long long)row * C + c;
        const float d = to_float(dy[i]);
        dg += d * (to_float(x[i]) - mean[row]) * rstd[row];
        db += d;
    }
    dgamma[c] = from_float<T>(dg);
    dbeta[c] = from_float<T>(db);
}

// One warp per row, each block walking rows blockIdx.x * wpb + warp + k * gridDim.x * wpb.
// Lane l always owns the same columns (packs l, l + 32, ...), so it can accumulate dgamma/dbeta for
// them across all the rows its warp visits without talking to anyone:
//   P > 0: in registers (adg, adb: 2 * P * W floats per lane);
//   P = 0: in shared memory, wpb * 2 * C floats (per warp: dgamma then dbeta, pack-major layout).
// dx needs two row reductions (mean(g), mean(g * xhat)) before it can be written, so the row is
// read twice; the second read comes from L1/L2, not HBM (the row was touched a moment ago).
// Shared memory: P > 0 needs 2 * C floats (the block's in-order sum at the end), P = 0 wpb * 2 * C.
template <typename T, int VEC, int P>
__global__ void __launch_bounds__(256) layernorm_backward_warp(const T* __restrict__ dy, const T* __restrict__ x,
                                                               const T* __restrict__ gamma,
                                                               const float* __restrict__ mean,
                                                               const float* __restrict__ rstd, T* __restrict__ dx,
                                                               float* __restrict__ partial, int N, int C) {
    constexpr int W = LnWidth<T, VEC>::value;
    constexpr int R = P > 0 ? P : 1;
    extern __shared__ float ln_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const int nvec = C / W;  // the host guarantees C % W == 0
    const float inv_c = 1.0f / (float)C;

    float adg[R][W], adb[R][W];
    float* acc = ln_smem + warp * 2 * C;  // P == 0: [dgamma C | dbeta C] of this warp
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
            for (int k = 0; k < W; ++k) adg[p][k] = adb[p][k] = 0.0f;
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
#pragma unroll
            for (int k = 0; k < W; ++k) acc[k * nvec + j] = acc[C + k * nvec + j] = 0.0f;
        }
    }

    for (int row = blockIdx.x * wpb + warp; row < N; row += gridDim.x * wpb) {
        const long long off = (long long)row * C;
        const float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_gx = 0.0f;
        // pass 1: the two row reductions, and this row's share of dgamma/dbeta
        if constexpr (P > 0) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int j = lane + 32 * p;
                if (j < nvec) {
                    float d[W], xv[W], ga[W];
                    load_pack<T, W>(dy + off + j * W, d);
                    load_pack<T, W>(x + off + j * W, xv);
                    load_pack<T, W>(gamma + j * W, ga);
#pragma unroll
                    for (int k = 0; k < W; ++k) {
                        const float xh = (xv[k] - m) * s;
                        const float g = d[k] * ga[k];
                        sum_g += g;
                        sum_gx += g * xh;
                        adg[p][k] += d[k] * xh;
                        adb[p][k] += d[k];
                    }
                }
            }
        } else {
            for (int j = lane; j < nvec; j += 32) {
                float d[W], xv[W], ga[W];
                load_pack<T, W>(dy + off + j * W, d);
                load_pack<T, W>(x + off + j * W, xv);
                load_pack<T, W>(gamma + j * W, ga);
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    const float xh = (xv[k] - m) * s;
                    const float g = d[k] * ga[k];
                    sum_g += g;
                    sum_gx += g * xh;
                    acc[k * nvec + j] += d[k] * xh;
                    acc[C + k * nvec + j] += d[k];
                }
            }
        }
        const float mg = warp_sum(sum_g) * inv_c, mgx = warp_sum(sum_gx) * inv_c;
        // pass 2: dx
        if constexpr (P > 0) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int j = lane + 32 * p;
                if (j < nvec) {
                    float d[W], xv[W], ga[W], o[W];
                    load_pack<T, W>(dy + off + j * W, d);
                    load_pack<T, W>(x + off + j * W, xv);
                    load_pack<T, W>(gamma + j * W, ga);
#pragma unroll
                    for (int k = 0; k < W; ++k) {
                        const float xh = (xv[k] - m) * s;
                        o[k] = s * (d[k] * ga[k] - mg - xh * mgx);
                    }
                    store_pack<T, W>(dx + off + j * W, o);
                }
            }
        } else {
            for (int j = lane; j < nvec; j += 32) {
                float d[W], xv[W], ga[W], o[W];
                load_pack<T, W>(dy + off + j * W, d);
                load_pack<T, W>(x + off + j * W, xv);
                load_pack<T, W>(gamma + j * W, ga);
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    const float xh = (xv[k] - m) * s;
                    o[k] = s * (d[k] * ga[k] - mg - xh * mgx);
                }
                store_pack<T, W>(dx + off + j * W, o);
            }
        }
    }

    // the block's partial sums, warps added in the fixed order 0, 1, ..., wpb - 1
    float* out = partial + (long long)blockIdx.x * 2 * C;
    if constexpr (P > 0) {
        float* buf = ln_smem;  // [dgamma C | dbeta C], natural column order
        for (int w = 0; w < wpb; ++w) {
            if (warp == w) {
#pragma unroll
                for (int p = 0; p < P; ++p) {
                    const int j = lane + 32 * p;
                    if (j < nvec) {
#pragma unroll
                        for (int k = 0; k < W; ++k) {
                            const int c = j * W + k;
                            buf[c] = (w == 0) ? adg[p][k] : buf[c] + adg[p][k];
                            buf[C + c] = (w == 0) ? adb[p][k] : buf[C + c] + adb[p][k];
                        }
                    }
                }
            }
            __syncthreads();
        }
        for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) out[c] = buf[c];
    } else {
        __syncthreads();
        for (int q = threadIdx.x; q < 2 * C; q += blockDim.x) {
            const int half = q >= C ? 1 : 0;
            const int pos = q - half * C;      // pack-major position k * nvec + j
            const int k = pos / nvec, j = pos - k * nvec;
            float t = 0.0f;
            for (int w = 0; w < wpb; ++w) t += ln_smem[w * 2 * C + q];
            out[half * C + j * W + k] = t;
        }
    }
}

// dgamma[c] = sum_b partial[b, 0, c], dbeta[c] = sum_b partial[b, 1, c], in a fixed order.
// Block (32, 16): x walks 32 consecutive columns of the 2C (coalesced), y splits the blocks
// (thread y takes b = y, y + 16, ...); the 16 partial sums are then added in order y = 0..15.
template <typename T>
__global__ void __launch_bounds__(512) layernorm_param_grad_reduce(const float* __restrict__ partial, int nparts,
                                                                   int C, T* __restrict__ dgamma,
                                                                   T* __restrict__ dbeta) {
    __shared__ float red[16][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;  // over [dgamma | dbeta], 2C columns
    float t = 0.0f;
    if (col < 2 * C) {
        for (int b = ty; b < nparts; b += 16) t += partial[(long long)b * 2 * C + col];
    }
    red[ty][tx] = t;
    __syncthreads();
    if (ty == 0 && col < 2 * C) {
        float r = red[0][tx];
#pragma unroll
        for (int y = 1; y < 16; ++y) r += red[y][tx];
        if (col < C) {
            dgamma[col] = from_float<T>(r);
        } else {
            dbeta[col - C] = from_float<T>(r);
        }
    }
}

// ===================================================================================== "fast"
//
// Why the "optimized" backward above stops well short of the copy bandwidth and how
// layernorm_backward_fast is shaped instead:
//
//  * Memory-level parallelism. A memory-bound kernel runs at full bandwidth only while enough bytes
//    are in flight: by Little's law, bandwidth x loaded DRAM latency, tens of KB of outstanding loads
//    per SM. In layernorm_backward_warp each warp alternates phases: load the row -> two warp
//    reductions -> load the row again (L1/L2) -> store dx -> next row. Only in the first phase does
//    it have DRAM loads outstanding, so on average an SM holds far fewer bytes in flight than its
//    warps could. Here each warp keeps its whole row in registers (dy and
//    x as raw 16-byte packs: 4 registers per pack, P packs per lane) and issues the loads of its
//    NEXT row before it starts reducing the current one (software pipelining, two rows in flight per
//    warp). While it shuffles, computes and stores row r, row r + 1 is already on its way.
//  * No second pass. dy and x are read from DRAM exactly once and never re-read; gamma (the same
//    for every row) is converted to fp32 once per block into shared memory, laid out so that a
//    warp's 16-byte reads are conflict-free ((p * Q + q) * 32 + lane, in float4 units).
//  * Registers are the budget. Row buffers (2 rows x {dy, x[, dresidual]}) + dgamma/dbeta
//    accumulators (2 P W floats, they stay in registers across all rows of the warp) are what a
//    thread holds; LnFastPlan estimates it and __launch_bounds__ asks for 2 blocks of 8 warps per
//    SM where the estimate fits 128 registers (16 warps x 2 rows x 3 KB = 96 KB in flight for
//    768 bf16), else 1 block (8 warps x 2 rows; bigger rows, same bytes in flight).
//  * Every warp does the same number of rows: the host picks the grid so that the rows divide as
//    evenly as the resident warps allow (no tail wave).
//  * Streaming loads (load_raw16_stream, evict-first) for dy, x and dresidual: each byte is used once.
//  * Deterministic dgamma/dbeta without atomics: lane accumulators in row order, then the block's
//    warps in order w = 0..7 (one round through shared memory: all warps store, every thread adds
//    its columns over w in order), one [gridDim.x, 2, C] fp32 partial row per block, and
//    layernorm_param_grad_finish sums the blocks in a fixed order. Same inputs, same grid (the grid
//    depends only on N, C, the SM count and the kernel's register count), same bits.
//  * dx = LN backward + dresidual in the same kernel (the gradient of the residual branch that
//    skips the LayerNorm): one read of dresidual instead of a separate add kernel. dx may alias
//    dresidual (in place): every element is read by the lane that later writes it, before it is
//    written, and the two pointers are not __restrict__.
//
// Restrictions (the host falls back to the "optimized" kernels otherwise): C a multiple of the pack
// width W (8 for fp16/bf16, 4 for fp32), 16-byte aligned rows, C <= 32 * W * P_max (2048 for
// 16-bit, 768 for fp32). Register accumulators (SACC = 0) stop at P = 4 (1024 for 16-bit): beyond
// that they alone would not fit in registers, so the 16-bit rows of GPT-2 medium to XL and beyond
// (C = 1280, 1600, 2048: P = 5, 7, 8) accumulate in shared memory; fp32 has no SACC variant.
//
// What is left between this kernel and a copy of the same bytes is a fixed cost per call (the first
// rows in and the last rows out of the persistent grid, the second stage), not too few bytes in
// flight: deeper pipelines (rows staged in shared memory by cp.async, the next row prefetched into
// L2) and the second stage folded into this kernel were built and were not faster, so the kernel
// keeps two rows in registers and a separate second stage (dev/cuda/README.md has the history).

template <typename T>
struct IsBf16 {
    static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
    static constexpr bool value = true;
};

// One row's share of this lane for layernorm_backward_fast: its packs j = lane + 32 p (p < P, j < nvec)
// of dy, x (and dresidual) as raw 16-byte streaming loads, and the row's saved mean and rstd. Each
// lane's packs sit at base + 32 * W * p: one address per row and array, the per-pack offsets are
// immediates. Row indices are 32-bit (the host keeps N + warps in the grid below 2**31), element
// offsets 64-bit.
template <typename T, int P, int RES>
__device__ __forceinline__ void ln_load_row(const T* __restrict__ dy, const T* __restrict__ x, const T* dres,
                                            const float* __restrict__ mean, const float* __restrict__ rstd,
                                            int row, int C, int lane, int nvec,
                                            Packed<T, 16 / (int)sizeof(T)> (&d)[P],
                                            Packed<T, 16 / (int)sizeof(T)> (&xs)[P],
                                            Packed<T, 16 / (int)sizeof(T)> (&r)[P], float& m, float& rs) {
    constexpr int W = 16 / (int)sizeof(T);
    const long long off = (long long)row * C + lane * W;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (lane + 32 * p < nvec) {
            d[p] = load_raw16_stream(dy + off + 32 * W * p);
            xs[p] = load_raw16_stream(x + off + 32 * W * p);
            if constexpr (RES) r[p] = load_raw16_stream(dres + off + 32 * W * p);
        }
    }
    m = mean[row];
    rs = rstd[row];
}

// Register estimate per thread (32-bit registers) and the blocks per SM asked of the compiler.
// SACC = 0: dgamma/dbeta accumulators in registers (2 P W floats), blocks of 8 warps.
// SACC = 1: accumulators in shared memory (per warp, conflict-free float4 slots), blocks of 4 warps:
//   the thread holds only the two rows' raw packs (2 x (2 + RES) x 4 P registers), so 6 blocks of
//   4 warps (<= 80 registers) or 5 with dresidual (<= 96) fit an SM: 20-24 warps x 2 rows in flight.
template <typename T, int P, int RES, int SACC>
struct LnFastPlan {
    static constexpr int W = 16 / (int)sizeof(T);
    static constexpr int regs = (SACC ? 0 : 2 * P * W)     // dgamma, dbeta accumulators
                                + 2 * (2 + RES) * 4 * P  // current + next row: dy, x (, dresidual) packs
                                + 32;                    // addresses, statistics, loop state, temporaries
    static constexpr int threads = SACC ? 128 : 256;
    // SACC: 6 blocks cap a thread at 80 registers, 5 at 96, 4 at 128 (what the estimate needs, rounded;
    // fp16's conversions need a few more registers than bf16's shift/mask, hence its lower count).
    // Longer rows (P > 4): as many blocks as the estimate plus 16 registers of slack fit in the SM's
    // 64 K registers (P = 5..8: 4, 3, 3, 2 blocks without dresidual; 3, 2, 2, 2 with it). Fewer warps,
    // but each holds a longer row in flight: the bytes in flight per SM stay about the same.
    static constexpr int long_blocks = 65536 / (threads * (regs + 16)) > 0 ? 65536 / (threads * (regs + 16)) : 1;
    static constexpr int min_blocks = SACC ? (P > 4 ? long_blocks
                                                    : RES ? (P <= 2 ? 6 : (P == 3 && sizeof(T) == 2 && W == 8 && IsBf16<T>::value) ? 5 : 4)
                                                          : (P <= 3 ? 6 : 5))
                                           : (regs <= 128 ? 2 : 1);
};

// Backward, one warp per row, rows gw, gw + nw, gw + 2 nw, ... (gw = global warp id, nw = warps in
// the grid). blockDim.x == LnFastPlan::threads (8 warps, 4 with SACC). Dynamic shared memory:
// SACC = 0: 4 * max(32 * P * W, 8 * C) bytes; SACC = 1: 16 * 32 * P * Q * (1 + 2 * 4) bytes (gamma, then
// every warp's dgamma/dbeta slots). RES = 1: dx = LN backward + dres (dres may be dx itself).
template <typename T, int P, int RES, int SACC>
__global__ void __launch_bounds__((LnFastPlan<T, P, RES, SACC>::threads), (LnFastPlan<T, P, RES, SACC>::min_blocks))
    layernorm_backward_fast(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
                            const float* __restrict__ mean, const float* __restrict__ rstd, const T* dres, T* dx,
                            float* __restrict__ partial, int N, int C) {
    constexpr int W = 16 / (int)sizeof(T);
    constexpr int Q = W / 4;  // float4s per pack
    using Pack = Packed<T, W>;
    extern __shared__ float4 ln_fast_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const int nvec = C / W;  // the host guarantees C % W == 0 and nvec <= 32 * P
    const float inv_c = 1.0f / (float)C;

    // The first row's loads go out before the gamma table is built: they do not need it.
    const int nw = gridDim.x * wpb;
    int row = blockIdx.x * wpb + warp;
    Pack cd[P], cx[P], cr[P];  // the current row: dy, x, dresidual
    float cm = 0.0f, cs = 0.0f;
    if (row < N) ln_load_row<T, P, RES>(dy, x, dres, mean, rstd, row, C, lane, nvec, cd, cx, cr, cm, cs);

    // gamma -> shared memory, fp32, float4 (p, q) of lane l at (p * Q + q) * 32 + l
    for (int i = threadIdx.x; i < nvec * Q; i += blockDim.x) {
        const int j = i / Q, q = i - j * Q;           // pack j, quarter q
        const int p = j >> 5, l = j & 31;             // owned by lane l as its pack p
        const T* g = gamma + j * W + 4 * q;
        ln_fast_smem[(p * Q + q) * 32 + l] =
            make_float4(to_float(g[0]), to_float(g[1]), to_float(g[2]), to_float(g[3]));
    }
    // SACC: this warp's accumulators, float4 slot (half, p, q) of lane l at ((half * P + p) * Q + q) * 32 + l
    // after the gamma table (each lane only ever touches its own slots until the block sum at the end)
    float4* sacc = ln_fast_smem + (P * Q + 2 * P * Q * warp) * 32 + lane;
    if constexpr (SACC) {
#pragma unroll
        for (int i = 0; i < 2 * P * Q; ++i) sacc[i * 32] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();

    constexpr int AP = SACC ? 1 : P;  // register accumulators only without SACC
    float adg[AP][W], adb[AP][W];
    if constexpr (!SACC) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
            for (int k = 0; k < W; ++k) adg[p][k] = adb[p][k] = 0.0f;
        }
    }


    for (; row < N; row += nw) {
        // 1. issue the next row's loads first: they travel while this row is reduced and stored
        const int nxt = row + nw;
        Pack nd[P], nx[P], nr[P];
        float nm = 0.0f, ns = 0.0f;
        if (nxt < N) ln_load_row<T, P, RES>(dy, x, dres, mean, rstd, nxt, C, lane, nvec, nd, nx, nr, nm, ns);

        // 2. the two row reductions and this row's share of dgamma/dbeta, all from registers
        float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const float4 g4 = ln_fast_smem[(p * Q + q) * 32 + lane];
                    const float ga[4] = {g4.x, g4.y, g4.z, g4.w};
                    float dgq[4], dbq[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int k = 4 * q + e;
                        const float d = pack_elem(cd[p], k);
                        const float xh = (pack_elem(cx[p], k) - cm) * cs;
                        const float g = d * ga[e];
                        sum_g += g;
                        sum_gx += g * xh;
                        dgq[e] = d * xh;
                        dbq[e] = d;
                    }
                    if constexpr (SACC) {
                        float4* sg = sacc + (p * Q + q) * 32;
                        float4* sb = sacc + ((P + p) * Q + q) * 32;
                        float4 a = *sg, b = *sb;
                        a.x += dgq[0]; a.y += dgq[1]; a.z += dgq[2]; a.w += dgq[3];
                        b.x += dbq[0]; b.y += dbq[1]; b.z += dbq[2]; b.w += dbq[3];
                        *sg = a;
                        *sb = b;
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            adg[p][4 * q + e] += dgq[e];
                            adb[p][4 * q + e] += dbq[e];
                        }
                    }
                }
            }
        }
        const float mg = warp_sum(sum_g) * inv_c, mgx = warp_sum(sum_gx) * inv_c;

        // 3. dx (+ dresidual), one 16-byte store per pack
        T* dxr = dx + (long long)row * C + lane * W;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
                Pack o;
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const float4 g4 = ln_fast_smem[(p * Q + q) * 32 + lane];
                    const float ga[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int k = 4 * q + e;
                        const float xh = (pack_elem(cx[p], k) - cm) * cs;
                        float v = cs * (pack_elem(cd[p], k) * ga[e] - mg - xh * mgx);
                        if constexpr (RES) v += pack_elem(cr[p], k);
                        o.v[k] = from_float<T>(v);
                    }
                }
                *reinterpret_cast<Pack*>(dxr + 32 * W * p) = o;
            }
        }

        // 4. the next row becomes the current one (register renaming after unrolling)
#pragma unroll
        for (int p = 0; p < P; ++p) {
            cd[p] = nd[p];
            cx[p] = nx[p];
            if constexpr (RES) cr[p] = nr[p];
        }
        cm = nm;
        cs = ns;
    }

    float* out = partial + (long long)blockIdx.x * 2 * C;
    if constexpr (SACC) {
        // Every warp's slots are already in shared memory: thread t adds columns t, t + blockDim.x, ...
        // over the warps in the fixed order w = 0, 1, ..., wpb - 1.
        __syncthreads();
        const float* slots = reinterpret_cast<const float*>(ln_fast_smem + P * Q * 32);
        for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) {
            const int half = i >= C ? 1 : 0;
            const int c = i - half * C;
            const int j = c / W, k = c - j * W;  // pack j (lane j & 31, its pack j >> 5), element k
            const int q = k >> 2, e = k & 3;
            const int slot = ((((half * P + (j >> 5)) * Q + q) * 32 + (j & 31)) << 2) + e;
            float t = slots[slot];
            for (int w = 1; w < wpb; ++w) t += slots[(long long)w * (2 * P * Q * 32 * 4) + slot];
            out[i] = t;
        }
        return;
    } else {
    // The block's sum, one half (dgamma, then dbeta) at a time through wpb * C floats of shared
    // memory: every warp stores its columns, then thread t adds columns t, t + 256, ... over the
    // warps in the fixed order w = 0, 1, ..., wpb - 1.
    float* slab = reinterpret_cast<float*>(ln_fast_smem);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        __syncthreads();  // gamma (first round) or the previous half (second round) no longer read
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                float4* dst = reinterpret_cast<float4*>(slab + (long long)warp * C + j * W);
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const int k = 4 * q;
                    dst[q] = half == 0 ? make_float4(adg[p][k], adg[p][k + 1], adg[p][k + 2], adg[p][k + 3])
                                       : make_float4(adb[p][k], adb[p][k + 1], adb[p][k + 2], adb[p][k + 3]);
                }
            }
        }
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float t = slab[c];
            for (int w = 1; w < wpb; ++w) t += slab[(long long)w * C + c];
            out[half * C + c] = t;
        }
    }
    }
}

// Second stage of the fast backward: dgamma[c] = sum_b partial[b, 0, c], dbeta[c] = sum_b
// partial[b, 1, c], in a fixed order, written as TO (the gradient buffer's dtype, fp32 or gamma's)
// or, with ACC = 1, added to what the buffer holds (dgamma += ..., in fp32: the model accumulates
// straight into its fp32 gradient buffers).
// Block (32, 32), 32 columns of the 2C per block: thread (x, y) sums blocks b = y, y + 32, ... in
// order, eight independent loads in flight at a time (the reduction is latency-bound: a few hundred
// KB in total); then warp y adds the 32 partial sums of column y with a butterfly (fixed order too).
template <typename TO, int ACC>
__global__ void __launch_bounds__(1024) layernorm_param_grad_finish(const float* __restrict__ partial, int nparts,
                                                                    int C, TO* dgamma, TO* dbeta) {
    __shared__ float red[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long ld = 2LL * C;
    const int col = blockIdx.x * 32 + tx;
    float t = 0.0f;
    if (col < 2 * C) {
        const float* src = partial + col;
        int b = ty;
        for (; b + 7 * 32 < nparts; b += 8 * 32) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = src[(long long)(b + 32 * i) * ld];
#pragma unroll
            for (int i = 0; i < 8; ++i) t += v[i];
        }
        for (; b < nparts; b += 32) t += src[(long long)b * ld];
    }
    red[ty][tx] = t;
    __syncthreads();
    const float r = warp_sum(red[tx][ty]);  // warp ty: column blockIdx.x * 32 + ty, over the 32 rows
    const int c = blockIdx.x * 32 + ty;
    if (tx == 0 && c < 2 * C) {
        TO* dst = c < C ? dgamma + c : dbeta + (c - C);
        *dst = from_float<TO>(ACC ? to_float(*dst) + r : r);
    }
}

// Residual add + LayerNorm forward, one warp per row (rows blockIdx.x * wpb + warp):
//   s = a + b rounded to T (the residual stream, written to s),  y = LayerNorm(s),
// statistics from the ROUNDED s, so y equals layernorm_forward(s) up to the order of the sums. One
// pass over memory: read a, b; write s, y, mean, rstd (the unfused pair reads s back once more).
// s may alias a or b (in place, residual_out=a): add_layernorm_row (layernorm.cuh) loads all of a
// lane's packs of a and b before it stores any of s. Loading everything first is also what keeps the
// loads in flight together (the compiler may not move a load of a past a store to s that might alias
// it). 16-byte packs only (W = 16 / sizeof(T)), the row in registers, P packs per lane; the host falls
// back to an add + layernorm_forward otherwise.
template <typename T, int P>
__global__ void __launch_bounds__(256) add_layernorm_forward_warp(const T* a, const T* b, const T* __restrict__ gamma,
                                                                  const T* __restrict__ beta, T* s, T* y,
                                                                  float* __restrict__ mean,
                                                                  float* __restrict__ rstd, int N, int C, float eps) {
    constexpr int W = 16 / (int)sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= N) return;
    const int nvec = C / W;  // the host guarantees C % W == 0 and nvec <= 32 * P
    const long long off = (long long)row * C;
    float v[P][W], m, r;
    add_layernorm_row<T, P>(a, b, s, off, lane, nvec, C, eps, v, m, r);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j = lane + 32 * p;
        if (j < nvec) {
            float g[W], bb[W], o[W];
            load_pack<T, W>(gamma + j * W, g);
            load_pack<T, W>(beta + j * W, bb);
#pragma unroll
            for (int k = 0; k < W; ++k) o[k] = (v[p][k] - m) * r * g[k] + bb[k];
            store_pack<T, W>(y + off + j * W, o);
        }
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}
