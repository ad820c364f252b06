// cross_entropy.cu: softmax + cross-entropy loss over a vocabulary, forward and backward (chapter 3).
//
// For a row of logits x[0..V) and its target t:
//   lse  = log sum_v exp(x_v)          (computed as m + log sum exp(x_v - m), m = max x)
//   loss = lse - x_t                   (= -log softmax(x)_t, never forming the probability)
//   dx_v = (exp(x_v - lse) - [v == t]) * dloss / n_valid
// and the batch loss is the mean over rows whose target is not ignore_index.
//
// Fused (the optimized path): one block per row reads the logits once in the forward, keeping a
// running (max m, sum s) pair per thread -- the online softmax of Milakov & Gimelshein, "Online
// normalizer calculation for softmax" (2018): when a larger value arrives, s is rescaled by
// exp(m_old - m_new) -- then merges the pairs across the block. Only lse (4 bytes per row) is
// saved. The backward reads the logits once more and writes dlogits once: softmax is recomputed
// from lse on the fly, never stored.
// Unfused (the naive path, what "softmax, then loss" does): a softmax kernel reads the row three
// times (max, sum, write) and writes the N x V probabilities; the loss kernel takes -log p_t, and
// the backward reads the probabilities back. That is a full extra write and read of N x V -- at
// GPT-2's V = 50257 the largest tensor of the model -- and -log p_t is inf as soon as p_t
// underflows, where lse - x_t stays finite.
//
// Loads: rows of V elements start wherever V * row * sizeof(T) puts them (V = 50257 is odd), so the
// fused kernels walk each row as head (scalar, up to the first 16-byte boundary), body (16-byte
// packs) and tail (scalar).
//
// Targets (int or long long): t == ignore_index -> loss 0 and a zero gradient row, and the row does
// not count in n_valid. t outside [0, V) otherwise -> the kernel does not read out of bounds; the
// row's loss is NaN (so the mean loss is NaN) and its gradient row is NaN: loud, never silently
// wrong. The NumPy path raises ValueError instead. All rows ignored -> loss 0, gradient 0.
#include "common.cuh"

// llmgpu:kernel cross_entropy_forward_fused<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel cross_entropy_backward_fused<{float,__half,__nv_bfloat16}, {int,long long}, {0,1}>
// llmgpu:kernel cross_entropy_mean<{int,long long}>
// llmgpu:kernel cross_entropy_softmax_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel cross_entropy_nll_naive<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel cross_entropy_backward_naive<{float,__half,__nv_bfloat16}, {int,long long}>

#define CE_NAN __int_as_float(0x7fffffff)

template <typename T, int W>
struct alignas(sizeof(T) * W) CePack {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[W]) {
    const CePack<T, W> raw = *reinterpret_cast<const CePack<T, W>*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(raw.v[k]);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[W]) {
    CePack<T, W> raw;
#pragma unroll
    for (int k = 0; k < W; ++k) raw.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<CePack<T, W>*>(p) = raw;
}

// Elements of a row before its first 16-byte boundary (a row pointer is always sizeof(T)-aligned).
template <typename T>
__device__ __forceinline__ int head_elements(const T* row, int V) {
    constexpr int W = 16 / (int)sizeof(T);
    const int mis = (int)((reinterpret_cast<unsigned long long>(row) & 15ull) / sizeof(T));
    return min(V, mis ? W - mis : 0);
}

// ---------------------------------------------------------------- online softmax: (max, sum) pairs

// exp: __expf (the hardware exp2 on x * log2(e)), ~2 ulp plus ~1 ulp per unit of |x|: a relative
// error of ~1e-6 on terms that are summed (lse) or already far below 1 (the gradient), and a few
// instructions instead of expf's ~10 -- at 4 TB/s and 2 bytes per bf16 logit, the arithmetic
// budget per element is only ~15 instructions.

// Add one value. -inf contributes nothing; NaN poisons s (and so the loss).
__device__ __forceinline__ void online_add(float& m, float& s, float v) {
    if (v > m) {
        s = (m == -LLMGPU_INF) ? s : s * __expf(m - v);
        s += 1.0f;
        m = v;
    } else if (v != -LLMGPU_INF) {
        s += __expf(v - m);
    }
}

// Add a pack of W values: one max, at most one rescale, W exps (no per-element branch).
template <int W>
__device__ __forceinline__ void online_add_pack(float& m, float& s, const float (&v)[W]) {
    float pm = v[0];
#pragma unroll
    for (int k = 1; k < W; ++k) pm = fmaxf(pm, v[k]);  // fmaxf skips NaN; the sum below catches it
    if (pm > m) {
        s = (m == -LLMGPU_INF) ? s : s * __expf(m - pm);
        m = pm;
    }
    if (m != -LLMGPU_INF) {
#pragma unroll
        for (int k = 0; k < W; ++k) s += __expf(v[k] - m);
    } else {
#pragma unroll
        for (int k = 0; k < W; ++k) {
            if (v[k] != -LLMGPU_INF) s += __expf(v[k] - m);  // only NaN gets here: s becomes NaN
        }
    }
}

// Merge (m2, s2) into (m, s). A pair with m = -inf has s = 0 (or NaN, which must survive).
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    const float a = (m == -LLMGPU_INF) ? s : s * __expf(m - M);
    const float b = (m2 == -LLMGPU_INF) ? s2 : s2 * __expf(m2 - M);
    s = a + b;
    m = M;
}

// Merge every thread's pair; every thread returns lse = m + log(s). blockDim.x % 32 == 0.
__device__ __forceinline__ float block_logsumexp(float m, float s) {
    __shared__ float sm_m[32], sm_s[32], sm_lse;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        online_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? sm_m[lane] : -LLMGPU_INF;
        s = lane < nwarps ? sm_s[lane] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
            online_merge(m, s, m2, s2);
        }
        if (lane == 0) sm_lse = m + logf(s);
    }
    __syncthreads();
    return sm_lse;
}

// ------------------------------------------------------------------------------------- fused

// Block per row (grid = N). Writes lse[row] and loss_rows[row] (0 for ignored rows, NaN for a bad
// target); cross_entropy_mean turns loss_rows into the mean.
template <typename T, typename TI>
__global__ void __launch_bounds__(1024) cross_entropy_forward_fused(const T* __restrict__ logits,
                                                                    const TI* __restrict__ targets,
                                                                    float* __restrict__ lse,
                                                                    float* __restrict__ loss_rows, int V,
                                                                    long long ignore_index) {
    constexpr int W = 16 / (int)sizeof(T);
    const long long row = blockIdx.x;
    const T* xr = logits + row * V;
    float m = -LLMGPU_INF, s = 0.0f;
    const int head = head_elements(xr, V);
    for (int i = threadIdx.x; i < head; i += blockDim.x) online_add(m, s, to_float(xr[i]));
    const int nvec = (V - head) / W;
    const T* body = xr + head;
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
        float v[W];
        load_pack<T, W>(body + (long long)j * W, v);
        online_add_pack<W>(m, s, v);
    }
    for (int i = head + nvec * W + threadIdx.x; i < V; i += blockDim.x) online_add(m, s, to_float(xr[i]));
    const float L = block_logsumexp(m, s);
    if (threadIdx.x == 0) {
        const long long t = (long long)targets[row];
        float loss;
        if (t == ignore_index) {
            loss = 0.0f;
        } else if (t < 0 || t >= V) {
            loss = CE_NAN;  // out-of-range target: loud, and no out-of-bounds read
        } else {
            loss = L - to_float(xr[t]);
        }
        lse[row] = L;
        loss_rows[row] = loss;
    }
}

// One block: loss = sum(loss_rows) / max(n_valid, 1), n_valid = #(targets != ignore_index).
// Thread i takes rows i, i + blockDim.x, ... in order; the block reduction is a fixed tree:
// the same bits every run.
template <typename TI>
__global__ void __launch_bounds__(1024) cross_entropy_mean(const float* __restrict__ loss_rows,
                                                           const TI* __restrict__ targets, int N,
                                                           long long ignore_index, float* __restrict__ loss,
                                                           int* __restrict__ n_valid) {
    __shared__ float scratch[32];
    __shared__ int iscratch[32];
    float s = 0.0f;
    int c = 0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        s += loss_rows[i];
        c += ((long long)targets[i] != ignore_index) ? 1 : 0;
    }
    s = block_sum(s, scratch);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(0xffffffffu, c, off);
    if (lane == 0) iscratch[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < nwarps; ++w) total += iscratch[w];
        *n_valid = total;
        *loss = s / (float)max(total, 1);
    }
}

// Block per row. dlogits may be the logits buffer itself (in place): every element is read before
// it is written, by the same thread. VEC = 1 needs dlogits and logits to share their offset modulo
// 16 bytes (the host checks), so one head/body/tail split serves both.
// dloss comes from dloss_dev[0] when use_dloss_dev != 0 (a device scalar, e.g. a loss scale), else
// from dloss_host.
template <typename T, typename TI, int VEC>
__global__ void __launch_bounds__(1024) cross_entropy_backward_fused(
    const T* logits, const TI* __restrict__ targets, const float* __restrict__ lse, const int* __restrict__ n_valid,
    const float* __restrict__ dloss_dev, int use_dloss_dev, float dloss_host, T* dlogits, int V,
    long long ignore_index) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const long long row = blockIdx.x;
    const T* xr = logits + row * V;
    T* gr = dlogits + row * V;
    const long long t = (long long)targets[row];
    if (t == ignore_index || t < 0 || t >= V) {
        // ignored: zeros; out of range: NaN. The logits are not read.
        const T fill = from_float<T>(t == ignore_index ? 0.0f : CE_NAN);
        for (int i = threadIdx.x; i < V; i += blockDim.x) gr[i] = fill;
        return;
    }
    const float dloss = use_dloss_dev ? dloss_dev[0] : dloss_host;
    const float scale = dloss / (float)max(n_valid[0], 1);
    const float L = lse[row];
    const int head = VEC ? head_elements(xr, V) : 0;
    for (int i = threadIdx.x; i < head; i += blockDim.x) {
        gr[i] = from_float<T>((__expf(to_float(xr[i]) - L) - (i == t ? 1.0f : 0.0f)) * scale);
    }
    const int nvec = (V - head) / W;
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
        const int i0 = head + j * W;
        float v[W];
        load_pack<T, W>(xr + i0, v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = (__expf(v[k] - L) - (i0 + k == t ? 1.0f : 0.0f)) * scale;
        store_pack<T, W>(gr + i0, v);
    }
    for (int i = head + nvec * W + threadIdx.x; i < V; i += blockDim.x) {
        gr[i] = from_float<T>((__expf(to_float(xr[i]) - L) - (i == t ? 1.0f : 0.0f)) * scale);
    }
}

// ------------------------------------------------------------------------------------- unfused

// Block per row, three scalar passes: max, sum of exp, write the probabilities (N x V).
template <typename T>
__global__ void cross_entropy_softmax_naive(const T* __restrict__ logits, T* __restrict__ probs, int V) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * V;
    float m = -LLMGPU_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, to_float(logits[off + i]));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(to_float(logits[off + i]) - m);
    s = block_sum(s, scratch);
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        probs[off + i] = from_float<T>(expf(to_float(logits[off + i]) - m) / s);
    }
}

// Thread per row: loss_rows[row] = -log p[row, t] (from the stored probabilities).
template <typename T, typename TI>
__global__ void cross_entropy_nll_naive(const T* __restrict__ probs, const TI* __restrict__ targets,
                                        float* __restrict__ loss_rows, int N, int V, long long ignore_index) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const long long t = (long long)targets[row];
    float loss;
    if (t == ignore_index) {
        loss = 0.0f;
    } else if (t < 0 || t >= V) {
        loss = CE_NAN;
    } else {
        loss = -logf(to_float(probs[(long long)row * V + t]));
    }
    loss_rows[row] = loss;
}

// Thread per element (grid-stride): dlogits = (p - onehot) * dloss / n_valid, from the stored p.
template <typename T, typename TI>
__global__ void cross_entropy_backward_naive(const T* __restrict__ probs, const TI* __restrict__ targets,
                                             const int* __restrict__ n_valid, const float* __restrict__ dloss_dev,
                                             int use_dloss_dev, float dloss_host, T* __restrict__ dlogits,
                                             long long N, int V, long long ignore_index) {
    const float dloss = use_dloss_dev ? dloss_dev[0] : dloss_host;
    const float scale = dloss / (float)max(n_valid[0], 1);
    const long long n = N * V;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long row = i / V;
        const long long col = i - row * V;
        const long long t = (long long)targets[row];
        float g;
        if (t == ignore_index) {
            g = 0.0f;
        } else if (t < 0 || t >= V) {
            g = CE_NAN;
        } else {
            g = (to_float(probs[i]) - (col == t ? 1.0f : 0.0f)) * scale;
        }
        dlogits[i] = from_float<T>(g);
    }
}
