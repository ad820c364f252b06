// embedding.cu: token + position embedding, forward and backward (chapter 3).
//
//   forward   x[b, t, :] = wte[idx[b, t], :] + wpe[t, :]      (wpe null: wte's row alone, as in a Llama)
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
// The "counting" path gets the same order without a library sort, with launch configurations that
// depend only on (B, T, C, V) and no host synchronization, so a CUDA graph can capture it: a stable
// counting sort of the positions by token (a histogram per chunk of positions, prefix sums, a
// scatter; see "Counting sort" below) and then embedding_backward_wte_pos, which sums every row of
// at most EMB_PIECE (128) positions in the same ascending position order as embedding_backward_wte
// (the same bits). A longer ("hot") row is not one chain there: it is cut into pieces of the
// sorted order summed in parallel and then added in piece order ("hot rows, in pieces" below), so
// a token at 20% of the positions costs ~1/100 of the chain, still bitwise reproducible, but no
// longer the same bits as "optimized" for that row.
//
// Accumulating into fp32 gradients (ACC = 1, embedding_backward(..., accumulate=True)): the training
// step wants dwte and dwpe added into its fp32 gradient buffers. Instead of writing a [V, C] row per
// token in dx's dtype (zeros for the tokens that do not occur) and adding that whole array into the
// fp32 gradient afterwards (a cast and an add over V*C elements), the row walk and the hot-row pieces
// of embedding_backward_wte_pos add each fp32 row sum straight into the fp32 row, and only for the
// tokens that occur; embedding_backward_wpe adds the rows t < T. The sums are the same fp32 sums in
// the same order, added once per row: deterministic, and one bf16 rounding fewer.
//
// NVIDIA-only: the counting path groups a warp's equal tokens with __match_any_sync, and reads with
// __ldcg; HIP 5.2 has neither, so this file does not compile for an AMD GPU (tools/checks/hip_compile_check.py).
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
// llmgpu:kernel embedding_backward_wpe<{float,__half,__nv_bfloat16}, {0,1}, {0,1}>
// llmgpu:kernel embedding_count_histogram<{int,long long}>
// llmgpu:kernel embedding_count_prefix
// llmgpu:kernel embedding_count_scan_blocks
// llmgpu:kernel embedding_count_scatter<{int,long long}>
// llmgpu:kernel embedding_backward_wte_pos<{float,__half,__nv_bfloat16}, {0,1}, {1,2,3}, {0,1}>

#define EMB_NAN __int_as_float(0x7fffffff)

// Output of the backward kernels: dx's type T (written), or fp32 with ACC = 1 (added into).
template <typename T, int ACC> struct EmbOut { using type = T; };
template <typename T> struct EmbOut<T, 1> { using type = float; };

// p[0..W) = a (ACC = 0, converted to T) or p[0..W) += a (ACC = 1, fp32; 16-byte vectors when W is a
// multiple of 4, which needs p 16-byte aligned: the host checks the base, C % W == 0 the rest).
template <typename T, int W, int ACC>
__device__ __forceinline__ void emb_put(typename EmbOut<T, ACC>::type* __restrict__ p, const float (&a)[W]) {
    if constexpr (ACC == 0) {
        store_pack<T, W>(p, a);
    } else if constexpr (W % 4 == 0) {
#pragma unroll
        for (int e = 0; e < W; e += 4) {
            float4 o = *reinterpret_cast<const float4*>(p + e);
            o.x += a[e];
            o.y += a[e + 1];
            o.z += a[e + 2];
            o.w += a[e + 3];
            *reinterpret_cast<float4*>(p + e) = o;
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) p[e] += a[e];
    }
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
    const float a = to_float(wte[id * C + c]);  // T -> float -> T is exact: a bare gather keeps its bits
    out[i] = from_float<T>(wpe ? a + to_float(wpe[(long long)t * C + c]) : a);
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
        load_pack<T, W>(wte + id * C + (long long)j * W, o);
        if (wpe) {  // the same branch for the whole grid
            float b[W];
            load_pack<T, W>(wpe + (long long)t * C + (long long)j * W, b);
#pragma unroll
            for (int k = 0; k < W; ++k) o[k] += b[k];
        }
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
// t >= T (positions this batch did not use) are written as zeros. ACC = 1: grid (T, ...), the sums
// are added into the fp32 dwpe (rows t >= T untouched).
template <typename T, int VEC, int ACC>
__global__ void __launch_bounds__(256) embedding_backward_wpe(const T* __restrict__ dx,
                                                              typename EmbOut<T, ACC>::type* __restrict__ dwpe,
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
    emb_put<T, W, ACC>(dwpe + (long long)t * C + (long long)j * W, acc);
}

// ------------------------------------------------------------------ backward: counting sort
//
// Counting sort ("counting" in ops/embedding.py). Goal: pos[0..N) = the in-range positions i
// (0 <= idx[i] < V) ordered by token and, within a token, by ascending i (a stable sort), with
// start(v) = the first slot of token v, so that token v's positions are pos[start(v) .. start(v+1)).
// Every count is an integer, so the atomics below give the same result in any order: the output
// is deterministic, and no launch configuration depends on the data.
//
//   a. embedding_count_histogram: table[c][v] = how many positions of chunk c (positions
//      c*EMB_CHUNK .. c*EMB_CHUNK + EMB_CHUNK-1) hold token v (the host zeroed table [nchunks, V]).
//   b. embedding_count_prefix, a thread per token v: table[c][v] becomes the exclusive prefix over
//      chunks (how many positions of token v lie in chunks before c); the column total is v's count,
//      and a block scan over EMB_SCAN_BLOCK consecutive tokens gives local[v] (the positions of the
//      tokens v' < v of the same block) and blocksum[block] (the positions of all its tokens).
//   c. embedding_count_scan_blocks, one block: blockoff = exclusive scan of blocksum.
//      start(v) = blockoff[v / EMB_SCAN_BLOCK] + local[v]  for v = 0..V  (start(V) = N).
//   d. embedding_count_scatter: position i of chunk c with token v goes to slot
//      start(v) + table[c][v] + rank(i), rank(i) = number of earlier positions of chunk c with token v.
//
// Sizes: table is nchunks * V ints (64 * 50304 * 4 B = 13 MB at GPT-2 size: memset, one read-write
// pass in b.), pos is B*T ints. A bigger chunk shrinks the table but makes the rank loop of d. longer.

#define EMB_CHUNK 1024       // positions per chunk (a multiple of 256)
#define EMB_SCAN_BLOCK 256   // tokens per block of embedding_count_prefix (start(v) uses v >> 8)
#define EMB_SCAN_SHIFT 8
#define EMB_PREFIX_BATCH 16  // table loads in flight per thread in embedding_count_prefix
#define EMB_ROWS 8           // token rows per warp in embedding_backward_wte_pos
#define EMB_BATCH 4          // dx rows in flight per lane in embedding_backward_wte_pos
#define EMB_PIECE 128        // slots per piece of a hot row; rows with more positions are "hot"
#define EMB_WTE_POS_THREADS 128  // the block of embedding_backward_wte_pos: 4 warps
#define EMB_PIECE_BATCH 8    // dx rows in flight per thread when a piece of a hot row is summed
#define EMB_COMBINE 8        // carry partials in flight per thread when a hot row's parts are added
static_assert(EMB_CHUNK % 256 == 0, "the scatter splits a chunk over blocks of 256 threads");
static_assert(EMB_PIECE % EMB_PIECE_BATCH == 0, "whole batches per piece");
static_assert(EMB_SCAN_BLOCK == (1 << EMB_SCAN_SHIFT), "start(v) uses a shift");
static_assert(EMB_ROWS < 32, "one lane per row start");

// Token id as an int, -1 for ids outside [0, V) (they take no slot).
template <typename TI>
__device__ __forceinline__ int emb_token(TI raw, int V) {
    const long long id = (long long)raw;
    return (id < 0 || id >= V) ? -1 : (int)id;
}

// First slot of token v in pos (v = 0..V).
__device__ __forceinline__ int emb_start(const int* __restrict__ local, const int* __restrict__ blockoff, long long v) {
    return blockoff[v >> EMB_SCAN_SHIFT] + local[v];
}

// Exclusive prefix sum over a block of NT threads (NT a multiple of 32, at most 1024); *total gets
// the block's sum. scratch: 33 ints of shared memory; the trailing barrier lets callers reuse it.
template <int NT>
__device__ __forceinline__ int emb_block_exclusive_scan(int x, int* scratch, int& total) {
    constexpr int NW = NT / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < NW ? scratch[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += y;
        }
        if (lane < NW) scratch[lane] = wi - w;  // exclusive offset of warp `lane`
        if (lane == 31) scratch[32] = wi;       // block total
    }
    __syncthreads();
    total = scratch[32];
    const int res = scratch[warp] + incl - x;
    __syncthreads();
    return res;
}

// a. Grid ceil(BT / 256), 256 threads. A warp's 32 positions lie in one chunk (EMB_CHUNK is a
// multiple of 32), so the lanes with the same token (__match_any_sync) add their count with one
// atomic: a hot token costs one atomic per warp, not one per position.
template <typename TI>
__global__ void __launch_bounds__(256) embedding_count_histogram(const TI* __restrict__ idx, long long BT, int V,
                                                                 int* __restrict__ table) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int id = i < BT ? emb_token(idx[i], V) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    const int lane = threadIdx.x & 31;
    if (id >= 0 && lane == __ffs(peers) - 1) atomicAdd(table + (i / EMB_CHUNK) * (long long)V + id, __popc(peers));
}

// b. Grid ceil((V + 1) / EMB_SCAN_BLOCK), EMB_SCAN_BLOCK threads, thread = token v (v = V counts 0:
// it makes local[V] + blockoff[V >> 8] = N). The column walk loads EMB_PREFIX_BATCH chunks before
// storing any, so a thread waits for one memory latency per batch, not per chunk. *any_hot (zeroed by
// the host) becomes 1 if some token has more than EMB_PIECE positions: without one, the hot-row
// blocks of embedding_backward_wte_pos return after reading it.
__global__ void __launch_bounds__(EMB_SCAN_BLOCK) embedding_count_prefix(int* __restrict__ table, int nchunks, int V,
                                                                         int* __restrict__ local,
                                                                         int* __restrict__ blocksum,
                                                                         int* __restrict__ any_hot) {
    __shared__ int scratch[33];
    const long long v = (long long)blockIdx.x * EMB_SCAN_BLOCK + threadIdx.x;
    int run = 0;
    if (v < V) {
        int* col = table + v;
        for (int c0 = 0; c0 < nchunks; c0 += EMB_PREFIX_BATCH) {
            int x[EMB_PREFIX_BATCH];
#pragma unroll
            for (int k = 0; k < EMB_PREFIX_BATCH; ++k)
                x[k] = (c0 + k < nchunks) ? col[(long long)(c0 + k) * V] : 0;
#pragma unroll
            for (int k = 0; k < EMB_PREFIX_BATCH; ++k) {
                if (c0 + k < nchunks) {
                    col[(long long)(c0 + k) * V] = run;
                    run += x[k];
                }
            }
        }
    }
    if (run > EMB_PIECE) *any_hot = 1;  // a hot token (same value from every writer: no race)
    int total;
    const int excl = emb_block_exclusive_scan<EMB_SCAN_BLOCK>(run, scratch, total);
    if (v <= V) local[v] = excl;
    if (threadIdx.x == 0) blocksum[blockIdx.x] = total;
}

// c. One block of 1024 threads: blockoff[k] = sum of blocksum[0..k), in tiles of 1024 (nb is
// ceil((V + 1) / 256): one tile at GPT-2 size, 4 for V = 2^20).
__global__ void __launch_bounds__(1024) embedding_count_scan_blocks(const int* __restrict__ blocksum, int nb,
                                                                    int* __restrict__ blockoff) {
    __shared__ int scratch[33];
    int carry = 0;
    for (int base = 0; base < nb; base += 1024) {
        const int k = base + threadIdx.x;
        const int x = k < nb ? blocksum[k] : 0;
        int total;
        const int excl = emb_block_exclusive_scan<1024>(x, scratch, total);
        if (k < nb) blockoff[k] = carry + excl;
        carry += total;
    }
}

// d. Grid (nchunks, EMB_CHUNK / 256), 256 threads: block (c, y) places positions
// c*EMB_CHUNK + y*256 + tid. It stages the chunk's tokens up to its own last position in shared
// memory; a thread's rank among the earlier positions of its chunk with the same token is
//   (lanes before it in its warp with that token: __match_any_sync, then a popcount)
// + (entries before its warp, counted in a loop over shared memory: every lane reads the same
//    int4 at once, a broadcast, and compares 4 tokens per read).
// The loop costs ~chunk^2/2 compares per chunk whatever the data (no data-dependent work, no
// atomics); the split of a chunk over 4 blocks spreads it over 4x more SMs.
template <typename TI>
__global__ void __launch_bounds__(256) embedding_count_scatter(const TI* __restrict__ idx, long long BT, int V,
                                                               const int* __restrict__ table,
                                                               const int* __restrict__ local,
                                                               const int* __restrict__ blockoff,
                                                               int* __restrict__ pos) {
    __shared__ __align__(16) int s_id[EMB_CHUNK];
    const long long c = blockIdx.x;
    const long long chunk0 = c * EMB_CHUNK;
    const int n_stage = (blockIdx.y + 1) * 256;
    for (int k = threadIdx.x; k < n_stage; k += 256) {
        const long long i = chunk0 + k;
        s_id[k] = i < BT ? emb_token(idx[i], V) : -1;
    }
    __syncthreads();
    const int kk = blockIdx.y * 256 + threadIdx.x;  // position within the chunk
    const int lane = threadIdx.x & 31;
    const int id = s_id[kk];
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    int rank = __popc(peers & ((1u << lane) - 1u));
    const int4* s4 = reinterpret_cast<const int4*>(s_id);
    const int n4 = (kk - lane) >> 2;  // entries before this warp, 4 per int4 (kk - lane is a multiple of 32)
#pragma unroll 4
    for (int k4 = 0; k4 < n4; ++k4) {
        const int4 a = s4[k4];
        rank += (a.x == id) + (a.y == id) + (a.z == id) + (a.w == id);
    }
    if (id < 0) return;  // out-of-range token, or past the end of idx
    pos[emb_start(local, blockoff, id) + table[c * V + id] + rank] = (int)(chunk0 + kk);
}

// acc[e] += float(raw.v[e]). For bf16 the conversion is the exact bit move (the bf16 bits are the
// top half of the fp32 bits), written out so that the compiler keeps the packed values until the
// add instead of widening a whole batch into fp32 registers early.
template <typename T> struct EmbIsBf16 { static constexpr bool value = false; };
template <> struct EmbIsBf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename T, int W>
__device__ __forceinline__ void emb_add_pack(float (&acc)[W], const Packed<T, W>& raw) {
    if constexpr (EmbIsBf16<T>::value && W % 2 == 0) {
        const unsigned* b = reinterpret_cast<const unsigned*>(raw.v);
#pragma unroll
        for (int e = 0; e < W / 2; ++e) {
            acc[2 * e] += __uint_as_float(b[e] << 16);
            acc[2 * e + 1] += __uint_as_float(b[e] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) acc[e] += to_float(raw.v[e]);
    }
}

// Store / load W floats of the fp32 carry (16-byte vectors when W is a multiple of 4: VEC = 1 has
// C % W == 0, so every carry row and every pack in it is 16-byte aligned). The loads go through L2
// (ld.global.cg): the partials were written by other SMs, whose writes L1 does not see.
template <int W>
__device__ __forceinline__ void emb_store_f32(float* __restrict__ p, const float (&a)[W]) {
    if constexpr (W % 4 == 0) {
#pragma unroll
        for (int e = 0; e < W; e += 4)
            *reinterpret_cast<float4*>(p + e) = make_float4(a[e], a[e + 1], a[e + 2], a[e + 3]);
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) p[e] = a[e];
    }
}

template <int W>
__device__ __forceinline__ void emb_load_f32_cg(const float* __restrict__ p, float (&a)[W]) {
    if constexpr (W % 4 == 0) {
#pragma unroll
        for (int e = 0; e < W; e += 4) {
            const float4 x = __ldcg(reinterpret_cast<const float4*>(p + e));
            a[e] = x.x;
            a[e + 1] = x.y;
            a[e + 2] = x.z;
            a[e + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) a[e] = __ldcg(p + e);
    }
}

// ------------------------------------------------------------ backward: hot rows, in pieces
//
// A row of dwte summed as one chain costs a memory latency per EMB_BATCH positions in one warp: a
// token at 20% of 64K positions is ~3300 latencies (~5 ms) while the rest of the GPU idles. So a
// row with more than EMB_PIECE positions ("hot") is cut into pieces summed in parallel, and the
// piece sums are added in a fixed order afterwards. The cut is the same in every run: it is a grid
// over the slots of pos, and pos is a function of idx alone.
//
//   Piece k of pos = slots k*EMB_PIECE .. (k+1)*EMB_PIECE - 1 (up to start(V), the in-range
//   positions). For a hot token v with slots [st, en), k0 = st / EMB_PIECE, k1 = (en - 1) / EMB_PIECE:
//     part(v, k) = 0 + dx[pos[q]] for v's slots q in piece k, in slot (= position) order
//     dwte[v]    = 0 + part(v, k0) + part(v, k0 + 1) + ... + part(v, k1)
//   all in fp32, left to right. So a hot row is a sum of runs of consecutive positions, each run
//   summed in ascending order; a row with at most EMB_PIECE positions is still one chain (the row
//   walk below), bitwise as before and as the "optimized" path. Where the piece borders fall inside
//   a row depends on the counts of the smaller token ids (start(v)), i.e. on idx: fixed per input.
//
// Block k of the piece part of the grid owns piece k. A piece meets at most two hot rows (each has
// more than EMB_PIECE slots, so one that starts inside the piece also ends after it): the row of its
// first slot and the row of its last slot. For each, thread = one pack of the column tile, it sums
// the row's slots of the piece (EMB_PIECE_BATCH dx rows in flight) and writes part(v, k) to the fp32
// carry, row 2k + s: s = 0 when v holds the piece's first slot, s = 1 when v starts inside the piece
// (one piece can have both, never two of the same s). Then a counter per (hot row, column tile),
// counters[k0 * ntiles + tile] (zeroed by the host), counts the parts written; the block that brings
// it to k1 - k0 + 1 adds all the parts in piece order and writes dwte[v]. *Which* block adds varies
// from run to run, the order of the additions does not: the bits are fixed by idx and dx (the
// last-block pattern of the CUDA threadFenceReduction sample: __threadfence before the count).
template <typename T, int VEC, int KP, int ACC>
__device__ __forceinline__ void emb_hot_piece(const T* __restrict__ dx, const void* __restrict__ idx, int idx64,
                                              const int* __restrict__ pos, const int* __restrict__ local,
                                              const int* __restrict__ blockoff,
                                              typename EmbOut<T, ACC>::type* __restrict__ dwte,
                                              float* __restrict__ carry, int* __restrict__ counters,
                                              const int* __restrict__ any_hot, int C, int V, int piece) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = EMB_PIECE_BATCH;
    constexpr int NP = 32 * KP;  // packs in a column tile
    if (*any_hot == 0) return;   // no hot row at all (the common case): one load, then out
    __shared__ int s_pos[EMB_PIECE];  // the piece's positions
    __shared__ int s_row[2][3];       // (start, end, token) of the rows of the piece's first and last slot
    __shared__ int s_last;
    const int nin = emb_start(local, blockoff, V);  // slots of pos in use
    const int a = piece * EMB_PIECE;
    if (a >= nin) return;  // the whole block: a piece past the end
    const int b = min(a + EMB_PIECE, nin);
    for (int k = threadIdx.x; k < EMB_PIECE; k += blockDim.x) s_pos[k] = a + k < b ? pos[a + k] : 0;
    if (threadIdx.x < 2) {
        const int p = pos[threadIdx.x == 0 ? a : b - 1];
        // pos holds in-range positions only: 0 <= v < V
        const int v = idx64 ? (int)static_cast<const long long*>(idx)[p] : static_cast<const int*>(idx)[p];
        s_row[threadIdx.x][0] = emb_start(local, blockoff, v);
        s_row[threadIdx.x][1] = emb_start(local, blockoff, v + 1);
        s_row[threadIdx.x][2] = v;
    }
    __syncthreads();
    const int nvec = C / W;
    const int tile0 = blockIdx.y * NP;
#pragma unroll 1
    for (int ri = 0; ri < 2; ++ri) {  // block-uniform control flow: every condition reads shared memory
        const int st = s_row[ri][0], en = s_row[ri][1], v = s_row[ri][2];
        if (ri == 1 && st == s_row[0][0]) break;  // the last slot is in the first slot's row
        if (en - st <= EMB_PIECE) continue;       // not hot: the row walk sums it
        // part(v, piece): row v's slots of this piece, in order, into carry row 2 * piece + s
        const int lo = max(a, st), hi = min(b, en);
        float* const part = carry + ((long long)piece * 2 + (st <= a ? 0 : 1)) * C;
        for (int pt = threadIdx.x; pt < NP; pt += blockDim.x) {  // thread = a pack of the tile
            const int j = tile0 + pt;
            if (j >= nvec) break;
            float acc[W];
#pragma unroll
            for (int e = 0; e < W; ++e) acc[e] = 0.0f;
#pragma unroll 1
            for (int q = lo; q < hi; q += U) {
                const int n = min(U, hi - q);
                Packed<T, W> raw[U];
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (u < n)
                        raw[u] = reinterpret_cast<const Packed<T, W>*>(dx + (long long)s_pos[q - a + u] * C)[j];
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (u < n) emb_add_pack<T, W>(acc, raw[u]);
            }
            emb_store_f32<W>(part + (long long)j * W, acc);
        }
        __threadfence();  // the part is visible device-wide before the count says so
        __syncthreads();
        const int k0 = st / EMB_PIECE, k1 = (en - 1) / EMB_PIECE;
        if (threadIdx.x == 0) s_last = atomicAdd(counters + (long long)k0 * gridDim.y + blockIdx.y, 1) == k1 - k0;
        __syncthreads();
        if (s_last) {  // every part of row v is written: add them in piece order
            __threadfence();
            // thread = CW consecutive columns of the tile (CW = 4: 16-byte loads of the carry)
            constexpr int CW = W % 4 == 0 ? 4 : 1;
            typename EmbOut<T, ACC>::type* const out = dwte + (long long)v * C;
            const int col_end = min(C, (tile0 + NP) * W);
            for (int col = tile0 * W + threadIdx.x * CW; col < col_end; col += blockDim.x * CW) {
                float sum[CW];
#pragma unroll
                for (int e = 0; e < CW; ++e) sum[e] = 0.0f;
#pragma unroll 1
                for (int kb = k0; kb <= k1; kb += EMB_COMBINE) {
                    float x[EMB_COMBINE][CW];
#pragma unroll
                    for (int u = 0; u < EMB_COMBINE; ++u) {
                        const int kk = kb + u;
                        if (kk <= k1) {
                            const int s = kk * EMB_PIECE < st ? 1 : 0;  // v starts inside piece k0
                            emb_load_f32_cg<CW>(carry + ((long long)kk * 2 + s) * C + col, x[u]);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < EMB_COMBINE; ++u)
                        if (kb + u <= k1)
#pragma unroll
                            for (int e = 0; e < CW; ++e) sum[e] += x[u][e];
                }
                emb_put<T, CW, ACC>(out + col, sum);
            }
        }
        __syncthreads();  // s_last is reused for the second row
    }
}

// e. Grid (npieces + ceil(V / (EMB_ROWS * 4)), ntiles), 128 threads = 4 warps. Blocks x < npieces
// (npieces = ceil(B*T / EMB_PIECE), a bound that needs no count from the device) are the pieces of
// the hot rows (emb_hot_piece above; all return at once when no row is hot). The others walk rows: a
// warp owns EMB_ROWS consecutive token rows v0.. and one column tile of 32*KP packs (lane's packs:
// tile*32*KP + lane + 32k, k < KP). The rows' positions are one contiguous range
// pos[start(v0) .. start(v0 + rows)), which the warp walks in order in batches of EMB_BATCH
// positions -- a batch may span several rows, so rows with one or two positions (most of the
// vocabulary) do not each wait a full memory latency -- holding the positions 32 at a time in a
// register per lane (shuffled out). Each row is summed from 0.0f in ascending position order,
// exactly as embedding_backward_wte does, and written once (zeros for tokens that do not occur; ACC = 1:
// added into the fp32 row, and only for tokens that occur).
// Hot rows (more than EMB_PIECE positions) are jumped over: their pieces write them. The walk is
// therefore at most ~EMB_PIECE / EMB_BATCH latencies per row. VEC = 1 needs C % W == 0 and 16-byte
// aligned dx and dwte (the host checks). idx64: idx is int64 (else int32); carry: fp32
// [2 * npieces, C]; counters: [npieces * ntiles] ints, zero on entry.
template <typename T, int VEC, int KP, int ACC>
__global__ void __launch_bounds__(EMB_WTE_POS_THREADS, 4) embedding_backward_wte_pos(const T* __restrict__ dx,
                                                                  const void* __restrict__ idx, int idx64,
                                                                  const int* __restrict__ pos,
                                                                  const int* __restrict__ local,
                                                                  const int* __restrict__ blockoff,
                                                                  typename EmbOut<T, ACC>::type* __restrict__ dwte,
                                                                  float* __restrict__ carry,
                                                                  int* __restrict__ counters,
                                                                  const int* __restrict__ any_hot, int C, int V,
                                                                  int npieces) {
    if ((int)blockIdx.x < npieces) {
        emb_hot_piece<T, VEC, KP, ACC>(dx, idx, idx64, pos, local, blockoff, dwte, carry, counters, any_hot, C, V,
                                  (int)blockIdx.x);
        return;
    }
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = EMB_BATCH;
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const long long v0 =
        ((long long)((int)blockIdx.x - npieces) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * EMB_ROWS;
    if (v0 >= V) return;  // the whole warp
    const int nrows = (int)min((long long)EMB_ROWS, (long long)V - v0);
    const int nvec = C / W;
    const int j0 = blockIdx.y * (32 * KP) + lane;

    // lane r (r <= nrows) holds start(v0 + r); bit r of hot: row r has more than EMB_PIECE positions
    const int my_start = lane <= nrows ? emb_start(local, blockoff, v0 + lane) : 0;
    const int my_next = __shfl_down_sync(full, my_start, 1);
    const unsigned hot = __ballot_sync(full, lane < nrows && my_next - my_start > EMB_PIECE);
    const int qa = __shfl_sync(full, my_start, 0);
    const int qb = __shfl_sync(full, my_start, nrows);
    int r = 0;  // row being summed
    float acc[KP][W];
#pragma unroll
    for (int k = 0; k < KP; ++k)
#pragma unroll
        for (int e = 0; e < W; ++e) acc[k][e] = 0.0f;

    auto flush_row = [&]() {  // write row r (ACC: add it, if it has positions), start the next one from zero
        typename EmbOut<T, ACC>::type* out = dwte + (v0 + r) * (long long)C;
        // warp-uniform: every caller runs in warp-uniform control flow, and r is the same in all lanes
        const bool put = ACC == 0 || __shfl_sync(full, my_start, r + 1) > __shfl_sync(full, my_start, r);
#pragma unroll
        for (int k = 0; k < KP; ++k) {
            const int j = j0 + 32 * k;
            if (put && j < nvec) emb_put<T, W, ACC>(out + (long long)j * W, acc[k]);
#pragma unroll
            for (int e = 0; e < W; ++e) acc[k][e] = 0.0f;
        }
        ++r;
    };

    int q = qa;
    int qbuf = qa;  // lane l holds pos[qbuf + l]
    int pbuf = qa + lane < qb ? pos[qa + lane] : 0;
    for (;;) {
        // rows r .. h - 1 are not hot; h is the next hot row (nrows if none): walk up to its start
        const unsigned rest = hot & (0xffffffffu << r);
        const int h = rest ? __ffs(rest) - 1 : nrows;
        const int seg_end = __shfl_sync(full, my_start, h);
        int row_end = __shfl_sync(full, my_start, r + 1);  // start(v0 + r + 1)
        while (q < seg_end) {
            if (q - qbuf >= 32) {
                qbuf = q;
                pbuf = q + lane < qb ? pos[q + lane] : 0;
            }
            const int n = min(U, min(seg_end - q, qbuf + 32 - q));  // 1..U positions in this batch
            Packed<T, W> raw[U][KP];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long p = __shfl_sync(full, pbuf, (q - qbuf + u) & 31);
                const Packed<T, W>* src = reinterpret_cast<const Packed<T, W>*>(dx + p * C) + j0;
#pragma unroll
                for (int k = 0; k < KP; ++k)
                    if (u < n && j0 + 32 * k < nvec) raw[u][k] = src[32 * k];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u < n) {
                    while (q + u >= row_end) {  // the rows before this position are complete
                        flush_row();
                        row_end = __shfl_sync(full, my_start, r + 1);
                    }
#pragma unroll
                    for (int k = 0; k < KP; ++k)
                        if (j0 + 32 * k < nvec) emb_add_pack<T, W>(acc[k], raw[u][k]);
                }
            }
            q += n;
        }
        while (r < h) flush_row();  // the last row with positions, then empty rows
        if (h >= nrows) break;
        r = h + 1;  // skip the hot row (its pieces write it)
        q = __shfl_sync(full, my_start, r);
    }
}
