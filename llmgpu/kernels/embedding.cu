// embedding.cu: token + position embedding, forward and backward (chapter 3).
//
//   forward   x[b, t, :] = wte[idx[b, t], :] + wpe[t, :]
//   backward  dwpe[t, :] = sum_b dx[b, t, :]
//             dwte[v, :] = sum over all (b, t) with idx[b, t] == v of dx[b, t, :]
//
// The forward is a gather, the backward of a gather is a scatter-add: many (b, t) rows land on the
// same row of dwte (every "the", every ","), and nothing tells a thread which other threads write
// its row. The short answer is a float atomicAdd per element (embedding_backward_naive): correct up
// to rounding, but the rounding depends on the order in which the atomics happen to land, so dwte
// changes in its last bits from run to run, and thousands of atomics on one hot row serialize.
//
// The deterministic answer turns the scatter into a gather: sort the (token, position) pairs by
// token, and give each token row of dwte to one group of threads, which sums its positions in
// ascending order. Here the sort key is token * (B*T) + position (an int64), so the sorted order
// is unique and its runs are the tokens; embedding_segment_starts finds where each token's run
// starts by binary search. Then embedding_backward_wte writes every row of dwte exactly once
// (zero for tokens that do not occur), and the result is bitwise identical run to run.
// dwpe is a plain sum over the batch in order b = 0..B-1 (embedding_backward_wpe).
//
// Token ids outside [0, V): the forward writes NaN in that row of x (loud, no out-of-bounds read);
// the backward drops those positions from dwte (their gradient has nowhere to go) but keeps them in
// dwpe. The NumPy path raises ValueError instead.
#include "common.cuh"

// llmgpu:kernel embedding_forward_naive<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel embedding_forward<{float,__half,__nv_bfloat16}, {int,long long}, {0,1}>
// llmgpu:kernel embedding_backward_naive<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel embedding_make_keys<{int,long long}>
// llmgpu:kernel embedding_segment_starts
// llmgpu:kernel embedding_backward_wte<{float,__half,__nv_bfloat16}, {0,1}>
// llmgpu:kernel embedding_backward_wpe<{float,__half,__nv_bfloat16}, {0,1}>

#define EMB_NAN __int_as_float(0x7fffffff)

template <typename T, int W>
struct alignas(sizeof(T) * W) EmbPack {
    T v[W];
};

template <typename T, int W>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[W]) {
    const EmbPack<T, W> raw = *reinterpret_cast<const EmbPack<T, W>*>(p);
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(raw.v[k]);
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[W]) {
    EmbPack<T, W> raw;
#pragma unroll
    for (int k = 0; k < W; ++k) raw.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<EmbPack<T, W>*>(p) = raw;
}

// ------------------------------------------------------------------------------------ forward

// One thread per output element.
template <typename T, typename TI>
__global__ void embedding_forward_naive(const TI* __restrict__ idx, const T* __restrict__ wte,
                                        const T* __restrict__ wpe, T* __restrict__ out, long long BT, int Tlen,
                                        int C, int V) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT * C) return;
    const long long row = i / C;
    const int c = (int)(i - row * C);
    const int t = (int)(row % Tlen);
    const long long id = (long long)idx[row];
    if (id < 0 || id >= V) {
        out[i] = from_float<T>(EMB_NAN);
        return;
    }
    out[i] = from_float<T>(to_float(wte[id * C + c]) + to_float(wpe[(long long)t * C + c]));
}

// Grid (B*T, ceil(nvec / blockDim.x)): block x = one output row, threads over its 16-byte packs.
// VEC = 1 needs C % W == 0 and 16-byte aligned wte, wpe, out (the host checks).
template <typename T, typename TI, int VEC>
__global__ void __launch_bounds__(256) embedding_forward(const TI* __restrict__ idx, const T* __restrict__ wte,
                                                         const T* __restrict__ wpe, T* __restrict__ out, int Tlen,
                                                         int C, int V) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const int nvec = C / W;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= nvec) return;
    const long long row = blockIdx.x;
    const int t = (int)(row % Tlen);
    const long long id = (long long)idx[row];
    float o[W];
    if (id < 0 || id >= V) {
#pragma unroll
        for (int k = 0; k < W; ++k) o[k] = EMB_NAN;
    } else {
        float a[W], b[W];
        load_pack<T, W>(wte + id * C + (long long)j * W, a);
        load_pack<T, W>(wpe + (long long)t * C + (long long)j * W, b);
#pragma unroll
        for (int k = 0; k < W; ++k) o[k] = a[k] + b[k];
    }
    store_pack<T, W>(out + row * C + (long long)j * W, o);
}

// ------------------------------------------------------------------------------------ backward

// Naive: one thread per element of dx (grid-stride), float atomics into fp32 dwte [V, C] and
// dwpe [maxT, C] that the host zeroed. Nondeterministic in the last bits: that is the lesson.
template <typename T, typename TI>
__global__ void embedding_backward_naive(const T* __restrict__ dx, const TI* __restrict__ idx,
                                         float* __restrict__ dwte, float* __restrict__ dwpe, long long BT, int Tlen,
                                         int C, int V) {
    const long long n = BT * C;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long row = i / C;
        const int c = (int)(i - row * C);
        const int t = (int)(row % Tlen);
        const float g = to_float(dx[i]);
        const long long id = (long long)idx[row];
        if (id >= 0 && id < V) atomicAdd(dwte + id * C + c, g);
        atomicAdd(dwpe + (long long)t * C + c, g);
    }
}

// keys[i] = token(i) * BT + i, the token clamped to [-1, V] first (so the product cannot overflow;
// -1 and V are "out of range" and end up outside every token's run).
template <typename TI>
__global__ void embedding_make_keys(const TI* __restrict__ idx, long long BT, int V, long long* __restrict__ keys) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT) return;
    long long id = (long long)idx[i];
    id = id < 0 ? -1 : (id > V ? V : id);
    keys[i] = id * BT + i;
}

// starts[v] = first index q of the sorted keys with keys[q] >= v * BT, for v = 0..V (lower bound).
// Token v's positions are keys[starts[v] .. starts[v + 1]).
__global__ void embedding_segment_starts(const long long* __restrict__ keys, long long BT, int V,
                                         long long* __restrict__ starts) {
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v > V) return;
    const long long target = (long long)v * BT;
    long long lo = 0, hi = BT;  // search in [lo, hi)
    while (lo < hi) {
        const long long mid = lo + ((hi - lo) >> 1);
        if (keys[mid] < target) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    starts[v] = lo;
}

// Grid (V, ceil(nvec / blockDim.x)): block x = token v, threads over the packs of its dwte row.
// Sums dx rows of the token's positions in ascending position order; writes the row exactly once.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) embedding_backward_wte(const T* __restrict__ dx,
                                                              const long long* __restrict__ keys,
                                                              const long long* __restrict__ starts,
                                                              T* __restrict__ dwte, int C, long long BT) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const int nvec = C / W;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= nvec) return;
    const long long v = blockIdx.x;
    const long long q0 = starts[v], q1 = starts[v + 1];
    const long long base = v * BT;
    float acc[W];
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = 0.0f;
#pragma unroll 4
    for (long long q = q0; q < q1; ++q) {
        const long long pos = keys[q] - base;
        float d[W];
        load_pack<T, W>(dx + pos * C + (long long)j * W, d);
#pragma unroll
        for (int k = 0; k < W; ++k) acc[k] += d[k];
    }
    store_pack<T, W>(dwte + v * C + (long long)j * W, acc);
}

// Grid (maxT, ceil(nvec / blockDim.x)): dwpe[t] = sum_b dx[b, t] in order b = 0..B-1; rows
// t >= T (positions this batch did not use) are written as zeros.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) embedding_backward_wpe(const T* __restrict__ dx, T* __restrict__ dwpe,
                                                              int B, int Tlen, int C) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    const int nvec = C / W;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= nvec) return;
    const int t = blockIdx.x;
    float acc[W];
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = 0.0f;
    if (t < Tlen) {
#pragma unroll 4
        for (int b = 0; b < B; ++b) {
            float d[W];
            load_pack<T, W>(dx + ((long long)b * Tlen + t) * C + (long long)j * W, d);
#pragma unroll
            for (int k = 0; k < W; ++k) acc[k] += d[k];
        }
    }
    store_pack<T, W>(dwpe + (long long)t * C + (long long)j * W, acc);
}
