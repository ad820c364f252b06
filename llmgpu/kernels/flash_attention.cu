// flash_attention.cu: fused attention (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023), forward and
// backward, without ever writing the T × T scores to memory (chapter 2b).
//
// defines: flash_fwd_scalar (fp32 math, no tensor cores: the teaching step), flash_fwd (tensor cores),
//          flash_bwd_dot (D_i = dO_i · O_i), flash_bwd_dkdv and flash_bwd_dq (tensor cores, deterministic)
//
// Per (batch, head), q, k, v are [T, D], c = scale (1/√D by default), and every softmax is taken in base 2:
//
//   forward   t_ij = c · log2(e) · q_i·k_j          (−∞ where masked: causal key j > query i, or j ≥ T)
//             m_i  = max_j t_ij,  l_i = Σ_j 2^(t_ij − m_i),  o_i = Σ_j 2^(t_ij − m_i) v_j / l_i
//             lse_i = ln 2 · (m_i + log2 l_i)          (= log Σ_j exp(c q_i·k_j): natural log, as cuDNN's stats)
//   backward  P_ij = exp(c q_i·k_j − lse_i)  recomputed tile by tile,  D_i = Σ_d dO_id O_id
//             dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − D),  dQ = c · dS K,  dK = c · dSᵀ Q
//
// The forward walks over key/value tiles with the online softmax: a running maximum m and sum l per row;
// when a tile raises the maximum, the sum and the output accumulator are rescaled by 2^(m_old − m_new).
//
// Layout: q, k, v, o, dO, dq, dk, dv are [B, H, T, D] views with arbitrary element strides for B, H, T (the
// host passes them; split_qkv / heads_view give such views of the [B, T, 3C] and [B, T, C] buffers) and unit
// stride along D. The host checks that every stride is a multiple of 8 elements and every pointer is 16-byte
// aligned, so a row moves as 16-byte chunks. lse and D are contiguous fp32 [B, H, T]. Rows and keys at or
// beyond T are zero-filled in shared memory (so no uninitialised value meets a 0 probability) and masked.
//
// Tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (inline PTX, sm_80+: NVIDIA-only). One
// warp computes a 16 × 8 fp32 tile C += A B with A 16 × 16 and B 16 × 8 in 16-bit. Lane l holds, with
// g = l / 4 and c = 2 · (l % 4) (PTX ISA, "Matrix fragments for mma.m16n8k16"):
//   A: a0 = A[g][c..c+1], a1 = A[g+8][c..c+1], a2 = A[g][c+8..c+9], a3 = A[g+8][c+8..c+9]   (two 16-bit each)
//   B: b0 = B[c..c+1][g], b1 = B[c+8..c+9][g]                                                  (k pairs, column g)
//   C: c0, c1 = C[g][c], C[g][c+1];  c2, c3 = C[g+8][c], C[g+8][c+1]
// So the C fragments of two neighbouring 8-column score tiles are exactly the A fragment of a 16-column
// probability tile: P never leaves registers between the two GEMMs (rounded to 16 bits for the second).
// Fragments are read from shared memory with plain 32-bit (or paired 16-bit) loads; rows are padded by 8
// elements so that the 32 lanes of a warp hit 32 different banks.
//
// Determinism: no atomics anywhere. The backward runs one kernel over key tiles (dK, dV, looping over query
// tiles) and one over query tiles (dQ, looping over key tiles): each output element is written by exactly one
// thread in a fixed order, so two runs give the same bits. The price is computing the scores twice.
#include "common.cuh"

// llmgpu:kernel flash_fwd_scalar<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_fwd<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_bwd_dot<{__half,__nv_bfloat16}>
// llmgpu:kernel flash_bwd_dkdv<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_bwd_dq<{__half,__nv_bfloat16}, {64,128}>

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
#define FA_THREADS 128  // 4 warps in every kernel but flash_bwd_dot
#define FA_PAD 8        // elements of padding per shared-memory row (16 bytes)

extern __shared__ __align__(16) unsigned char fa_smem[];

template <typename T> struct fa_is_half { static constexpr bool value = false; };
template <> struct fa_is_half<__half> { static constexpr bool value = true; };

// --------------------------------------------------------------------------- shared helpers

// rows [row0, row0 + ROWS) of a [T, HD] view (row stride st elements) into shared memory (row stride HD + FA_PAD),
// 16 bytes per access; rows at or beyond T are zero-filled.
template <typename T, int ROWS, int HD>
__device__ __forceinline__ void fa_load_tile(T* s, const T* __restrict__ g, long long st, int row0, int T_len) {
    constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += FA_THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (row0 + r < T_len) v = *reinterpret_cast<const uint4*>(g + (long long)(row0 + r) * st + c);
        *reinterpret_cast<uint4*>(s + r * (HD + FA_PAD) + c) = v;
    }
}

__device__ __forceinline__ unsigned fa_lds32(const void* p) { return *reinterpret_cast<const unsigned*>(p); }

// Two 16-bit elements as one register: `lo` in the low half (the lower k index, as the MMA expects).
__device__ __forceinline__ unsigned fa_pair(const void* lo, const void* hi) {
    return (unsigned)*reinterpret_cast<const unsigned short*>(lo) |
           ((unsigned)*reinterpret_cast<const unsigned short*>(hi) << 16);
}

// A fragment of the 16 × 16 block at s (row-major, leading dimension ld).
template <typename T>
__device__ __forceinline__ void fa_frag_a(unsigned (&a)[4], const T* s, int ld, int lane) {
    const int g = lane >> 2, c = (lane & 3) * 2;
    a[0] = fa_lds32(s + g * ld + c);
    a[1] = fa_lds32(s + (g + 8) * ld + c);
    a[2] = fa_lds32(s + g * ld + c + 8);
    a[3] = fa_lds32(s + (g + 8) * ld + c + 8);
}

// B fragment (16 k × 8 n) of a matrix stored n-major, s[n][k] with k contiguous: K[key][d] for S = Q Kᵀ (k = d).
template <typename T>
__device__ __forceinline__ void fa_frag_b_nk(unsigned& b0, unsigned& b1, const T* s, int ld, int lane) {
    const int g = lane >> 2, c = (lane & 3) * 2;
    b0 = fa_lds32(s + g * ld + c);
    b1 = fa_lds32(s + g * ld + c + 8);
}

// B fragment (16 k × 8 n) of a matrix stored k-major, s[k][n] with n contiguous: V[key][d] for O = P V (k = key).
// The two elements of a register come from two rows, so they are read as 16-bit values and paired.
template <typename T>
__device__ __forceinline__ void fa_frag_b_kn(unsigned& b0, unsigned& b1, const T* s, int ld, int lane) {
    const int g = lane >> 2, c = (lane & 3) * 2;
    b0 = fa_pair(s + c * ld + g, s + (c + 1) * ld + g);
    b1 = fa_pair(s + (c + 8) * ld + g, s + (c + 9) * ld + g);
}

// The A fragment of a 16 × 16 probability block from the fp32 C fragments of its two 8-column halves.
template <typename T>
__device__ __forceinline__ void fa_c_to_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack2<T>(lo[0], lo[1]);
    a[1] = pack2<T>(lo[2], lo[3]);
    a[2] = pack2<T>(hi[0], hi[1]);
    a[3] = pack2<T>(hi[2], hi[3]);
}

// c += A B on the tensor cores (fp32 accumulation).
template <typename T>
__device__ __forceinline__ void fa_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (fa_is_half<T>::value) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Whether key `key` takes part in query row `row`'s softmax.
__device__ __forceinline__ bool fa_visible(int row, int key, int T_len, int causal) {
    return key < T_len && (!causal || key <= row);
}

// The reference point for 2^(t − ref): the running maximum, or 0 while a row has seen no finite score (so that
// −∞ − −∞ never makes a NaN; a NaN score is never the maximum, fmaxf drops it, and it reaches the sum instead).
__device__ __forceinline__ float fa_ref(float m) { return m == -LLMGPU_INF ? 0.0f : m; }

// --------------------------------------------------------------------------- 1. scalar tiled forward

// The teaching step between chapter 2's kernels and the tensor-core one: the same tiling and online softmax, in
// plain fp32 arithmetic. A block walks the keys in tiles of 32, staged in shared memory as fp32. TPR = HD / 16
// neighbouring threads share a query row (4 for HD = 64, 8 for HD = 128; so a block owns 128 / TPR rows):
// thread `part` holds dimensions part, part + TPR, part + 2·TPR, ... of q (pre-scaled by c · log2 e) and of the
// output accumulator, 16 each, so a dot product is TPR partial sums joined by log2(TPR) shuffles, and the TPR
// threads read consecutive shared-memory words (different banks).
template <typename T, int HD>
__global__ void __launch_bounds__(FA_THREADS)
flash_fwd_scalar(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                 float* __restrict__ lse, int H, int T_len, float scale, int causal, long long q_sb, long long q_sh,
                 long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh,
                 long long v_st, long long o_sb, long long o_sh, long long o_st) {
    constexpr int TPR = HD / 16, DPT = 16, BM = FA_THREADS / TPR, BN = 32;  // threads per row, dims per thread
    __shared__ float sK[BN][HD], sV[BN][HD];
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest causal rows first
    const int row = q0 + threadIdx.x / TPR, part = threadIdx.x % TPR;
    const T* kb = k + b * k_sb + h * k_sh;
    const T* vb = v + b * v_sb + h * v_sh;
    const float c2 = scale * FA_LOG2E;

    float qr[DPT], acc[DPT];
    const T* qrow = q + b * q_sb + h * q_sh + (long long)row * q_st;
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
        qr[i] = row < T_len ? to_float(qrow[part + TPR * i]) * c2 : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -LLMGPU_INF, l = 0.0f;
    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    for (int k0 = 0; k0 < kv_end; k0 += BN) {
        __syncthreads();  // every thread is done with the previous tile
        for (int i = threadIdx.x; i < BN * HD; i += FA_THREADS) {
            const int r = i / HD, d = i % HD;
            const bool in = k0 + r < T_len;
            sK[r][d] = in ? to_float(kb[(long long)(k0 + r) * k_st + d]) : 0.0f;
            sV[r][d] = in ? to_float(vb[(long long)(k0 + r) * v_st + d]) : 0.0f;
        }
        __syncthreads();
        float t[BN];
        float mx = m;
#pragma unroll
        for (int j = 0; j < BN; ++j) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < DPT; ++i) s += qr[i] * sK[j][part + TPR * i];
#pragma unroll
            for (int off = 1; off < TPR; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            t[j] = fa_visible(row, k0 + j, T_len, causal) ? s : -LLMGPU_INF;
            mx = fmaxf(mx, t[j]);
        }
        const float ref = fa_ref(mx), alpha = exp2f(m - ref);  // rescale what was summed against the old max
        m = mx;
        l *= alpha;
#pragma unroll
        for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
#pragma unroll
        for (int j = 0; j < BN; ++j) {
            const float p = exp2f(t[j] - ref);
            l += p;
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[i] += p * sV[j][part + TPR * i];
        }
    }
    if (row < T_len) {
        const float inv = 1.0f / l;
        T* orow = o + b * o_sb + h * o_sh + (long long)row * o_st;
#pragma unroll
        for (int i = 0; i < DPT; ++i) orow[part + TPR * i] = from_float<T>(acc[i] * inv);
        if (part == 0) lse[(long long)bh * T_len + row] = (fa_ref(m) + log2f(l)) * FA_LN2;
    }
}

// --------------------------------------------------------------------------- 2. tensor-core forward

// A block of 4 warps owns 64 query rows (16 per warp) and walks the keys in tiles of 64. Per tile each warp
// computes its 16 × 64 scores with HD/16 × 8 MMAs (Q from shared memory, K read n-major), applies the mask and
// the online softmax in registers (a row's 64 scores are spread over the 4 lanes of a quad: two shuffles per
// reduction), then adds P V with 4 × HD/8 MMAs (P from registers, V read k-major). Shared memory:
// (64 + 2 · 64) rows × (HD + 8) × 2 bytes = 27 KiB (HD = 64) or 51 KiB (HD = 128, above the 48 KiB default:
// the host raises the kernel's limit).
template <typename T, int HD>
__global__ void __launch_bounds__(FA_THREADS)
flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
          float* __restrict__ lse, int H, int T_len, float scale, int causal, long long q_sb, long long q_sh,
          long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh,
          long long v_st, long long o_sb, long long o_sh, long long o_st) {
    constexpr int BM = 64, BN = 64, LD = HD + FA_PAD;
    T* sQ = reinterpret_cast<T*>(fa_smem);
    T* sK = sQ + BM * LD;
    T* sV = sK + BN * LD;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest causal rows first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};  // this lane's two query rows
    const T* kb = k + b * k_sb + h * k_sh;
    const T* vb = v + b * v_sb + h * v_sh;
    const float c2 = scale * FA_LOG2E;

    fa_load_tile<T, BM, HD>(sQ, q + b * q_sb + h * q_sh, q_st, q0, T_len);
    float acc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {-LLMGPU_INF, -LLMGPU_INF}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sum

    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    for (int k0 = 0; k0 < kv_end; k0 += BN) {
        __syncthreads();  // every warp is done reading the previous K, V tile (and sQ is visible after the next)
        fa_load_tile<T, BN, HD>(sK, kb, k_st, k0, T_len);
        fa_load_tile<T, BN, HD>(sV, vb, v_st, k0, T_len);
        __syncthreads();

        float s[BN / 8][4];  // S = Q Kᵀ, this warp's 16 rows × 64 keys
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned a[4];
            fa_frag_a(a, sQ + warp * 16 * LD + kk * 16, LD, lane);
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_nk(b0, b1, sK + n * 8 * LD + kk * 16, LD, lane);
                fa_mma<T>(s[n], a, b0, b1);
            }
        }
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + c + (e & 1);
                s[n][e] = fa_visible(rows[e >> 1], key, T_len, causal) ? s[n][e] * c2 : -LLMGPU_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
            }
        float ref[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // the quad holds the whole row
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            ref[r] = fa_ref(mx[r]);
            const float alpha = exp2f(m[r] - ref[r]);
            m[r] = mx[r];
            l[r] *= alpha;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                acc[n][2 * r] *= alpha;
                acc[n][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - ref[e >> 1]);
                l[e >> 1] += s[n][e];
            }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {  // O += P V, 16 keys at a time
            unsigned a[4];
            fa_c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_kn(b0, b1, sV + kk * 16 * LD + n * 8, LD, lane);
                fa_mma<T>(acc[n], a, b0, b1);
            }
        }
    }
    T* ob = o + b * o_sb + h * o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (rows[r] >= T_len) continue;
        const float inv = 1.0f / l[r];
        T* orow = ob + (long long)rows[r] * o_st;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8 + c) = pack2<T>(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
        if ((lane & 3) == 0) lse[(long long)bh * T_len + rows[r]] = (fa_ref(m[r]) + log2f(l[r])) * FA_LN2;
    }
}

// --------------------------------------------------------------------------- 3. backward

// D_i = Σ_d dO_id · O_id, one warp per row (fp32 [B, H, T]); lanes stride over d.
template <typename T>
__global__ void flash_bwd_dot(const T* __restrict__ dout, const T* __restrict__ o, float* __restrict__ delta, int H,
                              int T_len, int D, long long rows, long long do_sb, long long do_sh, long long do_st,
                              long long o_sb, long long o_sh, long long o_st) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // a whole warp leaves together
    const int lane = threadIdx.x & 31, t = (int)(r % T_len);
    const long long bh = r / T_len, b = bh / H, h = bh % H;
    const T* a = dout + b * do_sb + h * do_sh + t * do_st;
    const T* y = o + b * o_sb + h * o_sh + t * o_st;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += to_float(a[d]) * to_float(y[d]);
    s = warp_sum(s);
    if (lane == 0) delta[r] = s;
}

// Query rows per tile of the backward kernels' inner loops: 64, or 32 for HD = 128 (registers: the dK and dV
// accumulators of HD = 128 already take 128 per thread).
template <int HD> struct fa_bwd_tile { static constexpr int value = HD == 128 ? 32 : 64; };

// dK and dV for 64 keys (16 per warp), looping over the query tiles that see them (causal: from the diagonal
// on). Per query tile, in each warp's registers: Sᵀ = K Qᵀ, Pᵀ = exp(c Sᵀ − lse), dV += Pᵀ dO, dPᵀ = V dOᵀ,
// dSᵀ = Pᵀ ⊙ (dPᵀ − D), dK += dSᵀ Q. Shared memory: K, V (64 rows), Q, dO (BM rows), lse·log2 e and D (BM each).
template <typename T, int HD>
__global__ void __launch_bounds__(FA_THREADS)
flash_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
               T* __restrict__ dv, int H, int T_len, float scale, int causal, long long q_sb, long long q_sh,
               long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh,
               long long v_st, long long do_sb, long long do_sh, long long do_st, long long dk_sb, long long dk_sh,
               long long dk_st, long long dv_sb, long long dv_sh, long long dv_st) {
    constexpr int BN = 64, BM = fa_bwd_tile<HD>::value, LD = HD + FA_PAD;
    T* sK = reinterpret_cast<T*>(fa_smem);
    T* sV = sK + BN * LD;
    T* sQ = sV + BN * LD;
    T* sdO = sQ + BM * LD;
    float* sL = reinterpret_cast<float*>(sdO + BM * LD);  // lse · log2 e of the tile's rows
    float* sD = sL + BM;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int k0 = blockIdx.y * BN;  // causal: the first key tiles see the most queries, and start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int keys[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};  // this lane's two rows of Sᵀ
    const T* qb = q + b * q_sb + h * q_sh;
    const T* dob = dout + b * do_sb + h * do_sh;
    const float* lseb = lse + (long long)bh * T_len;
    const float* deltab = delta + (long long)bh * T_len;
    const float c2 = scale * FA_LOG2E;

    fa_load_tile<T, BN, HD>(sK, k + b * k_sb + h * k_sh, k_st, k0, T_len);
    fa_load_tile<T, BN, HD>(sV, v + b * v_sb + h * v_sh, v_st, k0, T_len);
    float adk[HD / 8][4], adv[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) adk[n][e] = adv[n][e] = 0.0f;

    for (int q0 = causal ? (k0 / BM) * BM : 0; q0 < T_len; q0 += BM) {
        __syncthreads();  // every warp is done with the previous Q, dO tile
        fa_load_tile<T, BM, HD>(sQ, qb, q_st, q0, T_len);
        fa_load_tile<T, BM, HD>(sdO, dob, do_st, q0, T_len);
        for (int i = threadIdx.x; i < BM; i += FA_THREADS) {
            const bool in = q0 + i < T_len;
            sL[i] = in ? lseb[q0 + i] * FA_LOG2E : 0.0f;
            sD[i] = in ? deltab[q0 + i] : 0.0f;
        }
        __syncthreads();

        float p[BM / 8][4];  // Sᵀ, then Pᵀ, then dSᵀ: this warp's 16 keys × BM queries
#pragma unroll
        for (int n = 0; n < BM / 8; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned a[4];
            fa_frag_a(a, sK + warp * 16 * LD + kk * 16, LD, lane);
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_nk(b0, b1, sQ + n * 8 * LD + kk * 16, LD, lane);
                fa_mma<T>(p[n], a, b0, b1);
            }
        }
#pragma unroll
        for (int n = 0; n < BM / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + c + (e & 1);
                p[n][e] = fa_visible(q0 + col, keys[e >> 1], T_len, causal) && q0 + col < T_len
                              ? exp2f(p[n][e] * c2 - sL[col]) : 0.0f;
            }
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {  // dV += Pᵀ dO
            unsigned a[4];
            fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_kn(b0, b1, sdO + kk * 16 * LD + n * 8, LD, lane);
                fa_mma<T>(adv[n], a, b0, b1);
            }
        }
        float dp[BM / 8][4];  // dPᵀ = V dOᵀ
#pragma unroll
        for (int n = 0; n < BM / 8; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned a[4];
            fa_frag_a(a, sV + warp * 16 * LD + kk * 16, LD, lane);
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_nk(b0, b1, sdO + n * 8 * LD + kk * 16, LD, lane);
                fa_mma<T>(dp[n], a, b0, b1);
            }
        }
#pragma unroll
        for (int n = 0; n < BM / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - sD[n * 8 + c + (e & 1)];  // dSᵀ (without c)
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {  // dK += dSᵀ Q
            unsigned a[4];
            fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_kn(b0, b1, sQ + kk * 16 * LD + n * 8, LD, lane);
                fa_mma<T>(adk[n], a, b0, b1);
            }
        }
    }
    T* dkb = dk + b * dk_sb + h * dk_sh;
    T* dvb = dv + b * dv_sb + h * dv_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (keys[r] >= T_len) continue;
        T* krow = dkb + (long long)keys[r] * dk_st;
        T* vrow = dvb + (long long)keys[r] * dv_st;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            *reinterpret_cast<unsigned*>(krow + n * 8 + c) =
                pack2<T>(adk[n][2 * r] * scale, adk[n][2 * r + 1] * scale);
            *reinterpret_cast<unsigned*>(vrow + n * 8 + c) = pack2<T>(adv[n][2 * r], adv[n][2 * r + 1]);
        }
    }
}

// dQ for 64 query rows (16 per warp), looping over key tiles (causal: up to the diagonal). Per key tile:
// S = Q Kᵀ, P = exp(c S − lse), dP = dO Vᵀ, dS = P ⊙ (dP − D), dQ += dS K. Shared memory: Q, dO (64 rows),
// K, V (BN rows); each lane keeps lse and D of its two rows in registers.
template <typename T, int HD>
__global__ void __launch_bounds__(FA_THREADS)
flash_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
             const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int H, int T_len,
             float scale, int causal, long long q_sb, long long q_sh, long long q_st, long long k_sb, long long k_sh,
             long long k_st, long long v_sb, long long v_sh, long long v_st, long long do_sb, long long do_sh,
             long long do_st, long long dq_sb, long long dq_sh, long long dq_st) {
    constexpr int BM = 64, BN = fa_bwd_tile<HD>::value, LD = HD + FA_PAD;
    T* sQ = reinterpret_cast<T*>(fa_smem);
    T* sdO = sQ + BM * LD;
    T* sK = sdO + BM * LD;
    T* sV = sK + BN * LD;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest causal rows first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    const T* kb = k + b * k_sb + h * k_sh;
    const T* vb = v + b * v_sb + h * v_sh;
    const float c2 = scale * FA_LOG2E;
    float rl[2], rd[2];  // lse · log2 e and D of this lane's rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool in = rows[r] < T_len;
        rl[r] = in ? lse[(long long)bh * T_len + rows[r]] * FA_LOG2E : 0.0f;
        rd[r] = in ? delta[(long long)bh * T_len + rows[r]] : 0.0f;
    }
    fa_load_tile<T, BM, HD>(sQ, q + b * q_sb + h * q_sh, q_st, q0, T_len);
    fa_load_tile<T, BM, HD>(sdO, dout + b * do_sb + h * do_sh, do_st, q0, T_len);
    float adq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) adq[n][0] = adq[n][1] = adq[n][2] = adq[n][3] = 0.0f;

    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    for (int k0 = 0; k0 < kv_end; k0 += BN) {
        __syncthreads();
        fa_load_tile<T, BN, HD>(sK, kb, k_st, k0, T_len);
        fa_load_tile<T, BN, HD>(sV, vb, v_st, k0, T_len);
        __syncthreads();
        float p[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned a[4], a2[4];
            fa_frag_a(a, sQ + warp * 16 * LD + kk * 16, LD, lane);
            fa_frag_a(a2, sdO + warp * 16 * LD + kk * 16, LD, lane);
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_nk(b0, b1, sK + n * 8 * LD + kk * 16, LD, lane);
                fa_mma<T>(p[n], a, b0, b1);    // S = Q Kᵀ
                fa_frag_b_nk(b0, b1, sV + n * 8 * LD + kk * 16, LD, lane);
                fa_mma<T>(dp[n], a2, b0, b1);  // dP = dO Vᵀ
            }
        }
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, key = k0 + n * 8 + c + (e & 1);
                const float pe = fa_visible(rows[r], key, T_len, causal) ? exp2f(p[n][e] * c2 - rl[r]) : 0.0f;
                p[n][e] = pe * (dp[n][e] - rd[r]);  // dS (without c)
            }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {  // dQ += dS K
            unsigned a[4];
            fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                unsigned b0, b1;
                fa_frag_b_kn(b0, b1, sK + kk * 16 * LD + n * 8, LD, lane);
                fa_mma<T>(adq[n], a, b0, b1);
            }
        }
    }
    T* dqb = dq + b * dq_sb + h * dq_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= T_len) continue;
        T* qrow = dqb + (long long)rows[r] * dq_st;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
            *reinterpret_cast<unsigned*>(qrow + n * 8 + c) = pack2<T>(adq[n][2 * r] * scale, adq[n][2 * r + 1] * scale);
    }
}
