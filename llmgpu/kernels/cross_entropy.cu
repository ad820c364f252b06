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
// Fast (method "fast"): the fused forward reshaped for 16-bit logits (cross_entropy_forward_fast,
// then cross_entropy_loss_fast for the target lookups and the mean); the backward is
// cross_entropy_backward_fused, from the same lse.
//
// Fused forward + backward (cross_entropy_forward_backward in ops/cross_entropy.py; the chunked LM head
// of model/fast.py): one block per row computes lse, the row's loss and dlogits in one kernel, reading
// the logits from DRAM once (staged in shared memory between the two sweeps), instead of a forward that
// reads them and a backward that reads them again. The gradient's divisor (the batch's target count) is
// a device scalar, so the kernel serves every chunk of rows of one batch.
//
// Targets (int or long long): t == ignore_index -> loss 0 and a zero gradient row, and the row does
// not count in n_valid. t outside [0, V) otherwise -> the kernel does not read out of bounds; the
// row's loss is NaN (so the mean loss is NaN) and its gradient row is NaN: loud, never silently
// wrong. The NumPy path raises ValueError instead. All rows ignored -> loss 0, gradient 0.
#include "common.cuh"

// llmgpu:kernel cross_entropy_forward_fused<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel cross_entropy_backward_fused<{float,__half,__nv_bfloat16}, {int,long long}, {0,1}>
// llmgpu:kernel cross_entropy_mean<{int,long long}>
// llmgpu:kernel cross_entropy_forward_fast<{float,__half,__nv_bfloat16}>
// llmgpu:kernel cross_entropy_loss_fast<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel cross_entropy_forward_backward_fast<{float,__half,__nv_bfloat16}, {int,long long}, {0,1}, {0,1}>
// llmgpu:kernel cross_entropy_loss_sum
// llmgpu:kernel cross_entropy_softmax_naive<{float,__half,__nv_bfloat16}>
// llmgpu:kernel cross_entropy_nll_naive<{float,__half,__nv_bfloat16}, {int,long long}>
// llmgpu:kernel cross_entropy_backward_naive<{float,__half,__nv_bfloat16}, {int,long long}>

#define CE_NAN __int_as_float(0x7fffffff)

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
// instructions instead of expf's range reduction -- at full bandwidth a 2-byte bf16 logit leaves
// only a small arithmetic budget per element.

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

// ------------------------------------------------------------------------------------- the mean

// The end of both mean kernels (cross_entropy_mean, cross_entropy_loss_fast): every thread holds a
// partial loss sum s and a partial count c of counted rows. s goes through block_sum (common.cuh:
// a butterfly inside each warp, then one over the warps' partials, a fixed tree); c through a
// butterfly inside each warp, then thread 0 adds the warps' counts in warp order (integer adds are
// exact, so only s's order matters for the bits). Thread 0 writes n_valid and loss = s / max(n_valid, 1).
__device__ __forceinline__ void block_mean_store(float s, int c, float* __restrict__ loss, int* __restrict__ n_valid) {
    __shared__ float scratch[32];
    __shared__ int iscratch[32];
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
    float s = 0.0f;
    int c = 0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        s += loss_rows[i];
        c += ((long long)targets[i] != ignore_index) ? 1 : 0;
    }
    block_mean_store(s, c, loss, n_valid);
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

// ------------------------------------------------------------------------------------- fast
//
// Why a second fused forward. It reads N x V logits and writes 12 bytes per row, so it should run
// at the read bandwidth; with bf16 logits it falls further short of that than with fp32. A bf16
// pack is 8 logits, so per byte the bf16 kernel does twice the work, and
// cross_entropy_forward_fused spends it badly:
// one 16-byte load in flight per thread (load, then 8 exps, then the next load), a branch per pack
// for the rescale, __expf(v - m) as three instructions plus the conversion, the max and the add,
// and the target logit read at the very end (a dependent global load after the block reduction
// that every row waits for). This kernel:
//  * loads UNROLL = 4 packs per thread before touching them (64 bytes in flight per thread instead
//    of 16: covering DRAM latency at full bandwidth takes tens of KB in flight per SM);
//  * does one online-softmax step per group of 4 packs (32 bf16 logits): the group's max first,
//    then a single rescale of the running sum and one exp per logit, no per-pack branch; the
//    exps of each pack go to their own partial sum, so the dependent add chain is 8 long, not 32;
//  * uses a "safe" max (0 while the max is -inf) instead of branches, so that -inf logits (a
//    masked or padded vocabulary) add exactly 0 and a row of all -inf gives lse = -inf, as the
//    fused kernel does; NaN still poisons the sum, and +inf gives NaN (inf - inf), as the reference;
//  * exp(v - m) = ex2((v - m) log2 e), one MUFU.EX2 (ex2.approx.ftz, ~2 ulp, as __expf); v - m is
//    formed first (exact for nearby values), so large logits do not cost accuracy;
//  * leaves the target out: the row kernel computes lse only, and cross_entropy_loss_fast (one
//    block, after it) looks up logits[i, target_i] for all rows at once and takes the mean. In a
//    row block that lookup is two dependent DRAM round trips (target, then logit) that the whole
//    block waits for; batched, the round trips are paid once for all rows;
//  * handles head and tail (the scalar elements before the first and after the last 16-byte
//    pack: rows of an odd V start anywhere) as one more step: thread i < W takes head element i
//    and tail element i, loaded before the sweep and added after it, no scalar loops.
// One block of 256 threads per row (a GPT-2 row of 50257 bf16 logits: 6282 packs, ~25 per thread),
// few enough registers for several blocks per SM: blocks of other rows keep the SM busy (and their
// loads in flight) while one block reduces.

#define CE_FAST_THREADS 256
#define CE_FAST_UNROLL 4
#define CE_LOG2E 1.4426950408889634f

// The running sum's shift: the max, or 0 while the max is -inf (so that -inf - shift = -inf, exp 0).
__device__ __forceinline__ float ce_shift(float m) { return m == -LLMGPU_INF ? 0.0f : m; }

// Factor for the running sum when the shift moves from m to c (>= m): exp(m - c); exactly 1 when the
// max did not change (most groups), 0 when m = -inf (the sum is 0 then, or NaN and stays NaN).
__device__ __forceinline__ float ce_rescale(float m, float c) {
    return m == c ? 1.0f : fast_exp2((m - c) * CE_LOG2E);
}

// Block per row (grid = N, 256 threads): lse[row] only. The loss needs logits[row, target], one
// dependent load (target, then logit) per row; a block waiting for it would hold its SM slot for a
// DRAM round trip or two, so cross_entropy_loss_fast does all rows' lookups at once afterwards.
template <typename T>
__global__ void __launch_bounds__(CE_FAST_THREADS) cross_entropy_forward_fast(const T* __restrict__ logits,
                                                                              float* __restrict__ lse, int V) {
    constexpr int W = 16 / (int)sizeof(T);
    constexpr int U = CE_FAST_UNROLL;
    const long long row = blockIdx.x;
    const T* xr = logits + row * V;
    const int tid = threadIdx.x;

    const int head = head_elements(xr, V);  // < W
    const int nvec = (V - head) / W;
    const int tail0 = head + nvec * W;  // V - tail0 < W
    const T* body = xr + head;
    // Head element tid and tail element tid (blockDim.x = 256 >= W): loaded now, kept raw and
    // converted after the sweep, so that nothing waits for them before the sweep's loads are issued.
    T a_raw = from_float<T>(-LLMGPU_INF), b_raw = from_float<T>(-LLMGPU_INF);
    if (tid < head) a_raw = xr[tid];
    if (tail0 + tid < V) b_raw = xr[tail0 + tid];

    float m = -LLMGPU_INF, s = 0.0f;
    // Full groups of U packs (no bounds checks inside), then the last few packs one at a time.
    int j = tid;
    for (; j + (U - 1) * CE_FAST_THREADS < nvec; j += U * CE_FAST_THREADS) {
        float v[U][W];
#pragma unroll
        for (int k = 0; k < U; ++k) load_pack16<T, W>(body + (long long)(j + k * CE_FAST_THREADS) * W, v[k]);
        float gm = m;
#pragma unroll
        for (int k = 0; k < U; ++k) {
#pragma unroll
            for (int i = 0; i < W; ++i) gm = fmaxf(gm, v[k][i]);  // skips NaN; the sum catches it
        }
        const float c = ce_shift(gm);
        float acc[U];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            acc[k] = fast_exp2((v[k][0] - c) * CE_LOG2E);
#pragma unroll
            for (int i = 1; i < W; ++i) acc[k] += fast_exp2((v[k][i] - c) * CE_LOG2E);
        }
        float group = acc[0];
#pragma unroll
        for (int k = 1; k < U; ++k) group += acc[k];
        s = s * ce_rescale(m, c) + group;
        m = gm;
    }
    for (; j < nvec; j += CE_FAST_THREADS) {
        float v[W];
        load_pack16<T, W>(body + (long long)j * W, v);
        float gm = m;
#pragma unroll
        for (int i = 0; i < W; ++i) gm = fmaxf(gm, v[i]);
        const float c = ce_shift(gm);
        float acc = fast_exp2((v[0] - c) * CE_LOG2E);
#pragma unroll
        for (int i = 1; i < W; ++i) acc += fast_exp2((v[i] - c) * CE_LOG2E);
        s = s * ce_rescale(m, c) + acc;
        m = gm;
    }
    {
        const float a = to_float(a_raw), b = to_float(b_raw);
        const float gm = fmaxf(m, fmaxf(a, b));
        const float c = ce_shift(gm);
        s = s * ce_rescale(m, c) + (fast_exp2((a - c) * CE_LOG2E) + fast_exp2((b - c) * CE_LOG2E));
        m = gm;
    }

    const float L = block_logsumexp(m, s);
    if (tid == 0) lse[row] = L;
}

// One block (1024 threads) after cross_entropy_forward_fast: loss = mean over counted rows of
// lse[i] - logits[i, targets[i]], n_valid = #(targets != ignore_index); an out-of-range target makes
// its row's loss NaN (no out-of-bounds read), as in the fused kernels. Each thread takes rows
// i = tid, tid + 1024, ... in batches of 8 and issues all 8 target loads, then all 8 logit lookups
// and lse loads, before adding: a few DRAM round trips for the whole batch instead of one or two
// per row. The same rows per thread in the same order, then a fixed tree: deterministic.
template <typename T, typename TI>
__global__ void __launch_bounds__(1024) cross_entropy_loss_fast(const T* __restrict__ logits,
                                                                const TI* __restrict__ targets,
                                                                const float* __restrict__ lse, int N, int V,
                                                                long long ignore_index, float* __restrict__ loss,
                                                                int* __restrict__ n_valid) {
    constexpr int K = 8;
    float s = 0.0f;
    int c = 0;
    for (long long base = threadIdx.x; base < N; base += K * blockDim.x) {  // 64-bit: N may be near 2^31
        long long tt[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const long long i = base + k * blockDim.x;
            tt[k] = i < N ? (long long)targets[i] : ignore_index;
        }
        float picked[K], l[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const long long i = base + k * blockDim.x;
            const bool in_range = tt[k] >= 0 && tt[k] < V;
            picked[k] = (i < N && in_range) ? to_float(logits[i * V + tt[k]]) : 0.0f;
            l[k] = i < N ? lse[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            float lk;
            if (tt[k] == ignore_index) {
                lk = 0.0f;  // also the padding rows i >= N
            } else if (tt[k] < 0 || tt[k] >= V) {
                lk = CE_NAN;
            } else {
                lk = l[k] - picked[k];
            }
            s += lk;
            c += tt[k] != ignore_index ? 1 : 0;
        }
    }
    block_mean_store(s, c, loss, n_valid);
}

// ------------------------------------------------------------------------------------- fused fwd + bwd
//
// cross_entropy_forward_backward_fast: the forward (lse, the row's loss) and the backward (dlogits) of
// one row in one block, so that the logits are read once. A block of CE_FB_THREADS threads per row:
//  1. sweep 1 reads the row's 16-byte packs (CE_FB_UNROLL in flight per thread), keeps the online
//     (max, sum) pair as cross_entropy_forward_fast does (one rescale per group, the "safe" shift, head
//     and tail elements held by threads < W), and, with STAGE = 1, stores each raw pack in shared
//     memory (a GPT-2 row: 50304 bf16 = 100.6 KB; two such blocks fit on an SM of 228 KB, so one
//     block's sweeps overlap the other's barrier);
//  2. block_logsumexp merges the pairs: lse;
//  3. sweep 2 takes each pack back (from shared memory, or with STAGE = 0, rows too long to stage, from
//     global memory again: L2 if it still holds the row, else DRAM) and writes
//     dlogits = (exp(x - lse) - [v == t]) * dloss / max(n_total, 1); the thread that meets the target
//     writes loss_rows[row] = lse - x_t. Every element is read (sweep 1) before it is written (sweep 2)
//     by the same thread, so dlogits may be the logits buffer itself (in place).
// Bytes per row with STAGE = 1: V*sizeof(T) read + V*sizeof(T) written + a few; the unfused forward +
// backward read the row twice. Ignored rows (loss 0, zero gradient) and out-of-range targets (loss NaN,
// NaN gradient row) are decided before the row is read: a fill, no read. NaN or +inf in a counted row
// makes lse, the loss and the gradient row NaN, as in the unfused kernels.
// n_total: n_dev[0] when use_n_dev, else n_host; dloss likewise (a loss scale stays on the device).
// VEC = 1 needs dlogits and logits to share their offset modulo 16 bytes (the host checks); VEC = 0 is
// the scalar path (W = 1, no head or tail). STAGE = 1 needs (V - head) / W * 16 bytes of dynamic shared
// memory (W * sizeof(T) = 16 with VEC = 1).

#define CE_FB_THREADS 512
#define CE_FB_UNROLL 4

template <typename T, typename TI, int VEC, int STAGE>
__global__ void __launch_bounds__(CE_FB_THREADS, 2) cross_entropy_forward_backward_fast(
    const T* logits, const TI* __restrict__ targets, float* __restrict__ loss_rows, const int* __restrict__ n_dev,
    int use_n_dev, int n_host, const float* __restrict__ dloss_dev, int use_dloss_dev, float dloss_host, T* dlogits,
    int V, long long ignore_index) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = CE_FB_UNROLL;
    constexpr int NT = CE_FB_THREADS;
    using P = Packed<T, W>;
    extern __shared__ __align__(16) unsigned char ce_fb_smem[];
    P* const stage = reinterpret_cast<P*>(ce_fb_smem);
    const long long row = blockIdx.x;
    const T* xr = logits + row * V;
    T* gr = dlogits + row * V;
    const int tid = threadIdx.x;
    const long long t = (long long)targets[row];  // the same for the whole block: uniform branches below
    const int head = VEC ? head_elements(xr, V) : 0;  // < W
    const int nvec = (V - head) / W;
    const int tail0 = head + nvec * W;  // V - tail0 < W
    const P* body = reinterpret_cast<const P*>(xr + head);
    P* gbody = reinterpret_cast<P*>(gr + head);

    if (t == ignore_index || t < 0 || t >= V) {  // ignored: zeros, loss 0; out of range: NaN. No read.
        const float fill = t == ignore_index ? 0.0f : CE_NAN;
        P fp;
#pragma unroll
        for (int k = 0; k < W; ++k) fp.v[k] = from_float<T>(fill);
        for (int j = tid; j < nvec; j += NT) gbody[j] = fp;
        if (tid < head) gr[tid] = fp.v[0];
        if (tail0 + tid < V) gr[tail0 + tid] = fp.v[0];
        if (tid == 0) loss_rows[row] = fill;
        return;
    }

    // ---- sweep 1: (max, sum), staging the raw packs
    T a_raw = from_float<T>(-LLMGPU_INF), b_raw = from_float<T>(-LLMGPU_INF);  // head / tail element tid
    if (tid < head) a_raw = xr[tid];
    if (tail0 + tid < V) b_raw = xr[tail0 + tid];
    float m = -LLMGPU_INF, s = 0.0f;
    int j = tid;
    for (; j + (U - 1) * NT < nvec; j += U * NT) {
        P raw[U];
#pragma unroll
        for (int k = 0; k < U; ++k) raw[k] = body[j + k * NT];
        if (STAGE) {
#pragma unroll
            for (int k = 0; k < U; ++k) stage[j + k * NT] = raw[k];
        }
        float gm = m;
#pragma unroll
        for (int k = 0; k < U; ++k) {
#pragma unroll
            for (int i = 0; i < W; ++i) gm = fmaxf(gm, pack_elem<T, W>(raw[k], i));  // skips NaN; the sum catches it
        }
        const float c = ce_shift(gm);
        float acc[U];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            acc[k] = fast_exp2((pack_elem<T, W>(raw[k], 0) - c) * CE_LOG2E);
#pragma unroll
            for (int i = 1; i < W; ++i) acc[k] += fast_exp2((pack_elem<T, W>(raw[k], i) - c) * CE_LOG2E);
        }
        float group = acc[0];
#pragma unroll
        for (int k = 1; k < U; ++k) group += acc[k];
        s = s * ce_rescale(m, c) + group;
        m = gm;
    }
    for (; j < nvec; j += NT) {
        const P raw = body[j];
        if (STAGE) stage[j] = raw;
        float gm = m;
#pragma unroll
        for (int i = 0; i < W; ++i) gm = fmaxf(gm, pack_elem<T, W>(raw, i));
        const float c = ce_shift(gm);
        float acc = fast_exp2((pack_elem<T, W>(raw, 0) - c) * CE_LOG2E);
#pragma unroll
        for (int i = 1; i < W; ++i) acc += fast_exp2((pack_elem<T, W>(raw, i) - c) * CE_LOG2E);
        s = s * ce_rescale(m, c) + acc;
        m = gm;
    }
    const float xa = to_float(a_raw), xb = to_float(b_raw);
    {
        const float gm = fmaxf(m, fmaxf(xa, xb));
        const float c = ce_shift(gm);
        s = s * ce_rescale(m, c) + (fast_exp2((xa - c) * CE_LOG2E) + fast_exp2((xb - c) * CE_LOG2E));
        m = gm;
    }
    const float L = block_logsumexp(m, s);  // its barriers also order the staging before sweep 2

    // ---- sweep 2: dlogits, and the target's loss
    const int nt = use_n_dev ? n_dev[0] : n_host;
    const float dloss = use_dloss_dev ? dloss_dev[0] : dloss_host;
    const float scale = dloss / (float)max(nt, 1);
    for (int jj = tid; jj < nvec; jj += NT) {
        const P raw = STAGE ? stage[jj] : body[jj];
        const long long d = t - (head + (long long)jj * W);  // the target's place in this pack
        float g[W];
        float xt = 0.0f;
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float x = pack_elem<T, W>(raw, k);
            g[k] = (fast_exp2((x - L) * CE_LOG2E) - (d == k ? 1.0f : 0.0f)) * scale;
            if (d == k) xt = x;
        }
        store_pack16<T, W>(gr + head + (long long)jj * W, g);
        if (d >= 0 && d < W) loss_rows[row] = L - xt;
    }
    if (tid < head) {
        gr[tid] = from_float<T>((fast_exp2((xa - L) * CE_LOG2E) - (tid == t ? 1.0f : 0.0f)) * scale);
        if (tid == t) loss_rows[row] = L - xa;
    }
    if (tail0 + tid < V) {
        const int i = tail0 + tid;
        gr[i] = from_float<T>((fast_exp2((xb - L) * CE_LOG2E) - (i == t ? 1.0f : 0.0f)) * scale);
        if (i == t) loss_rows[row] = L - xb;
    }
}

// One block (1024 threads): *loss_sum = sum of loss_rows[0..N) (accumulate: added to *loss_sum).
// Thread i takes rows i, i + 1024, ... in order, then block_sum's fixed tree: the same bits every run.
__global__ void __launch_bounds__(1024) cross_entropy_loss_sum(const float* __restrict__ loss_rows, int N,
                                                               float* __restrict__ loss_sum, int accumulate) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) s += loss_rows[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) *loss_sum = accumulate ? *loss_sum + s : s;
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
