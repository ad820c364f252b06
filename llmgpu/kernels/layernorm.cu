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
#include "common.cuh"

// llmgpu:kernel layernorm_forward_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_forward_warp<{float,__half,__nv_bfloat16}, 1, {-1,0,1,2,3,4,6,8}>
// llmgpu:kernel layernorm_forward_warp<{float,__half,__nv_bfloat16}, 0, {-1,0}>
// llmgpu:kernel layernorm_backward_naive_dx<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_backward_naive_dparams<{float,__half,__nv_bfloat16}>
// llmgpu:kernel layernorm_backward_warp<{float,__half,__nv_bfloat16}, 1, {0,1,2,3,4,6,8}>
// llmgpu:kernel layernorm_backward_warp<{float,__half,__nv_bfloat16}, 0, 0>
// llmgpu:kernel layernorm_param_grad_reduce<{float,__half,__nv_bfloat16}>

// W consecutive elements moved as one access (16 bytes when sizeof(T) * W == 16), as llm.c's Packed128.
template <typename T, int W>
struct alignas(sizeof(T) * W) LnPack {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[W]) {
    const LnPack<T, W> raw = *reinterpret_cast<const LnPack<T, W>*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(raw.v[k]);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[W]) {
    LnPack<T, W> raw;
#pragma unroll
    for (int k = 0; k < W; ++k) raw.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<LnPack<T, W>*>(p) = raw;
}

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
    float ss = 0.0f;
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    const float d = v[p][k] - m;
                    ss += d * d;
                }
            }
        }
    } else {
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
    }
    const float s = rsqrtf(warp_sum(ss) / (float)C + eps);

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
