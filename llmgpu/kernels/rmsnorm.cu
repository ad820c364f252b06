// rmsnorm.cu: RMSNorm forward and backward over the last axis (Llama's normalization: LayerNorm
// without the mean subtraction and without the bias; Zhang & Sennrich, "Root Mean Square Layer
// Normalization").
//
//   forward   inv_rms = 1 / sqrt(sum(x^2) / C + eps)          (inv_rms[N] saved in fp32)
//             y = x * inv_rms * w
//   backward  xhat = x * inv_rms,  g = dy * w
//             dx = inv_rms * (g - xhat * mean(g * xhat))
//             dw = sum over rows of dy * xhat
//
// The kernels are layernorm.cu's "optimized" generation with one reduction fewer (no mean):
//   rmsnorm_forward   one warp per row. Lane l owns the W-element packs j = l, l + 32, ... (16-byte
//                     loads: W = 4 fp32, 8 fp16/bf16; VEC = 0, W = 1 is the scalar fallback for
//                     C % W != 0 or unaligned pointers). P > 0 holds the row in registers (P packs
//                     per lane, rows up to 32 * P * W): x is read once. P = 0 (longer rows, or the
//                     scalar fallback) reads x a second time for the output, from L1/L2.
//   rmsnorm_backward  one warp per row, each block walking rows blockIdx.x * wpb + warp + k * gridDim.x
//                     * wpb. Lane l always owns the same columns, so it accumulates dw for them over all
//                     the rows its warp visits: P > 0 in registers, P = 0 in shared memory (wpb * C
//                     floats, pack-major: element k of pack j at k * nvec + j, so the lanes of a warp
//                     touch consecutive words). The row is read twice (the second time from L1/L2): dx
//                     needs mean(g * xhat) before it can be written.
//   rmsnorm_weight_grad_reduce  dw from the per-block partial rows.
//   rmsnorm_backward_fast       (method "fast", 16-bit rows of up to 32 * 6 * 8 = 1536) layernorm.cu's
//                               layernorm_backward_fast for RMSNorm: the row held in registers as raw packs
//                               (no second read), the next row's loads issued before the current row is
//                               reduced (two rows in flight per warp), w in shared memory as fp32, dw in
//                               per-warp shared-memory slots, blocks of 4 warps sized for occupancy; its
//                               second stage rmsnorm_weight_grad_finish keeps 8 loads in flight per thread.
// The residual stream around a norm, fused (template flags, the same kernels):
//   rmsnorm_forward<..., ADD = 1>   s = x + a rounded to T (written to s, may be a), y = RMSNorm(s):
//                                   reads x, a; writes s, y (the add + norm pair reads s back once more)
//   rmsnorm_backward<..., RES = 1>  dx = RMSNorm backward + dres (may be written over dres), rounded once:
//                                   reads dres in the kernel (the pair writes dx, reads it back, writes again)
// dw has layernorm.cu's deterministic order, no atomics: lanes add their rows in order, the block adds
// its warps in order w = 0, 1, ... into one row of an fp32 `partial [gridDim.x, C]`, and the second
// kernel sums the blocks in a fixed order and rounds once (to the weight's dtype or fp32, or adds to
// what the gradient buffer holds). Same inputs, same grid, same bits.
//
// Non-finite input: NaN anywhere in a row makes inv_rms and the whole row of y NaN; +-inf in a row
// gives sum(x^2) = inf, inv_rms = 0, y = 0 at finite x and NaN at the inf (inf * 0), as transformers'
// LlamaRMSNorm; so does |x| > ~1.8e19, whose square overflows fp32 (the row of y becomes 0).
#include "common.cuh"

// llmgpu:kernel rmsnorm_forward<{float,__half,__nv_bfloat16}, 1, {0,1,2,3,4,6,8}, {0,1}>
// llmgpu:kernel rmsnorm_forward<{float,__half,__nv_bfloat16}, 0, 0, {0,1}>
// llmgpu:kernel rmsnorm_backward<{float,__half,__nv_bfloat16}, 1, {0,1,2,3,4,6,8}, {0,1}>
// llmgpu:kernel rmsnorm_backward<{float,__half,__nv_bfloat16}, 0, 0, {0,1}>
// llmgpu:kernel rmsnorm_weight_grad_reduce<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel rmsnorm_backward_fast<{__half,__nv_bfloat16}, {1,2,3,4,5,6}, {0,1}>
// llmgpu:kernel rmsnorm_weight_grad_finish<{float,__half,__nv_bfloat16}, {0,1}>

#define RMSNORM_FWD_WARPS 4
#define RMSNORM_BWD_WARPS 8
#define RMSNORM_FAST_WARPS 4

// Pack j of a row as W floats: x's, or with ADD the residual sum s = x + a rounded to T, stored to s
// first (what the next layer and the backward read; the norm below reads these rounded values).
template <typename T, int W, int ADD>
__device__ __forceinline__ void rms_input_pack(const T* __restrict__ x, const T* a, T* s, long long off, int j,
                                               float (&v)[W]) {
    load_pack<T, W>(x + off + j * W, v);
    if constexpr (ADD) {
        float t[W];
        load_pack<T, W>(a + off + j * W, t);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = to_float(from_float<T>(v[k] + t[k]));
        store_pack<T, W>(s + off + j * W, v);
    }
}

// ADD = 1 (add_rmsnorm_forward): the row is s = x + a, written to s, and y = RMSNorm(s) from the
// rounded s. Every sum runs in the order of ADD = 0, so y and inv_rms are bitwise those of
// rmsnorm_forward(s) on the same plan (VEC, P). s may be a itself (in place: residual_out=a): a lane
// reads pack j of a before it writes pack j of s, and no other lane touches it; a and s are therefore
// not __restrict__. With P > 0 all of a lane's loads come before its first store of s (the compiler
// may not move a load of a past a store to s that might alias it; loading first keeps them in flight
// together, as layernorm.cu's add_layernorm_forward_warp). P = 0 (long rows, the scalar fallback)
// adds pack by pack and its second pass reads s back (this lane's own stores).
template <typename T, int VEC, int P, int ADD>
__global__ void __launch_bounds__(32 * RMSNORM_FWD_WARPS)
    rmsnorm_forward(const T* __restrict__ x, const T* a, T* s, const T* __restrict__ w, T* __restrict__ y,
                    float* __restrict__ inv_rms, int N, int C, float eps) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int R = P > 0 ? P : 1;
    using Pack = Packed<T, W>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= N) return;  // whole warps leave together; no barrier follows
    const int nvec = C / W;  // the host guarantees C % W == 0
    const long long off = (long long)row * C;
    const T* src = ADD ? s : x;  // what pass 2 of P = 0 reads again: the row's (rounded) values
    T* yr = y + off;

    // pass 1: sum of squares (and the row kept in registers when P > 0)
    float v[R][W];
    float ss = 0.0f;
    if constexpr (P > 0) {
        Pack rx[P], ra[P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                rx[p] = *reinterpret_cast<const Pack*>(x + off + j * W);
                if constexpr (ADD) ra[p] = *reinterpret_cast<const Pack*>(a + off + j * W);
            }
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                Pack st;
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    st.v[k] = ADD ? from_float<T>(to_float(rx[p].v[k]) + to_float(ra[p].v[k])) : rx[p].v[k];
                    v[p][k] = to_float(st.v[k]);
                }
                if constexpr (ADD) *reinterpret_cast<Pack*>(s + off + j * W) = st;
            } else {
#pragma unroll
                for (int k = 0; k < W; ++k) v[p][k] = 0.0f;  // past the row end: adds nothing
            }
#pragma unroll
            for (int k = 0; k < W; ++k) ss += v[p][k] * v[p][k];
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
            float t[W];
            rms_input_pack<T, W, ADD>(x, a, s, off, j, t);
#pragma unroll
            for (int k = 0; k < W; ++k) ss += t[k] * t[k];
        }
    }
    const float r = rsqrtf(warp_sum(ss) / (float)C + eps);

    // pass 2: scale, one store per pack
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                float g[W], o[W];
                load_pack<T, W>(w + j * W, g);
#pragma unroll
                for (int k = 0; k < W; ++k) o[k] = v[p][k] * r * g[k];
                store_pack<T, W>(yr + (long long)j * W, o);
            }
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
            float t[W], g[W], o[W];
            load_pack<T, W>(src + off + (long long)j * W, t);
            load_pack<T, W>(w + j * W, g);
#pragma unroll
            for (int k = 0; k < W; ++k) o[k] = t[k] * r * g[k];
            store_pack<T, W>(yr + (long long)j * W, o);
        }
    }
    if (lane == 0) inv_rms[row] = r;
}

// Pack j of a row: adds dy * xhat to acc[k] and returns the pack's share of sum(g * xhat).
template <typename T, int W>
__device__ __forceinline__ float rms_row_terms(const T* __restrict__ dy, const T* __restrict__ x,
                                               const T* __restrict__ w, long long off, int j, float r,
                                               float (&acc)[W]) {
    float d[W], xv[W], ga[W];
    load_pack<T, W>(dy + off + j * W, d);
    load_pack<T, W>(x + off + j * W, xv);
    load_pack<T, W>(w + j * W, ga);
    float sum_gx = 0.0f;
#pragma unroll
    for (int k = 0; k < W; ++k) {
        const float xh = xv[k] * r;
        sum_gx += d[k] * ga[k] * xh;
        acc[k] += d[k] * xh;
    }
    return sum_gx;
}

// Pack j of a row's dx = r * (g - xhat * mgx) (+ res, the residual gradient's pack: RES = 1), g = dy * w,
// xhat = x * r; rounded once.
template <typename T, int W, int RES>
__device__ __forceinline__ void rms_store_dx(const T* __restrict__ dy, const T* __restrict__ x,
                                             const T* __restrict__ w, T* dx, long long off, int j,
                                             float r, float mgx, const float (&res)[W]) {
    float d[W], xv[W], ga[W], o[W];
    load_pack<T, W>(dy + off + j * W, d);
    load_pack<T, W>(x + off + j * W, xv);
    load_pack<T, W>(w + j * W, ga);
#pragma unroll
    for (int k = 0; k < W; ++k) {
        o[k] = r * (d[k] * ga[k] - xv[k] * r * mgx);
        if constexpr (RES) o[k] = __fadd_rn(o[k], res[k]);  // no fma with the product: in fp32 storage dx
                                                              // is bitwise the backward followed by an add
    }
    store_pack<T, W>(dx + off + j * W, o);
}

// RES = 1: dx = the RMSNorm gradient + dres (the gradient of the residual branch around the norm), in fp32
// and rounded once: one read of dres instead of a separate add kernel (which would read dx back and
// write it again). dx may be dres itself (in place): a lane reads pack j of dres before it writes pack j
// of dx, and no other lane touches it; dres and dx are therefore not __restrict__. With P > 0 and room
// beside the dw accumulators (P * W <= 48 floats) a lane loads its dres packs of the row in pass 1, next
// to dy and x and before its first store of dx (a load may not pass a store that might alias it), and
// holds them in registers. Otherwise (P = 0; 16-bit P = 8, which spilled holding them on sm_90, also
// when they were loaded at the start of pass 2) each pack is loaded just before its store.
// Shared memory: P > 0: C floats (the block's in-order sum at the end); P = 0: wpb * C floats.
// Launch bounds with a minimum of 2 blocks per SM (at most 128 registers a thread): with the block
// size alone, ptxas (CUDA 13, sm_80/sm_90) capped the 16-bit instantiations at 48 registers and spilled.
template <typename T, int VEC, int P, int RES>
__global__ void __launch_bounds__(32 * RMSNORM_BWD_WARPS, 2)
    rmsnorm_backward(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                     const float* __restrict__ inv_rms, const T* dres, T* dx, float* __restrict__ partial, int N,
                     int C) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int R = P > 0 ? P : 1;
    constexpr bool HOLD = RES && P > 0 && P * W <= 48;  // dres packs loaded in pass 1, held in registers
    constexpr int RR = HOLD ? P : 1;
    using Pack = Packed<T, W>;
    extern __shared__ float rms_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const int nvec = C / W;
    const float inv_c = 1.0f / (float)C;

    float adw[R][W];
    float* acc = rms_smem + warp * C;  // P == 0: this warp's dw, pack-major
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
            for (int k = 0; k < W; ++k) adw[p][k] = 0.0f;
        }
    } else {
        for (int j = lane; j < nvec; j += 32) {
#pragma unroll
            for (int k = 0; k < W; ++k) acc[k * nvec + j] = 0.0f;
        }
    }

    for (int row = blockIdx.x * wpb + warp; row < N; row += gridDim.x * wpb) {
        const long long off = (long long)row * C;
        const float r = inv_rms[row];
        float sum_gx = 0.0f;
        Pack rres[RR];
        // pass 1: mean(g * xhat), and this row's share of dw (registers: packs p = 0..P-1, unrolled, so
        // adw is indexed by constants; shared memory: any number of packs)
        if constexpr (P > 0) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int j = lane + 32 * p;
                if (j < nvec) {
                    if constexpr (HOLD) rres[p] = *reinterpret_cast<const Pack*>(dres + off + j * W);
                    sum_gx += rms_row_terms<T, W>(dy, x, w, off, j, r, adw[p]);
                }
            }
        } else {
            for (int j = lane; j < nvec; j += 32) {
                float t[W];
#pragma unroll
                for (int k = 0; k < W; ++k) t[k] = 0.0f;
                sum_gx += rms_row_terms<T, W>(dy, x, w, off, j, r, t);
#pragma unroll
                for (int k = 0; k < W; ++k) acc[k * nvec + j] += t[k];
            }
        }
        const float mgx = warp_sum(sum_gx) * inv_c;
        // pass 2: dx
        float t[W];
        if constexpr (P > 0) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int j = lane + 32 * p;
                if (j < nvec) {
                    if constexpr (HOLD) {
#pragma unroll
                        for (int k = 0; k < W; ++k) t[k] = to_float(rres[p].v[k]);
                    } else if constexpr (RES) {
                        load_pack<T, W>(dres + off + j * W, t);
                    }
                    rms_store_dx<T, W, RES>(dy, x, w, dx, off, j, r, mgx, t);
                }
            }
        } else {
            for (int j = lane; j < nvec; j += 32) {
                if constexpr (RES) load_pack<T, W>(dres + off + j * W, t);
                rms_store_dx<T, W, RES>(dy, x, w, dx, off, j, r, mgx, t);
            }
        }
    }

    // the block's partial row, warps added in the fixed order 0, 1, ..., wpb - 1
    float* out = partial + (long long)blockIdx.x * C;
    if constexpr (P > 0) {
        for (int wi = 0; wi < wpb; ++wi) {
            if (warp == wi) {
#pragma unroll
                for (int p = 0; p < P; ++p) {
                    const int j = lane + 32 * p;
                    if (j < nvec) {
#pragma unroll
                        for (int k = 0; k < W; ++k) {
                            const int c = j * W + k;
                            rms_smem[c] = (wi == 0) ? adw[p][k] : rms_smem[c] + adw[p][k];
                        }
                    }
                }
            }
            __syncthreads();
        }
        for (int c = threadIdx.x; c < C; c += blockDim.x) out[c] = rms_smem[c];
    } else {
        __syncthreads();
        for (int q = threadIdx.x; q < C; q += blockDim.x) {  // q: pack-major position k * nvec + j
            const int k = q / nvec, j = q - k * nvec;
            float t = 0.0f;
            for (int wi = 0; wi < wpb; ++wi) t += rms_smem[wi * C + q];
            out[j * W + k] = t;
        }
    }
}

// dw[c] = sum_b partial[b, c] in a fixed order, rounded once to TO (the weight's dtype or fp32), or with
// ACC = 1 added to what dw holds (in fp32: a model accumulates straight into its fp32 gradient buffer).
// Block (32, 16): x walks 32 consecutive columns (coalesced), y splits the blocks (thread y takes
// b = y, y + 16, ...); the 16 partial sums are then added in order y = 0..15.
template <typename TO, int ACC>
__global__ void __launch_bounds__(512) rmsnorm_weight_grad_reduce(const float* __restrict__ partial, int nparts,
                                                                  int C, TO* __restrict__ dw) {
    __shared__ float red[16][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;
    float t = 0.0f;
    if (col < C) {
        for (int b = ty; b < nparts; b += 16) t += partial[(long long)b * C + col];
    }
    red[ty][tx] = t;
    __syncthreads();
    if (ty == 0 && col < C) {
        float s = red[0][tx];
#pragma unroll
        for (int k = 1; k < 16; ++k) s += red[k][tx];
        dw[col] = from_float<TO>(ACC ? to_float(dw[col]) + s : s);
    }
}

// ------------------------------------------------------------------------------------ "fast" backward
// Why "optimized" stays below a copy at Llama's rows (issue 36: 72-74 % of copy bandwidth at C = 960,
// bf16, with dresidual): each warp owns one row at a time, so its loads for the next row wait until this
// row's dx is stored; the row is read twice (pass 2 from L1/L2); 108 registers per thread leave 2 blocks of
// 8 warps per SM; and the second stage adds the partial rows one dependent load at a time per thread. The
// fast kernel removes each of those. dx is computed with the same expressions in the same order as
// rmsnorm_backward (per-pack sums, then the packs in order, then the warp butterfly), dw in another
// (fixed) order, since the grid differs.

// Register estimate per thread and blocks per SM asked of the compiler: two rows of raw packs (dy, x and
// dres: 2 x (2 + RES) x 4 P registers) plus addresses and temporaries; dw is in shared memory. Up to P = 4
// the counts of layernorm.cu's LnFastPlan with shared-memory accumulators (RMSNorm needs fewer registers
// than LayerNorm: no mean, one accumulator); longer rows: as many blocks as the estimate allows.
template <typename T, int P, int RES>
struct RmsFastPlan {
    static constexpr int W = 16 / (int)sizeof(T);
    static constexpr int threads = 32 * RMSNORM_FAST_WARPS;
    static constexpr int regs = 2 * (2 + RES) * 4 * P + 32;
    static constexpr int long_blocks = 65536 / (threads * (regs + 16)) > 0 ? 65536 / (threads * (regs + 16)) : 1;
    static constexpr int min_blocks = P > 4 ? long_blocks : RES ? (P <= 2 ? 6 : P == 3 ? 5 : 4) : (P <= 3 ? 6 : 5);
};

// One row's share of this lane: packs j = lane + 32 p (p < P, j < nvec) of dy, x (and dres) as raw 16-byte
// streaming loads, and the row's inv_rms.
template <typename T, int P, int RES>
__device__ __forceinline__ void rms_load_row(const T* __restrict__ dy, const T* __restrict__ x, const T* dres,
                                             const float* __restrict__ inv_rms, int row, int C, int lane, int nvec,
                                             Packed<T, 16 / (int)sizeof(T)> (&d)[P],
                                             Packed<T, 16 / (int)sizeof(T)> (&xs)[P],
                                             Packed<T, 16 / (int)sizeof(T)> (&rr)[P], float& r) {
    constexpr int W = 16 / (int)sizeof(T);
    const long long off = (long long)row * C + lane * W;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (lane + 32 * p < nvec) {
            d[p] = load_raw16_stream(dy + off + 32 * W * p);
            xs[p] = load_raw16_stream(x + off + 32 * W * p);
            if constexpr (RES) rr[p] = load_raw16_stream(dres + off + 32 * W * p);
        }
    }
    r = inv_rms[row];
}

// One warp per row, rows gw, gw + nw, ... (gw = global warp id, nw = warps in the grid); blockDim.x ==
// RmsFastPlan::threads. Dynamic shared memory: 16 * 32 * P * Q * (1 + warps) bytes: w as fp32 float4s, then
// every warp's dw slots (float4 slot (p, q) of lane l at (p * Q + q) * 32 + l: each lane only touches its
// own slots, conflict-free, until the block's sum at the end). RES = 1: dx = the RMSNorm gradient + dres,
// dres may be dx itself (a lane loads its packs of a row, this row and the next, before it stores that
// row's dx, and no other lane touches them). Each block writes one row of partial [gridDim.x, C].
template <typename T, int P, int RES>
__global__ void __launch_bounds__((RmsFastPlan<T, P, RES>::threads), (RmsFastPlan<T, P, RES>::min_blocks))
    rmsnorm_backward_fast(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                          const float* __restrict__ inv_rms, const T* dres, T* dx, float* __restrict__ partial,
                          int N, int C) {
    constexpr int W = 16 / (int)sizeof(T);
    constexpr int Q = W / 4;  // float4s per pack
    using Pack = Packed<T, W>;
    extern __shared__ float4 rms_fast_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const int nvec = C / W;  // the host guarantees C % W == 0 and nvec <= 32 * P
    const float inv_c = 1.0f / (float)C;
    const int nw = gridDim.x * wpb;
    int row = blockIdx.x * wpb + warp;

    // the first row's loads go out before the tables are built: they do not need them
    Pack cd[P], cx[P], cr[P];
    float cs = 0.0f;
    if (row < N) rms_load_row<T, P, RES>(dy, x, dres, inv_rms, row, C, lane, nvec, cd, cx, cr, cs);

    for (int i = threadIdx.x; i < nvec * Q; i += blockDim.x) {  // w -> fp32 float4 (p, q) of lane l
        const int j = i / Q, q = i - j * Q;
        const int p = j >> 5, l = j & 31;
        const T* g = w + j * W + 4 * q;
        rms_fast_smem[(p * Q + q) * 32 + l] = make_float4(to_float(g[0]), to_float(g[1]), to_float(g[2]),
                                                          to_float(g[3]));
    }
    float4* sacc = rms_fast_smem + (P * Q + P * Q * warp) * 32 + lane;  // this lane's dw slots
#pragma unroll
    for (int i = 0; i < P * Q; ++i) sacc[i * 32] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    __syncthreads();

    for (; row < N; row += nw) {
        // 1. the next row's loads first: they travel while this row is reduced and stored
        const int nxt = row + nw;
        Pack nd[P], nx[P], nr[P];
        float ns = 0.0f;
        if (nxt < N) rms_load_row<T, P, RES>(dy, x, dres, inv_rms, nxt, C, lane, nvec, nd, nx, nr, ns);

        // 2. sum(g * xhat) (rms_row_terms' order: within a pack, then the packs) and this row's dw share
        float sum_gx = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
                float part = 0.0f;
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const float4 g4 = rms_fast_smem[(p * Q + q) * 32 + lane];
                    const float ga[4] = {g4.x, g4.y, g4.z, g4.w};
                    float dwq[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int k = 4 * q + e;
                        const float d = pack_elem(cd[p], k);
                        const float xh = pack_elem(cx[p], k) * cs;
                        part += d * ga[e] * xh;
                        dwq[e] = d * xh;
                    }
                    float4* sa = sacc + (p * Q + q) * 32;
                    float4 a = *sa;
                    a.x += dwq[0]; a.y += dwq[1]; a.z += dwq[2]; a.w += dwq[3];
                    *sa = a;
                }
                sum_gx += part;
            }
        }
        const float mgx = warp_sum(sum_gx) * inv_c;

        // 3. dx (+ dres), rms_store_dx's expression, one 16-byte store per pack
        T* dxr = dx + (long long)row * C + lane * W;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
                Pack o;
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const float4 g4 = rms_fast_smem[(p * Q + q) * 32 + lane];
                    const float ga[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int k = 4 * q + e;
                        float v = cs * (pack_elem(cd[p], k) * ga[e] - pack_elem(cx[p], k) * cs * mgx);
                        if constexpr (RES) v = __fadd_rn(v, pack_elem(cr[p], k));
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
        cs = ns;
    }

    // the block's partial row: thread t adds columns t, t + blockDim.x, ... over the warps in order 0, 1, ...
    __syncthreads();
    const float* slots = reinterpret_cast<const float*>(rms_fast_smem + P * Q * 32);
    float* out = partial + (long long)blockIdx.x * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int j = c / W, k = c - j * W;  // pack j (lane j & 31, its pack j >> 5), element k
        const int slot = ((((j >> 5) * Q + (k >> 2)) * 32 + (j & 31)) << 2) + (k & 3);
        float t = slots[slot];
        for (int wi = 1; wi < wpb; ++wi) t += slots[(long long)wi * (P * Q * 32 * 4) + slot];
        out[c] = t;
    }
}

// Second stage of the fast backward: dw[c] = sum_b partial[b, c] in a fixed order, rounded once to TO (or, with
// ACC = 1, added to what dw holds, in fp32). layernorm.cu's layernorm_param_grad_finish for one gradient:
// block (32, 32), 32 columns per block; thread (x, y) sums blocks b = y, y + 32, ... with eight independent
// loads in flight (the sum is latency-bound: a few MB at most), then warp y adds the 32 partial sums of
// column y with a butterfly.
template <typename TO, int ACC>
__global__ void __launch_bounds__(1024) rmsnorm_weight_grad_finish(const float* __restrict__ partial, int nparts,
                                                                   int C, TO* __restrict__ dw) {
    __shared__ float red[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * 32 + tx;
    float t = 0.0f;
    if (col < C) {
        const float* src = partial + col;
        int b = ty;
        for (; b + 7 * 32 < nparts; b += 8 * 32) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = src[(long long)(b + 32 * i) * C];
#pragma unroll
            for (int i = 0; i < 8; ++i) t += v[i];
        }
        for (; b < nparts; b += 32) t += src[(long long)b * C];
    }
    red[ty][tx] = t;
    __syncthreads();
    const float r = warp_sum(red[tx][ty]);  // warp ty: column blockIdx.x * 32 + ty, over the 32 rows
    const int c = blockIdx.x * 32 + ty;
    if (tx == 0 && c < C) dw[c] = from_float<TO>(ACC ? to_float(dw[c]) + r : r);
}
