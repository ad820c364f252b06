// softmax.cu: row softmax over the last axis, forward and backward, three ways (chapter 2).
//
//   forward   p_j  = exp(s·x_j − m) / Σ_k exp(s·x_k − m),   m = max_k s·x_k   (s: the scale)
//   backward  dx_j = s · p_j · (dp_j − Σ_k p_k dp_k)                          (Jacobian-vector product)
//
// Subtracting the row maximum keeps every exponent ≤ 0, so nothing overflows (numerical stability).
// Each exponential is one exp2f: exp(d) = 2^(d·log2 e), applied to d = t − m where t = s·x. The
// difference is taken first (exact for the large terms, whose t is close to m), then multiplied by
// log2 e; multiplying x by s·log2 e up front would save that multiply but cost absolute accuracy of
// order |t|·2⁻²⁴ in every exponent, which is visible for large scores.
//
// Three kernels, the climb the chapter times:
//   *_naive   one thread per row (the article's kernel). Simple, and slow twice over: neighbouring
//             threads read addresses a whole row apart (no coalescing), and a row is walked three
//             (forward) or two (backward) times by one thread.
//   *_warp    one warp (32 threads) per row: lane j reads elements j, j+32, ... so each load
//             instruction is one contiguous, coalesced request; reductions are register shuffles.
//   *_block   one block per row with 16-byte vector loads, the first few vectors of each thread kept
//             in registers between the two passes, and a block-wide reduction. Vector loads need the
//             row length to be a multiple of the vector width and 16-byte-aligned pointers; the host
//             picks the scalar instantiation (VEC = false) otherwise.
//
// The forward of warp and block computes max and sum in one sweep with the online normalizer
// (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018): keep a running max m and
// a sum s relative to it; when a larger value arrives, rescale s by e^(m_old − m_new). Partial (m, s)
// pairs from different threads merge the same way, so one reduction replaces two (max, then sum).
//
// Attention options on every kernel: `scale` multiplies the input, and causal_T > 0 treats the rows as
// score matrices [BH, T, T]: row r is query position r % T and sees keys 0 .. r % T; later columns
// get probability exactly 0 (and gradient exactly 0) and are never read.
//
// Non-finite input, as PyTorch and the NumPy reference: a NaN or a +inf among a row's visible
// entries makes the whole row of p NaN (+inf: exp(inf - inf)); -inf entries get p = 0; a row with
// no finite entry at all (all -inf) is NaN. The NaN is carried by the running sum s, never dropped:
// fmaxf ignores NaN, so no max below may decide on its own to skip an element (see online_add,
// online_merge and softmax_accumulate). Masked (causal) columns are never read, so a NaN there
// changes nothing.
//
// Types: TS is the score-side type (x in forward, dp in backward), TP the probability-side type
// (p in forward, p and dx in backward). Either both are the same, or TS is float and TP 16-bit:
// attention keeps scores in fp32 (cuBLAS writes them with fp32 accumulation) and probabilities in
// bf16/fp16 for the next GEMM. Arithmetic is always float.
#include "common.cuh"

// llmgpu:kernel softmax_{fwd,bwd}_{naive,warp}<float, float>
// llmgpu:kernel softmax_{fwd,bwd}_{naive,warp}<{float,__half}, __half>
// llmgpu:kernel softmax_{fwd,bwd}_{naive,warp}<{float,__nv_bfloat16}, __nv_bfloat16>
// llmgpu:kernel softmax_{fwd,bwd}_block<float, float, {true,false}>
// llmgpu:kernel softmax_{fwd,bwd}_block<{float,__half}, __half, {true,false}>
// llmgpu:kernel softmax_{fwd,bwd}_block<{float,__nv_bfloat16}, __nv_bfloat16, {true,false}>

#define SOFTMAX_LOG2E 1.4426950408889634f

__device__ __forceinline__ float softmax_exp(float d) { return exp2f(d * SOFTMAX_LOG2E); }

// max that propagates NaN (fmaxf returns the other operand). sm_80+ has it as one instruction.
__device__ __forceinline__ float softmax_max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}

// Number of leading columns of `row` that take part: all of them, or keys 0 .. row % T when causal.
__device__ __forceinline__ int softmax_valid_cols(long long row, int cols, int causal_T) {
    return causal_T > 0 ? min(cols, (int)(row % causal_T) + 1) : cols;
}

// Online normalizer: add one (already scaled) score t to the running pair (m, s).
// A NaN t fails t > m and lands in the sum (s = NaN); a +inf t adds t - t = NaN instead of 1, so that
// +inf poisons the row as exp(inf - inf) does in the reference (an add on the rare rescale path only).
__device__ __forceinline__ void online_add(float& m, float& s, float t) {
    if (t > m) {  // new maximum: the old sum was relative to m, rescale it (e^-inf = 0 when empty)
        s = s * softmax_exp(m - t) + (t - t + 1.0f);
        m = t;
    } else if (t != -LLMGPU_INF) {
        s += softmax_exp(t - m);
    }
}

// Merge two partial pairs; an empty part is (−inf, 0), or (−inf, NaN) when it saw only NaN.
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -LLMGPU_INF) {  // both empty: avoid e^(−inf + inf) = NaN, but keep a NaN of either side
        s += s2;              // (0 or NaN each)
        return;
    }
    s = s * softmax_exp(m - mn) + s2 * softmax_exp(m2 - mn);  // NaN · 0 is NaN: a NaN s survives
    m = mn;
}

// Merge across a warp; afterwards every lane holds lane 0's pair (bit-identical in all lanes).
__device__ __forceinline__ void warp_online(float& m, float& s) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        online_merge(m, s, m2, s2);
    }
    m = __shfl_sync(0xffffffffu, m, 0);
    s = __shfl_sync(0xffffffffu, s, 0);
}

// Merge across the block (blockDim.x a multiple of 32). `scratch` holds 64 floats of shared memory.
// Every warp reduces the same 32 partials in the same order, so all threads get identical values.
__device__ __forceinline__ void block_online(float& m, float& s, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    warp_online(m, s);
    if (lane == 0) {
        scratch[warp] = m;
        scratch[32 + warp] = s;
    }
    __syncthreads();
    m = (lane < nwarps) ? scratch[lane] : -LLMGPU_INF;
    s = (lane < nwarps) ? scratch[32 + lane] : 0.0f;
    warp_online(m, s);
}

// --------------------------------------------------------------------------- 1. one thread per row

// The article's kernel: thread r owns row r and walks it three times (max, sum, write).
template <typename TS, typename TP>
__global__ void softmax_fwd_naive(const TS* __restrict__ x, TP* __restrict__ p, int rows, int cols, float scale,
                                  int causal_T) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const TS* xr = x + row * cols;
    TP* pr = p + row * cols;
    const int n = softmax_valid_cols(row, cols, causal_T);
    float m = -LLMGPU_INF;
    for (int j = 0; j < n; ++j) m = fmaxf(m, scale * to_float(xr[j]));
    float s = 0.0f;
    for (int j = 0; j < n; ++j) s += softmax_exp(scale * to_float(xr[j]) - m);
    const float inv = 1.0f / s;
    for (int j = 0; j < n; ++j) pr[j] = from_float<TP>(softmax_exp(scale * to_float(xr[j]) - m) * inv);
    for (int j = n; j < cols; ++j) pr[j] = from_float<TP>(0.0f);
}

// Thread r owns row r: dot = Σ p·dp, then dx = s·p·(dp − dot).
template <typename TS, typename TP>
__global__ void softmax_bwd_naive(const TS* __restrict__ dp, const TP* __restrict__ p, TP* __restrict__ dx, int rows,
                                  int cols, float scale, int causal_T) {
    const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const long long off = row * cols;
    const int n = softmax_valid_cols(row, cols, causal_T);
    float dot = 0.0f;
    for (int j = 0; j < n; ++j) dot += to_float(p[off + j]) * to_float(dp[off + j]);
    for (int j = 0; j < n; ++j) {
        const float pj = to_float(p[off + j]);
        dx[off + j] = from_float<TP>(scale * pj * (to_float(dp[off + j]) - dot));
    }
    for (int j = n; j < cols; ++j) dx[off + j] = from_float<TP>(0.0f);
}

// --------------------------------------------------------------------------- 2. one warp per row

// blockDim.x / 32 rows per block. Lane l reads columns l, l + 32, ...: a warp's load is contiguous.
// One sweep for (max, sum) with the online normalizer, one sweep to write.
template <typename TS, typename TP>
__global__ void softmax_fwd_warp(const TS* __restrict__ x, TP* __restrict__ p, int rows, int cols, float scale,
                                 int causal_T) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // the whole warp leaves together: the shuffles below stay full-warp
    const TS* xr = x + row * cols;
    TP* pr = p + row * cols;
    const int n = softmax_valid_cols(row, cols, causal_T);
    float m = -LLMGPU_INF, s = 0.0f;
    for (int j = lane; j < n; j += 32) online_add(m, s, scale * to_float(xr[j]));
    warp_online(m, s);
    const float inv = 1.0f / s;
    for (int j = lane; j < cols; j += 32) {
        pr[j] = from_float<TP>(j < n ? softmax_exp(scale * to_float(xr[j]) - m) * inv : 0.0f);
    }
}

template <typename TS, typename TP>
__global__ void softmax_bwd_warp(const TS* __restrict__ dp, const TP* __restrict__ p, TP* __restrict__ dx, int rows,
                                 int cols, float scale, int causal_T) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const long long off = row * cols;
    const int n = softmax_valid_cols(row, cols, causal_T);
    float dot = 0.0f;
    for (int j = lane; j < n; j += 32) dot += to_float(p[off + j]) * to_float(dp[off + j]);
    dot = warp_sum(dot);
    for (int j = lane; j < cols; j += 32) {
        float g = 0.0f;
        if (j < n) g = scale * to_float(p[off + j]) * (to_float(dp[off + j]) - dot);
        dx[off + j] = from_float<TP>(g);
    }
}

// --------------------------------------------------------------------------- 3. one block per row, vectorized

// N elements moved as one load/store (16 bytes for the wider of the two types).
template <typename T, int N>
struct alignas(sizeof(T) * N) SoftmaxVec {
    T v[N];
};

template <typename TS, typename TP, bool VEC>
struct SoftmaxWidth {
    static constexpr int value = VEC ? 16 / (sizeof(TS) > sizeof(TP) ? sizeof(TS) : sizeof(TP)) : 1;
};

// Vectors per thread kept in registers between the two passes. Beyond that a thread re-reads its
// vectors in the second pass (from L1/L2 for rows up to a few hundred KB). With 1024 threads the
// compiler has 64 registers per thread: 4 vectors of two inputs (32 registers) fit without spills.
#define SOFTMAX_CACHE 2

template <typename TS, int N>
__device__ __forceinline__ void softmax_accumulate(const SoftmaxVec<TS, N>& a, int base, int n, float scale,
                                                   float& m, float& s) {
    float t[N];
    float vmax = -LLMGPU_INF;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        t[i] = (base + i < n) ? scale * to_float(a.v[i]) : -LLMGPU_INF;
        vmax = softmax_max_nan(vmax, t[i]);  // not fmaxf: a vector of NaN must not look empty below
    }
    if (vmax == -LLMGPU_INF) return;  // nothing visible (a NaN vmax goes on: s becomes NaN)
    if (vmax > m) {  // one rescale per vector, not per element
        s *= softmax_exp(m - vmax);
        m = vmax;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) s += softmax_exp(t[i] - m);
}

template <typename TS, typename TP, int N>
__device__ __forceinline__ SoftmaxVec<TP, N> softmax_normalize(const SoftmaxVec<TS, N>& a, int base, int n,
                                                               float scale, float m, float inv) {
    SoftmaxVec<TP, N> o;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        o.v[i] = from_float<TP>(base + i < n ? softmax_exp(scale * to_float(a.v[i]) - m) * inv : 0.0f);
    }
    return o;
}

template <typename T, int N>
__device__ __forceinline__ SoftmaxVec<T, N> softmax_zeros() {
    SoftmaxVec<T, N> o;
#pragma unroll
    for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(0.0f);
    return o;
}

// One block per row (gridDim.x = rows). Thread t handles vectors t, t + blockDim.x, ...; the first
// SOFTMAX_CACHE of them stay in registers. Pass 1: online (max, sum) over the row, merged across the
// block. Pass 2: write p. Under causal masking only the vectors holding visible columns are read.
template <typename TS, typename TP, bool VEC>
__global__ void __launch_bounds__(1024, 1) softmax_fwd_block(const TS* __restrict__ x, TP* __restrict__ p, int rows,
                                                          int cols, float scale, int causal_T) {
    constexpr int N = SoftmaxWidth<TS, TP, VEC>::value;
    using VS = SoftmaxVec<TS, N>;
    using VP = SoftmaxVec<TP, N>;
    __shared__ float scratch[64];
    const long long row = blockIdx.x;
    const VS* xr = reinterpret_cast<const VS*>(x + row * cols);
    VP* pr = reinterpret_cast<VP*>(p + row * cols);
    const int n = softmax_valid_cols(row, cols, causal_T);
    const int nread = (n + N - 1) / N;  // vectors with at least one visible column (inside the row: cols % N == 0)
    const int nvec = cols / N;
    const int tid = threadIdx.x, stride = blockDim.x;

    VS cache[SOFTMAX_CACHE];
    float m = -LLMGPU_INF, s = 0.0f;
#pragma unroll
    for (int c = 0; c < SOFTMAX_CACHE; ++c) {
        const int v = tid + c * stride;
        if (v < nread) {
            cache[c] = xr[v];
            softmax_accumulate(cache[c], v * N, n, scale, m, s);
        }
    }
    for (int v = tid + SOFTMAX_CACHE * stride; v < nread; v += stride) {
        const VS a = xr[v];  // a local copy: one vector load, not N scalar ones
        softmax_accumulate(a, v * N, n, scale, m, s);
    }
    block_online(m, s, scratch);
    const float inv = 1.0f / s;
#pragma unroll
    for (int c = 0; c < SOFTMAX_CACHE; ++c) {
        const int v = tid + c * stride;
        if (v < nread) pr[v] = softmax_normalize<TS, TP, N>(cache[c], v * N, n, scale, m, inv);
        else if (v < nvec) pr[v] = softmax_zeros<TP, N>();
    }
    for (int v = tid + SOFTMAX_CACHE * stride; v < nvec; v += stride) {
        if (v < nread) {
            const VS a = xr[v];
            pr[v] = softmax_normalize<TS, TP, N>(a, v * N, n, scale, m, inv);
        } else {
            pr[v] = softmax_zeros<TP, N>();
        }
    }
}

template <typename TS, typename TP, int N>
__device__ __forceinline__ float softmax_dot(const SoftmaxVec<TS, N>& g, const SoftmaxVec<TP, N>& q, int base, int n) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) acc += (base + i < n) ? to_float(q.v[i]) * to_float(g.v[i]) : 0.0f;
    return acc;
}

template <typename TS, typename TP, int N>
__device__ __forceinline__ SoftmaxVec<TP, N> softmax_grad(const SoftmaxVec<TS, N>& g, const SoftmaxVec<TP, N>& q,
                                                          int base, int n, float dot, float scale) {
    SoftmaxVec<TP, N> o;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        o.v[i] = from_float<TP>(base + i < n ? scale * to_float(q.v[i]) * (to_float(g.v[i]) - dot) : 0.0f);
    }
    return o;
}

// One block per row: pass 1 dot = Σ p·dp (block-wide sum), pass 2 dx = s·p·(dp − dot). Reads dp and
// p once each (from registers in pass 2 for the cached vectors) and writes dx once: the minimum traffic.
template <typename TS, typename TP, bool VEC>
__global__ void __launch_bounds__(1024, 1) softmax_bwd_block(const TS* __restrict__ dp, const TP* __restrict__ p,
                                                          TP* __restrict__ dx, int rows, int cols, float scale,
                                                          int causal_T) {
    constexpr int N = SoftmaxWidth<TS, TP, VEC>::value;
    using VS = SoftmaxVec<TS, N>;
    using VP = SoftmaxVec<TP, N>;
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const VS* gr = reinterpret_cast<const VS*>(dp + row * cols);
    const VP* qr = reinterpret_cast<const VP*>(p + row * cols);
    VP* dr = reinterpret_cast<VP*>(dx + row * cols);
    const int n = softmax_valid_cols(row, cols, causal_T);
    const int nread = (n + N - 1) / N;
    const int nvec = cols / N;
    const int tid = threadIdx.x, stride = blockDim.x;

    VS gc[SOFTMAX_CACHE];
    VP qc[SOFTMAX_CACHE];
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < SOFTMAX_CACHE; ++c) {
        const int v = tid + c * stride;
        if (v < nread) {
            gc[c] = gr[v];
            qc[c] = qr[v];
            dot += softmax_dot(gc[c], qc[c], v * N, n);
        }
    }
    for (int v = tid + SOFTMAX_CACHE * stride; v < nread; v += stride) {
        const VS g = gr[v];
        const VP q = qr[v];
        dot += softmax_dot(g, q, v * N, n);
    }
    dot = block_sum(dot, scratch);
#pragma unroll
    for (int c = 0; c < SOFTMAX_CACHE; ++c) {
        const int v = tid + c * stride;
        if (v < nread) dr[v] = softmax_grad(gc[c], qc[c], v * N, n, dot, scale);
        else if (v < nvec) dr[v] = softmax_zeros<TP, N>();
    }
    for (int v = tid + SOFTMAX_CACHE * stride; v < nvec; v += stride) {
        if (v < nread) {
            const VS g = gr[v];
            const VP q = qr[v];
            dr[v] = softmax_grad(g, q, v * N, n, dot, scale);
        } else {
            dr[v] = softmax_zeros<TP, N>();
        }
    }
}
