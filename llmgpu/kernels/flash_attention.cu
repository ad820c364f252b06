// flash_attention.cu: fused attention (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023), forward and
// backward, without ever writing the T × T scores to memory (chapter 2b).
//
// defines: flash_fwd_scalar (fp32 math, no tensor cores: the teaching step), flash_fwd (tensor cores),
//          flash_bwd_dot (D_i = dO_i · O_i), flash_bwd_dkdv and flash_bwd_dq (tensor cores, deterministic),
//          flash_bwd_dkdv_wide and flash_bwd_dq_wide (the default: two 16-row tiles per warp; the dQ one computes D)
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
// Grouped-query attention: k, v, dk, dv may have H / G heads (G divides H; G = 1 is plain multi-head attention),
// query head h reading K/V head h / G. The forward and dQ kernels run over query heads and read K, V of head h / G;
// the dK, dV kernels run over K/V heads, and a block walks the query tiles of its G query heads one head after the
// other, summing into the same fp32 register accumulators, then stores once. So the sum over the group is exact in
// fp32, in a fixed order (bitwise repeatable), with no atomics, no [B, H, T, D] scratch and no reduction kernel
// (FlashAttention-2 sums an expanded dK, dV afterwards instead); with G = 1 it is the loop it always was.
//
// Tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (inline PTX, sm_80+: NVIDIA-only). One
// warp computes a 16 × 8 fp32 tile C += A B with A 16 × 16 and B 16 × 8 in 16-bit. Lane l holds, with
// g = l / 4 and c = 2 · (l % 4) (PTX ISA, "Matrix fragments for mma.m16n8k16"):
//   A: a0 = A[g][c..c+1], a1 = A[g+8][c..c+1], a2 = A[g][c+8..c+9], a3 = A[g+8][c+8..c+9]   (two 16-bit each)
//   B: b0 = B[c..c+1][g], b1 = B[c+8..c+9][g]                                                  (k pairs, column g)
//   C: c0, c1 = C[g][c], C[g][c+1];  c2, c3 = C[g+8][c], C[g+8][c+1]
// So the C fragments of two neighbouring 8-column score tiles are exactly the A fragment of a 16-column
// probability tile: P never leaves registers between the two GEMMs (rounded to 16 bits for the second).
// Fragments are read from shared memory with ldmatrix (.trans where a register's two elements come from two rows),
// rows padded by 8 elements (16 bytes) so that no ldmatrix has a bank conflict; the inner tiles arrive by cp.async,
// double-buffered (or in a ring of three), so the next tile's copy overlaps this tile's MMAs.
//
// RoPE (the fast Llama step): q and k arrive rotated (ops/rope.py, applied in place after the QKV GEMM), so the
// backward's dQ and dK are gradients with respect to the rotated vectors. The wide kernels can fold RoPE's backward
// (the inverse rotation, dx_j = dy_j cos + dy_{j+D/2} sin, dx_{j+D/2} = dy_{j+D/2} cos − dy_j sin) into their
// stores (ROPE = 1, given its fp32 tables): a separate pass over dQ and dK less, and one rounding less.
//
// Determinism: no atomics anywhere. The backward runs one kernel over key tiles (dK, dV, looping over query
// tiles) and one over query tiles (dQ, looping over key tiles): each output element is written by exactly one
// thread in a fixed order, so two runs give the same bits. The price is computing the scores twice.
#include "common.cuh"
#include "flash_common.cuh"

// llmgpu:kernel flash_fwd_scalar<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_fwd<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_bwd_dot<{__half,__nv_bfloat16}>
// llmgpu:kernel flash_bwd_dkdv<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_bwd_dq<{__half,__nv_bfloat16}, {64,128}>
// llmgpu:kernel flash_bwd_dkdv_wide<{__half,__nv_bfloat16}, {64,128}, {0,1}>
// llmgpu:kernel flash_bwd_dq_wide<{__half,__nv_bfloat16}, {64,128}, {0,1}>

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
#define FA_THREADS 128  // the scalar forward (the tensor-core kernels: fa_cfg)
#define FA_PAD 8        // elements of padding per shared-memory row (16 bytes)

extern __shared__ __align__(16) unsigned char fa_smem[];

template <typename T> struct fa_is_half { static constexpr bool value = false; };
template <> struct fa_is_half<__half> { static constexpr bool value = true; };

// --------------------------------------------------------------------------- shared helpers

// Tile shapes of the tensor-core kernels (the host's launches and shared memory need them too: FA_CFG in
// ops/flash_launch.py, which tests/test_kernel_constants.py checks against this struct with the compiler).
// Every warp owns 16 rows of its kernel's outer tile (queries in flash_fwd and flash_bwd_dq, keys in
// flash_bwd_dkdv); the inner tile is what the loop walks over, double-buffered in shared memory.
template <int HD> struct fa_cfg {
    static constexpr int FWD_MT = HD == 64 ? 2 : 1;     // flash_fwd: 16-row tiles per warp
    static constexpr int FWD_WARPS = 8 / FWD_MT;        //   128 query rows per block
    static constexpr int FWD_BN = 64;                   //   keys per inner tile
    static constexpr int FWD_BUFS = 3;                  //   a ring of K, V tiles: two in flight while one is used
    static constexpr int FWD_MIN_BLOCKS = HD == 64 ? 2 : 1;  // resident blocks
    static constexpr int DKDV_WARPS = 4;                // flash_bwd_dkdv: 64 keys per block
    static constexpr int DKDV_BM = HD == 128 ? 16 : 64;  //   queries per inner tile (registers: HD = 128's dK, dV
                                                        //   accumulators already take 128 per thread)
    static constexpr int DKDV_MIN_BLOCKS = HD == 64 ? 2 : 1;
    static constexpr int DQ_WARPS = 4;                  // flash_bwd_dq: 64 query rows per block
    static constexpr int DQ_BN = HD == 128 ? 32 : 64;   //   keys per inner tile
    static constexpr int DQ_MIN_BLOCKS = 2;
    // the wide backward (flash_bwd_dkdv_wide, flash_bwd_dq_wide): WIDE_MT 16-row tiles per warp
    static constexpr int WIDE_MT = HD == 64 ? 2 : 1;    //   (HD = 128: one, its accumulators fill the registers)
    static constexpr int WIDE_KV_BM = 32;               //   queries per inner tile of dK, dV
    static constexpr int WIDE_DQ_BN = 32;               //   keys per inner tile of dQ
    static constexpr int WIDE_DQ_BUFS = HD == 64 ? 3 : 2;  //   buffers of its ring (3 × HD 128's would not fit 3 blocks)
    static constexpr int WIDE_DQ_MIN_BLOCKS = 3;        //   resident blocks of dQ (caps registers at 168)
};

// Rows [row0, row0 + ROWS) of a [T, HD] view (row stride st elements) into shared memory (row stride HD + FA_PAD),
// 16 bytes per cp.async by NT threads; rows at or beyond T are zero-filled.
template <typename T, int ROWS, int HD, int NT>
__device__ __forceinline__ void fa_load_tile(T* s, const T* __restrict__ g, long long st, int row0, int T_len) {
    constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
    static_assert(ROWS * CHUNKS % NT == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int it = 0; it < ROWS * CHUNKS / NT; ++it) {
        const int i = threadIdx.x + it * NT, r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool in = row0 + r < T_len;  // 32-bit row offsets (fewer registers): the host checks T · st < 2^31
        fa_cp16(s + r * (HD + FA_PAD) + c, g + ((in ? row0 + r : 0) * static_cast<int>(st) + c), in);
    }
}

// ldmatrix (sm_75+): each lane gives the address of one 16-byte row of four 8 × 8 16-bit matrices (lanes 8i..8i+7
// the rows of matrix i) and receives, in register i, its two elements of matrix i in the MMA fragment layout
// (lane l: row l / 4, elements 2 (l % 4), +1). With .trans it receives them from the transposed matrix, which
// turns a k-major tile into the k-pairs a B fragment needs. Rows are padded by FA_PAD elements (16 bytes), so the
// 8 rows of a matrix fall in 8 different 16-byte bank groups: conflict-free.
__device__ __forceinline__ void fa_ldsm(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_saddr(p)));
}
__device__ __forceinline__ void fa_ldsm_t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_saddr(p)));
}

// A fragment of the 16 × 16 block at s (row-major, leading dimension ld): matrices (rows 0-7, cols 0-7),
// (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are a0..a3, so lane l points at row l % 16, column 8 · (l / 16).
template <typename T>
__device__ __forceinline__ void fa_frag_a(unsigned (&a)[4], const T* s, int ld, int lane) {
    fa_ldsm(a, s + (lane & 15) * ld + (lane >> 4) * 8);
}

// B fragments of two neighbouring 8-column tiles (16 k × 16 n) of a matrix stored n-major, s[n][k] with k
// contiguous: K[key][d] for S = Q Kᵀ (k = d). b[0], b[1] are n-tile 0's b0, b1; b[2], b[3] n-tile 1's.
// Lane l points at row n = l % 8 + 8 · (l / 16), column k = 8 · ((l / 8) % 2).
template <typename T>
__device__ __forceinline__ void fa_frag_b_nk(unsigned (&b)[4], const T* s, int ld, int lane) {
    fa_ldsm(b, s + ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8);
}

// The same from a matrix stored k-major, s[k][n] with n contiguous: V[key][d] for O = P V (k = key). ldmatrix
// .trans pairs two k rows in one register. Lane l points at row k = l % 8 + 8 · ((l / 8) % 2), column 8 · (l / 16).
template <typename T>
__device__ __forceinline__ void fa_frag_b_kn(unsigned (&b)[4], const T* s, int ld, int lane) {
    fa_ldsm_t(b, s + ((lane & 7) + (((lane >> 3) & 1) << 3)) * ld + (lane >> 4) * 8);
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

// C (16 × 16·N2) += A (16 × 16 in a[]) · B, B's 16·N2 columns read two 8-column tiles per ldmatrix from s: N2
// ldmatrix.x4 and 2·N2 MMAs. KN: B stored k-major (fa_frag_b_kn, s advances 16 columns per step), else n-major
// (fa_frag_b_nk, s advances 16 rows).
template <typename T, int N2, bool KN>
__device__ __forceinline__ void fa_mma_row(float (*c)[4], const unsigned (&a)[4], const T* s, int ld, int lane) {
#pragma unroll
    for (int n = 0; n < N2; ++n) {
        unsigned b[4];
        if constexpr (KN) fa_frag_b_kn(b, s + n * 16, ld, lane);
        else fa_frag_b_nk(b, s + n * 16 * ld, ld, lane);
        fa_mma<T>(c[2 * n], a, b[0], b[1]);
        fa_mma<T>(c[2 * n + 1], a, b[2], b[3]);
    }
}

// The same for MT row tiles at once, c[m] += a[m] B: every B fragment read from shared memory feeds MT MMA pairs,
// so a warp that owns 32 rows reads half the bytes per MMA of one that owns 16.
template <typename T, int MT, int N2, bool KN>
__device__ __forceinline__ void fa_mma_rows(float (&c)[MT][2 * N2][4], const unsigned (&a)[MT][4], const T* s, int ld,
                                            int lane) {
#pragma unroll
    for (int n = 0; n < N2; ++n) {
        unsigned b[4];
        if constexpr (KN) fa_frag_b_kn(b, s + n * 16, ld, lane);
        else fa_frag_b_nk(b, s + n * 16 * ld, ld, lane);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            fa_mma<T>(c[m][2 * n], a[m], b[0], b[1]);
            fa_mma<T>(c[m][2 * n + 1], a[m], b[2], b[3]);
        }
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
                 float* __restrict__ lse, int H, int G, int T_len, float scale, int causal, long long q_sb,
                 long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                 long long v_sh, long long v_st, long long o_sb, long long o_sh, long long o_st) {
    constexpr int TPR = HD / 16, DPT = 16, BM = FA_THREADS / TPR, BN = 32;  // threads per row, dims per thread
    __shared__ float sK[BN][HD], sV[BN][HD];
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest causal rows first
    const int row = q0 + threadIdx.x / TPR, part = threadIdx.x % TPR;
    const T* kb = k + b * k_sb + fa_udiv(h, G) * k_sh;  // the K/V head of query head h
    const T* vb = v + b * v_sb + fa_udiv(h, G) * v_sh;
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

// A block owns 128 query rows: 8 warps of 16 rows (HD = 128), or 4 warps of 32 (HD = 64: FWD_MT = 2 row tiles per
// warp, so each K, V fragment read from shared memory feeds two MMAs, as in the wide backward), and walks the keys
// in tiles of 64, so every K, V tile brought into shared memory feeds the whole block's MMAs. The tiles come through a ring of three buffers: while the
// warps compute on tile j, cp.async brings tiles j + 1 and j + 2, and one barrier per tile suffices (the one at the
// top of tile j proves every warp has left tile j − 1, whose buffer tile j + 2 takes). Per tile each warp computes
// its 16 · FWD_MT × 64 scores with FWD_MT × HD/16 × 8 MMAs (K read n-major with ldmatrix), applies the mask only
// where the tile needs one (the causal diagonal, the last tile past T), runs the online softmax in registers (a row's 64 scores are spread over the 4 lanes of a quad: two shuffles per
// reduction), then adds P V with 4 × HD/8 MMAs (P from registers, V read k-major with ldmatrix.trans). Causal:
// a warp skips the tiles that lie wholly above its diagonal, and the block stops at its last row.
// Shared memory: (128 + 3 · 2 · 64) rows × (HD + 8) × 2 bytes = 72 KiB (HD = 64, two blocks per SM) or 136 KiB
// (HD = 128, one); both above the 48 KiB default: the host raises the kernel's limit. Registers: HD = 64 at 32 rows
// per warp needs ~240 (two blocks of 4 warps per SM); 16 rows per warp fit in 128 with two blocks of 8 warps, which
// measured 2–4 % slower (dev/cuda/flash_backward_hypotheses.md, H7).
template <typename T, int HD>
__global__ void __launch_bounds__(fa_cfg<HD>::FWD_WARPS * 32, fa_cfg<HD>::FWD_MIN_BLOCKS)
flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
          float* __restrict__ lse, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
          long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
          long long v_sh, long long v_st, long long o_sb, long long o_sh, long long o_st) {
    constexpr int MT = fa_cfg<HD>::FWD_MT, WQ = 16 * MT;  // 16-row tiles and rows per warp
    constexpr int NT = fa_cfg<HD>::FWD_WARPS * 32, BM = fa_cfg<HD>::FWD_WARPS * WQ, BN = fa_cfg<HD>::FWD_BN;
    constexpr int LD = HD + FA_PAD, NBUF = fa_cfg<HD>::FWD_BUFS;
    static_assert(NBUF == 3, "two tiles in flight: tile j + 2 takes tile j - 1's buffer");
    T* sQ = reinterpret_cast<T*>(fa_smem);
    T* sK = sQ + BM * LD;         // a ring of NBUF buffers of BN rows
    T* sV = sK + NBUF * BN * LD;  // a ring of NBUF buffers of BN rows
    const int bh = fa_block_head(), b = bh / H, h = bh % H;
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int q0 = fa_block_tile(true) * BM;  // the longest causal rows first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int w0 = q0 + warp * WQ;  // this warp's first row; lane rows w0 + 16 mm + g (+ 8)
    const T* kb = k + b * k_sb + fa_udiv(h, G) * k_sh;  // the K/V head of query head h
    const T* vb = v + b * v_sb + fa_udiv(h, G) * v_sh;
    const float c2 = scale * FA_LOG2E;
    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    const int n_tiles = (kv_end + BN - 1) / BN;
    fa_load_tile<T, BM, HD, NT>(sQ, q + b * q_sb + h * q_sh, q_st, q0, T_len);
    fa_load_tile<T, BN, HD, NT>(sK, kb, k_st, 0, T_len);
    fa_load_tile<T, BN, HD, NT>(sV, vb, v_st, 0, T_len);
    fa_cp_commit();
    if (n_tiles > 1) {  // two tiles in flight from the start
        fa_load_tile<T, BN, HD, NT>(sK + BN * LD, kb, k_st, BN, T_len);
        fa_load_tile<T, BN, HD, NT>(sV + BN * LD, vb, v_st, BN, T_len);
        fa_cp_commit();
    }
    float acc[MT][HD / 8][4];
#pragma unroll
    for (int mm = 0; mm < MT; ++mm)
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) acc[mm][n][0] = acc[mm][n][1] = acc[mm][n][2] = acc[mm][n][3] = 0.0f;
    float m[MT][2], l[MT][2];  // running max and this lane's part of the row sum, per row
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) m[mm][0] = m[mm][1] = -LLMGPU_INF, l[mm][0] = l[mm][1] = 0.0f;

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BN;
        const T* cK = sK + (j % NBUF) * BN * LD;
        const T* cV = sV + (j % NBUF) * BN * LD;
        if (j + 1 < n_tiles) fa_cp_wait<1>();  // tile j (and Q) landed; tile j + 1 may still be in flight
        else fa_cp_wait<0>();
        __syncthreads();  // tile j is visible to every warp, and every warp is done with tile j − 1
        if (j + 2 < n_tiles) {  // so tile j + 2 can take tile j − 1's buffer
            fa_load_tile<T, BN, HD, NT>(sK + ((j + 2) % NBUF) * BN * LD, kb, k_st, k0 + 2 * BN, T_len);
            fa_load_tile<T, BN, HD, NT>(sV + ((j + 2) % NBUF) * BN * LD, vb, v_st, k0 + 2 * BN, T_len);
            fa_cp_commit();
        }
        // a warp whose rows are all past T, or (causal) whose rows all lie before the tile's first key, skips it
        if (w0 < T_len && (!causal || k0 <= w0 + WQ - 1)) {
            float s[MT][BN / 8][4];  // S = Q Kᵀ, this warp's WQ rows × BN keys
#pragma unroll
            for (int mm = 0; mm < MT; ++mm)
#pragma unroll
                for (int n = 0; n < BN / 8; ++n) s[mm][n][0] = s[mm][n][1] = s[mm][n][2] = s[mm][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int mm = 0; mm < MT; ++mm) fa_frag_a(a[mm], sQ + (warp * WQ + mm * 16) * LD + kk * 16, LD, lane);
                fa_mma_rows<T, MT, BN / 16, false>(s, a, cK + kk * 16, LD, lane);
            }
            if ((causal && k0 + BN - 1 > w0) || k0 + BN > T_len) {  // the diagonal or the ragged last tile
#pragma unroll
                for (int mm = 0; mm < MT; ++mm)
#pragma unroll
                    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = k0 + n * 8 + c + (e & 1), row = w0 + mm * 16 + g + 8 * (e >> 1);
                            s[mm][n][e] = fa_visible(row, key, T_len, causal) ? s[mm][n][e] * c2 : -LLMGPU_INF;
                        }
            } else {
#pragma unroll
                for (int mm = 0; mm < MT; ++mm)
#pragma unroll
                    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mm][n][e] *= c2;
            }
#pragma unroll
            for (int mm = 0; mm < MT; ++mm) {
                float mx[2] = {m[mm][0], m[mm][1]};
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mm][n][e]);
                float ref[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // the quad holds the whole row
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    ref[r] = fa_ref(mx[r]);
                    const float alpha = fast_exp2(m[mm][r] - ref[r]);  // rescale what was summed against the old max
                    m[mm][r] = mx[r];
                    l[mm][r] *= alpha;
#pragma unroll
                    for (int n = 0; n < HD / 8; ++n) {
                        acc[mm][n][2 * r] *= alpha;
                        acc[mm][n][2 * r + 1] *= alpha;
                    }
                }
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mm][n][e] = fast_exp2(s[mm][n][e] - ref[e >> 1]);
                        l[mm][e >> 1] += s[mm][n][e];
                    }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {  // O += P V, 16 keys at a time
                unsigned a[MT][4];
#pragma unroll
                for (int mm = 0; mm < MT; ++mm) fa_c_to_a<T>(a[mm], s[mm][2 * kk], s[mm][2 * kk + 1]);
                fa_mma_rows<T, MT, HD / 16, true>(acc, a, cV + kk * 16 * LD, LD, lane);
            }
        }
    }
    T* ob = o + b * o_sb + h * o_sh;
#pragma unroll
    for (int mm = 0; mm < MT; ++mm)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mm][r] += __shfl_xor_sync(0xffffffffu, l[mm][r], 1);
            l[mm][r] += __shfl_xor_sync(0xffffffffu, l[mm][r], 2);
            const int row = w0 + mm * 16 + g + 8 * r;
            if (row >= T_len) continue;
            const float inv = 1.0f / l[mm][r];
            T* orow = ob + (long long)row * o_st;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n)
                *reinterpret_cast<unsigned*>(orow + n * 8 + c) =
                    pack2<T>(acc[mm][n][2 * r] * inv, acc[mm][n][2 * r + 1] * inv);
            if ((lane & 3) == 0) lse[(long long)bh * T_len + row] = (fa_ref(m[mm][r]) + log2f(l[mm][r])) * FA_LN2;
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

// dK and dV for 16 · DKDV_WARPS keys (16 per warp) of one K/V head, looping over the query tiles of BM = DKDV_BM rows
// that see them (causal: from the diagonal on), of each of its G query heads in turn. The Q, dO, lse, D tiles are
// double-buffered (cp.async brings tile i + 1 while the warps compute on tile i). Per query tile, in each warp's
// registers: Sᵀ = K Qᵀ, Pᵀ = exp(c Sᵀ − lse), dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − D), dK += dSᵀ Q; the dK, dV
// accumulators stay in registers for the whole loop. Masks only on the diagonal and ragged tiles. Shared memory: K,
// V (BN rows), two buffers of Q, dO (BM rows each), of lse · log2 e and of D (BM floats each).
template <typename T, int HD>
__global__ void __launch_bounds__(fa_cfg<HD>::DKDV_WARPS * 32, fa_cfg<HD>::DKDV_MIN_BLOCKS)
flash_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
               int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb, long long q_sh,
               long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh,
               long long v_st, long long do_sb, long long do_sh, long long do_st, long long dk_sb, long long dk_sh,
               long long dk_st, long long dv_sb, long long dv_sh, long long dv_st) {
    constexpr int NT = fa_cfg<HD>::DKDV_WARPS * 32, BN = fa_cfg<HD>::DKDV_WARPS * 16, BM = fa_cfg<HD>::DKDV_BM;
    constexpr int LD = HD + FA_PAD;
    T* sK = reinterpret_cast<T*>(fa_smem);
    T* sV = sK + BN * LD;
    T* sQ = sV + BN * LD;      // two buffers of BM rows
    T* sdO = sQ + 2 * BM * LD;  // two buffers of BM rows
    float* sL = reinterpret_cast<float*>(sdO + 2 * BM * LD);  // two buffers: lse of the tile's rows
    float* sD = sL + 2 * BM;                                  // two buffers: D
    const int bh = fa_block_head(), b = fa_udiv(bh, H / G), h = bh - b * (H / G);  // K/V head h of batch b
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int k0 = fa_block_tile(false) * BN;  // causal: the first key tiles see the most queries, and start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int w0 = k0 + warp * 16;                 // this warp's first key
    const int keys[2] = {w0 + g, w0 + g + 8};  // this lane's two rows of Sᵀ
    const T* qb = q + b * q_sb + h * G * q_sh;  // the group's first query head h·G (its j-th: j · q_sh on)
    const T* dob = dout + b * do_sb + h * G * do_sh;
    const float* lseb = lse + (long long)bh * G * T_len;  // rows of query head b·H + h·G = bh·G
    const float* deltab = delta + (long long)bh * G * T_len;
    const float c2 = scale * FA_LOG2E;

    // the query tiles [q_first, T): causal ones before the block's first key see none of its keys; the loop's n_steps
    // steps walk them for query head h·G, then h·G + 1, ... (no division: the next tile's row wraps to q_first)
    const int q_first = causal ? (k0 / BM) * BM : 0;
    const int n_steps = G * ((T_len - q_first + BM - 1) / BM);
    int lj = 0, lq0 = q_first;  // the group's query head and first row of the next tile to load
    auto load_q_tile = [&](int i) {  // Q, dO, lse, D of step i into buffer i % 2
        const int buf = i & 1;
        fa_load_tile<T, BM, HD, NT>(sQ + buf * BM * LD, qb + lj * q_sh, q_st, lq0, T_len);
        fa_load_tile<T, BM, HD, NT>(sdO + buf * BM * LD, dob + lj * do_sh, do_st, lq0, T_len);
        for (int r = threadIdx.x; r < 2 * BM; r += NT) {  // lse and D: BM floats each, 4 bytes per copy
            const int row = lq0 + r % BM;
            const bool in = row < T_len, is_l = r < BM;
            const float* src = (is_l ? lseb : deltab) + (long long)lj * T_len;
            fa_cp4((is_l ? sL : sD) + buf * BM + r % BM, src + (in ? row : 0), in);
        }
        lq0 += BM;
        if (lq0 >= T_len) lq0 = q_first, ++lj;
    };
    fa_load_tile<T, BN, HD, NT>(sK, k + b * k_sb + h * k_sh, k_st, k0, T_len);
    fa_load_tile<T, BN, HD, NT>(sV, v + b * v_sb + h * v_sh, v_st, k0, T_len);
    load_q_tile(0);
    fa_cp_commit();

    float adk[HD / 8][4], adv[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) adk[n][e] = adv[n][e] = 0.0f;

    for (int i = 0, q0 = q_first; i < n_steps; ++i, q0 = q0 + BM < T_len ? q0 + BM : q_first) {
        const T* cQ = sQ + (i & 1) * BM * LD;
        const T* cdO = sdO + (i & 1) * BM * LD;
        const float* cL = sL + (i & 1) * BM;
        const float* cD = sD + (i & 1) * BM;
        if (i + 1 < n_steps) {
            load_q_tile(i + 1);
            fa_cp_commit();
            fa_cp_wait<1>();
        } else {
            fa_cp_wait<0>();
        }
        __syncthreads();
        // skip: keys all past T, or (causal) every query of the tile before this warp's first key
        if (w0 < T_len && (!causal || q0 + BM - 1 >= w0)) {
            const bool edge = (causal && q0 < w0 + 15) || q0 + BM > T_len || w0 + 16 > T_len;
            float p[BM / 8][4];  // Sᵀ, then Pᵀ, then dSᵀ: this warp's 16 keys × BM queries
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[4];
                fa_frag_a(a, sK + warp * 16 * LD + kk * 16, LD, lane);
                fa_mma_row<T, BM / 16, false>(p, a, cQ + kk * 16, LD, lane);
            }
#pragma unroll
            for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n * 8 + c + (e & 1);
                    const float pe = fast_exp2(p[n][e] * c2 - cL[col] * FA_LOG2E);
                    p[n][e] = !edge || (fa_visible(q0 + col, keys[e >> 1], T_len, causal) && q0 + col < T_len)
                                  ? pe : 0.0f;
                }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {  // dV += Pᵀ dO
                unsigned a[4];
                fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
                fa_mma_row<T, HD / 16, true>(adv, a, cdO + kk * 16 * LD, LD, lane);
            }
            float dp[BM / 8][4];  // dPᵀ = V dOᵀ
#pragma unroll
            for (int n = 0; n < BM / 8; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[4];
                fa_frag_a(a, sV + warp * 16 * LD + kk * 16, LD, lane);
                fa_mma_row<T, BM / 16, false>(dp, a, cdO + kk * 16, LD, lane);
            }
#pragma unroll
            for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - cD[n * 8 + c + (e & 1)];  // dSᵀ (without c)
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {  // dK += dSᵀ Q
                unsigned a[4];
                fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
                fa_mma_row<T, HD / 16, true>(adk, a, cQ + kk * 16 * LD, LD, lane);
            }
        }
        __syncthreads();  // every warp is done with buffer i % 2 before tile i + 2 is copied into it
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

// dQ for 16 · DQ_WARPS query rows (16 per warp), looping over key tiles of BN = DQ_BN (causal: up to the
// diagonal), double-buffered with cp.async. Per key tile: S = Q Kᵀ, P = exp(c S − lse), dP = dO Vᵀ,
// dS = P ⊙ (dP − D), dQ += dS K. Shared memory: Q, dO (BM rows), two buffers of K, V (BN rows each); each lane
// keeps lse and D of its two rows in registers.
template <typename T, int HD>
__global__ void __launch_bounds__(fa_cfg<HD>::DQ_WARPS * 32, fa_cfg<HD>::DQ_MIN_BLOCKS)
flash_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
             const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int H, int G,
             int T_len, float scale, int causal, int n_bh, long long q_sb, long long q_sh, long long q_st,
             long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh, long long v_st,
             long long do_sb, long long do_sh, long long do_st, long long dq_sb, long long dq_sh, long long dq_st) {
    constexpr int NT = fa_cfg<HD>::DQ_WARPS * 32, BM = fa_cfg<HD>::DQ_WARPS * 16, BN = fa_cfg<HD>::DQ_BN;
    constexpr int LD = HD + FA_PAD;
    T* sQ = reinterpret_cast<T*>(fa_smem);
    T* sdO = sQ + BM * LD;
    T* sK = sdO + BM * LD;     // two buffers of BN rows
    T* sV = sK + 2 * BN * LD;  // two buffers of BN rows
    const int bh = fa_block_head(), b = bh / H, h = bh % H;
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int q0 = fa_block_tile(true) * BM;  // the longest causal rows first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int w0 = q0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const T* kb = k + b * k_sb + fa_udiv(h, G) * k_sh;  // the K/V head of query head h
    const T* vb = v + b * v_sb + fa_udiv(h, G) * v_sh;
    const float c2 = scale * FA_LOG2E;
    float rl[2], rd[2];  // lse · log2 e and D of this lane's rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool in = rows[r] < T_len;
        rl[r] = in ? lse[(long long)bh * T_len + rows[r]] * FA_LOG2E : 0.0f;
        rd[r] = in ? delta[(long long)bh * T_len + rows[r]] : 0.0f;
    }
    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    const int n_tiles = (kv_end + BN - 1) / BN;
    fa_load_tile<T, BM, HD, NT>(sQ, q + b * q_sb + h * q_sh, q_st, q0, T_len);
    fa_load_tile<T, BM, HD, NT>(sdO, dout + b * do_sb + h * do_sh, do_st, q0, T_len);
    fa_load_tile<T, BN, HD, NT>(sK, kb, k_st, 0, T_len);
    fa_load_tile<T, BN, HD, NT>(sV, vb, v_st, 0, T_len);
    fa_cp_commit();
    float adq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) adq[n][0] = adq[n][1] = adq[n][2] = adq[n][3] = 0.0f;

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BN;
        const T* cK = sK + (j & 1) * BN * LD;
        const T* cV = sV + (j & 1) * BN * LD;
        if (j + 1 < n_tiles) {
            fa_load_tile<T, BN, HD, NT>(sK + ((j + 1) & 1) * BN * LD, kb, k_st, k0 + BN, T_len);
            fa_load_tile<T, BN, HD, NT>(sV + ((j + 1) & 1) * BN * LD, vb, v_st, k0 + BN, T_len);
            fa_cp_commit();
            fa_cp_wait<1>();
        } else {
            fa_cp_wait<0>();
        }
        __syncthreads();
        if (w0 < T_len && (!causal || k0 <= w0 + 15)) {
            float p[BN / 8][4], dp[BN / 8][4];
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[4];
                fa_frag_a(a, sQ + warp * 16 * LD + kk * 16, LD, lane);
                fa_mma_row<T, BN / 16, false>(p, a, cK + kk * 16, LD, lane);   // S = Q Kᵀ
                fa_frag_a(a, sdO + warp * 16 * LD + kk * 16, LD, lane);
                fa_mma_row<T, BN / 16, false>(dp, a, cV + kk * 16, LD, lane);  // dP = dO Vᵀ
            }
            const bool edge = (causal && k0 + BN - 1 > w0) || k0 + BN > T_len;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, key = k0 + n * 8 + c + (e & 1);
                    float pe = fast_exp2(p[n][e] * c2 - rl[r]);
                    if (edge && !fa_visible(rows[r], key, T_len, causal)) pe = 0.0f;
                    p[n][e] = pe * (dp[n][e] - rd[r]);  // dS (without c)
                }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {  // dQ += dS K
                unsigned a[4];
                fa_c_to_a<T>(a, p[2 * kk], p[2 * kk + 1]);
                fa_mma_row<T, HD / 16, true>(adq, a, cK + kk * 16 * LD, LD, lane);
            }
        }
        __syncthreads();
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

// --------------------------------------------------------------------------- 4. the wide backward (the default)

// Where flash_bwd_dkdv spends its time (a model, not a profile): each warp owns 16 keys, so every Q and dO fragment
// it reads from shared memory with ldmatrix feeds only two MMAs: per 64-query tile a warp issues 128 MMAs and 72
// ldmatrix.x4 (512 bytes each), ~0.56 per MMA. At 128 bytes per clock of shared memory per SM that is ~2.3 clocks
// per MMA against ~1.5 for the tensor cores (mma.sync on sm_90): the kernel waits on shared memory. A warp that owns
// 32 keys (two 16-row tiles, as FlashAttention-2's backward gives each warp more rows; Dao 2023, section 3) reads
// each fragment once for four MMAs; the price is registers (dK, dV for 32 keys × 64 dims are 128 per thread), so
// the inner query tile shrinks to 32 (Sᵀ and dPᵀ 32 more each): 48 ldmatrix.x4 per 128 MMAs, ~0.38. HD = 128
// keeps 16 keys per warp (WIDE_MT = 1) and gains only the longer query tile (0.75 -> 0.63 per MMA).
//
// Two things every tile pays for unless written with care (dev/cuda/flash_backward_hypotheses.md has the measured
// list): the causal mask, and the per-row statistics. Only the tiles on a warp's diagonal (or past T) need a mask;
// written as one select per element on every tile, ptxas builds all 32 predicates and packs them into registers on
// every tile, so both kernels branch to a plain exp loop on the others. The statistics lse · log2 e and D arrive
// as one float2 per row, written by flash_bwd_dq_wide (which computes both anyway) and read here with one 8-byte
// cp.async per row.

// flash_bwd_dkdv with WIDE_MT 16-key tiles per warp: 16 · WIDE_MT · DKDV_WARPS keys per block (128 for HD = 64),
// query tiles of WIDE_KV_BM rows, double-buffered by cp.async as there. Registers (ptxas, sm_80/sm_90): with Pᵀ
// kept in fp32 until dSᵀ it spills, because the scheduler hoists every ldmatrix of a GEMM; so Pᵀ is kept only as
// the 16-bit A fragments dV needs (dSᵀ = Pᵀ ⊙ (dPᵀ − D) takes the rounded Pᵀ: one rounding more than
// flash_bwd_dkdv, so the two agree to rounding, not to the bit): ~250 registers with the d loops of Sᵀ and dPᵀ
// fully unrolled (no spill since the row statistics come packed; unrolled by 2 it measured 6 % slower), 2 blocks
// (8 warps) per SM as flash_bwd_dkdv.
template <typename T, int HD, int ROPE>
__global__ void __launch_bounds__(fa_cfg<HD>::DKDV_WARPS * 32, 2)
flash_bwd_dkdv_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ dout, const fa_row_stats* __restrict__ stats, T* __restrict__ dk,
                    T* __restrict__ dv, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
                    long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                    long long v_sh, long long v_st, long long do_sb, long long do_sh, long long do_st, long long dk_sb,
                    long long dk_sh, long long dk_st, long long dv_sb, long long dv_sh, long long dv_st,
                    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin) {
    constexpr int MT = fa_cfg<HD>::WIDE_MT, WK = 16 * MT;  // 16-key tiles and keys per warp
    constexpr int NT = fa_cfg<HD>::DKDV_WARPS * 32, BN = fa_cfg<HD>::DKDV_WARPS * WK, BM = fa_cfg<HD>::WIDE_KV_BM;
    constexpr int LD = HD + FA_PAD;
    static_assert(BM <= NT, "one thread per query row loads its statistics");
    T* sK = reinterpret_cast<T*>(fa_smem);
    T* sV = sK + BN * LD;
    T* sQ = sV + BN * LD;       // two buffers of BM rows
    T* sdO = sQ + 2 * BM * LD;  // two buffers of BM rows
    fa_row_stats* sS = reinterpret_cast<fa_row_stats*>(sdO + 2 * BM * LD);  // two buffers: the tile's row stats
    const int bh = fa_block_head(), b = fa_udiv(bh, H / G), h = bh - b * (H / G);  // K/V head h of batch b
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int k0 = fa_block_tile(false) * BN;  // causal: the first key tiles see the most queries, and start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int w0 = k0 + warp * WK;  // this warp's first key; lane rows w0 + 16 m + g (+ 8)
    const T* qb = q + b * q_sb + h * G * q_sh;  // the group's first query head h·G (its j-th: j · q_sh on)
    const T* dob = dout + b * do_sb + h * G * do_sh;
    const fa_row_stats* statsb = stats + (long long)bh * G * T_len;  // rows of query head b·H + h·G = bh·G
    const float c2 = scale * FA_LOG2E;

    const int q_first = causal ? (k0 / BM) * BM : 0;  // the steps as in flash_bwd_dkdv: G heads' query tiles
    const int n_steps = G * ((T_len - q_first + BM - 1) / BM);
    int lj = 0, lq0 = q_first;  // the group's query head and first row of the next tile to load
    auto load_q_tile = [&](int i) {  // Q, dO and the row stats of step i into buffer i % 2
        const int buf = i & 1;
        fa_load_tile<T, BM, HD, NT>(sQ + buf * BM * LD, qb + lj * q_sh, q_st, lq0, T_len);
        fa_load_tile<T, BM, HD, NT>(sdO + buf * BM * LD, dob + lj * do_sh, do_st, lq0, T_len);
        if (threadIdx.x < BM) {
            const int row = lq0 + threadIdx.x;
            const bool in = row < T_len;
            fa_cp8(sS + buf * BM + threadIdx.x, statsb + (long long)lj * T_len + (in ? row : 0), in);
        }
        lq0 += BM;
        if (lq0 >= T_len) lq0 = q_first, ++lj;
    };
    fa_load_tile<T, BN, HD, NT>(sK, k + b * k_sb + h * k_sh, k_st, k0, T_len);
    fa_load_tile<T, BN, HD, NT>(sV, v + b * v_sb + h * v_sh, v_st, k0, T_len);
    load_q_tile(0);
    fa_cp_commit();

    float adk[MT][HD / 8][4], adv[MT][HD / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) adk[m][n][e] = adv[m][n][e] = 0.0f;

    for (int i = 0, q0 = q_first; i < n_steps; ++i, q0 = q0 + BM < T_len ? q0 + BM : q_first) {
        const T* cQ = sQ + (i & 1) * BM * LD;
        const T* cdO = sdO + (i & 1) * BM * LD;
        const fa_row_stats* cS = sS + (i & 1) * BM;
        if (i + 1 < n_steps) {
            load_q_tile(i + 1);
            fa_cp_commit();
            fa_cp_wait<1>();
        } else {
            fa_cp_wait<0>();
        }
        __syncthreads();
        if (w0 < T_len && (!causal || q0 + BM - 1 >= w0)) {
            const bool edge = (causal && q0 < w0 + WK - 1) || q0 + BM > T_len || w0 + WK > T_len;
            float p[MT][BM / 8][4];  // Sᵀ, then Pᵀ, then dSᵀ: this warp's WK keys × BM queries
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < BM / 8; ++n) p[m][n][0] = p[m][n][1] = p[m][n][2] = p[m][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_frag_a(a[m], sK + (warp * WK + m * 16) * LD + kk * 16, LD, lane);
                fa_mma_rows<T, MT, BM / 16, false>(p, a, cQ + kk * 16, LD, lane);
            }
            if (!edge) {  // every key sees every query of the tile
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            p[m][n][e] = fast_exp2(p[m][n][e] * c2 - cS[n * 8 + c + (e & 1)].l2);
            } else {
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int col = n * 8 + c + (e & 1), key = w0 + m * 16 + g + 8 * (e >> 1);
                            const float pe = fast_exp2(p[m][n][e] * c2 - cS[col].l2);
                            p[m][n][e] = fa_visible(q0 + col, key, T_len, causal) && q0 + col < T_len ? pe : 0.0f;
                        }
            }
            unsigned pa[BM / 16][MT][4];  // Pᵀ in 16 bits, as A fragments: half the registers of p, which dies here
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {  // dV += Pᵀ dO
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_c_to_a<T>(pa[kk][m], p[m][2 * kk], p[m][2 * kk + 1]);
                fa_mma_rows<T, MT, HD / 16, true>(adv, pa[kk], cdO + kk * 16 * LD, LD, lane);
            }
            float dp[MT][BM / 8][4];  // dPᵀ = V dOᵀ, then dSᵀ (computing it before the exp measured no faster)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < BM / 8; ++n) dp[m][n][0] = dp[m][n][1] = dp[m][n][2] = dp[m][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_frag_a(a[m], sV + (warp * WK + m * 16) * LD + kk * 16, LD, lane);
                fa_mma_rows<T, MT, BM / 16, false>(dp, a, cdO + kk * 16, LD, lane);
            }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h2 = 0; h2 < 4; ++h2) {  // A register h2 holds (n, e) = (2 kk + h2 / 2, 2 (h2 % 2), +1)
                        const int n = 2 * kk + (h2 >> 1), e = 2 * (h2 & 1), col = n * 8 + c;
                        float p0, p1;  // dSᵀ / c = Pᵀ ⊙ (dPᵀ − D), with Pᵀ as rounded for dV
                        unpack2<T>(pa[kk][m][h2], p0, p1);
                        dp[m][n][e] = p0 * (dp[m][n][e] - cS[col].d);
                        dp[m][n][e + 1] = p1 * (dp[m][n][e + 1] - cS[col + 1].d);
                    }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {  // dK += dSᵀ Q
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_c_to_a<T>(a[m], dp[m][2 * kk], dp[m][2 * kk + 1]);
                fa_mma_rows<T, MT, HD / 16, true>(adk, a, cQ + kk * 16 * LD, LD, lane);
            }
        }
        __syncthreads();  // every warp is done with buffer i % 2 before tile i + 2 is copied into it
    }
    T* dkb = dk + b * dk_sb + h * dk_sh;
    T* dvb = dv + b * dv_sb + h * dv_sh;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = w0 + m * 16 + g + 8 * r;
            if (key >= T_len) continue;
            T* krow = dkb + (long long)key * dk_st;
            T* vrow = dvb + (long long)key * dv_st;
            if constexpr (ROPE)
                fa_rope_backward_row<HD>(adk[m], r, rope_cos + (long long)key * (HD / 2),
                                         rope_sin + (long long)key * (HD / 2), c);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                *reinterpret_cast<unsigned*>(krow + n * 8 + c) =
                    pack2<T>(adk[m][n][2 * r] * scale, adk[m][n][2 * r + 1] * scale);
                *reinterpret_cast<unsigned*>(vrow + n * 8 + c) = pack2<T>(adv[m][n][2 * r], adv[m][n][2 * r + 1]);
            }
        }
}

// flash_bwd_dq with WIDE_MT 16-row tiles per warp (16 · WIDE_MT · DQ_WARPS query rows per block: 128 for HD = 64)
// and key tiles of WIDE_DQ_BN, which also computes D = rowsum(dO ⊙ O) for its rows and writes (lse · log2 e, D) to
// `stats` (flash_bwd_dot's job, fused: dO is read here anyway), so it runs before flash_bwd_dkdv_wide, which reads
// them. Per lane: the four lanes of a quad own the same rows; each sums 16-byte chunks (lane % 4) + 4 j of dO and O
// (global loads, coalesced per quad), two shuffles join the quad. Same arithmetic per element as flash_bwd_dq (D
// summed in another order than flash_bwd_dot's, so dS and everything after it agree to rounding, not to the bit).
// Three blocks (12 warps) per SM, where flash_bwd_dkdv_wide has two: at 168 registers this kernel still fits, if S
// and dP are computed one after the other (interleaved, ptxas hoists enough fragments to spill). Key tiles come
// through a ring of WIDE_DQ_BUFS buffers: with three, two tiles are in flight and one barrier per tile suffices
// (the barrier at the top of tile j + 1 proves every warp has left tile j − 1, whose buffer tile j + 2 takes); with
// HD = 128 three buffers would not leave room for three blocks, so it keeps two and a barrier at the end of a tile.
template <typename T, int HD, int ROPE>
__global__ void __launch_bounds__(fa_cfg<HD>::DQ_WARPS * 32, fa_cfg<HD>::WIDE_DQ_MIN_BLOCKS)
flash_bwd_dq_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                  const T* __restrict__ o, const float* __restrict__ lse, fa_row_stats* __restrict__ stats,
                  T* __restrict__ dq, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
                  long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                  long long v_sh, long long v_st, long long do_sb, long long do_sh, long long do_st, long long o_sb,
                  long long o_sh, long long o_st, long long dq_sb, long long dq_sh, long long dq_st,
                  const float* __restrict__ rope_cos, const float* __restrict__ rope_sin) {
    constexpr int MT = fa_cfg<HD>::WIDE_MT, WQ = 16 * MT;  // 16-row tiles and rows per warp
    constexpr int NT = fa_cfg<HD>::DQ_WARPS * 32, BM = fa_cfg<HD>::DQ_WARPS * WQ, BN = fa_cfg<HD>::WIDE_DQ_BN;
    constexpr int LD = HD + FA_PAD, NBUF = fa_cfg<HD>::WIDE_DQ_BUFS;
    static_assert(NBUF == 2 || NBUF == 3, "a double buffer or a ring of three");
    T* sQ = reinterpret_cast<T*>(fa_smem);
    T* sdO = sQ + BM * LD;
    T* sK = sdO + BM * LD;        // NBUF buffers of BN rows
    T* sV = sK + NBUF * BN * LD;  // NBUF buffers of BN rows
    const int bh = fa_block_head(), b = bh / H, h = bh % H;
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int q0 = fa_block_tile(true) * BM;  // the longest causal rows first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const int w0 = q0 + warp * WQ;  // this warp's first row; lane rows w0 + 16 m + g (+ 8)
    const T* kb = k + b * k_sb + fa_udiv(h, G) * k_sh;  // the K/V head of query head h
    const T* vb = v + b * v_sb + fa_udiv(h, G) * v_sh;
    const T* dob = dout + b * do_sb + h * do_sh;
    const float c2 = scale * FA_LOG2E;
    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    const int n_tiles = (kv_end + BN - 1) / BN;
    auto load_kv_tile = [&](int j) {  // K, V of key tile j into buffer j % NBUF
        fa_load_tile<T, BN, HD, NT>(sK + (j % NBUF) * BN * LD, kb, k_st, j * BN, T_len);
        fa_load_tile<T, BN, HD, NT>(sV + (j % NBUF) * BN * LD, vb, v_st, j * BN, T_len);
    };
    fa_load_tile<T, BM, HD, NT>(sQ, q + b * q_sb + h * q_sh, q_st, q0, T_len);
    fa_load_tile<T, BM, HD, NT>(sdO, dob, do_st, q0, T_len);
    load_kv_tile(0);
    fa_cp_commit();
    if (NBUF == 3 && n_tiles > 1) {
        load_kv_tile(1);
        fa_cp_commit();
    }

    float rl[MT][2], rd[MT][2];  // lse · log2 e and D of this lane's rows
    const T* ob = o + b * o_sb + h * o_sh;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + m * 16 + g + 8 * r;
            const bool in = row < T_len;
            float s = 0.0f;
            if (in) {
#pragma unroll
                for (int j = 0; j < HD / 32; ++j) {  // the quad's lanes read chunks (lane % 4) + 4 j: 64 bytes
                    const int d = ((lane & 3) + 4 * j) * 8;
                    float x[8], y[8];
                    load_pack16<T, 8>(dob + (long long)row * do_st + d, x);
                    load_pack16<T, 8>(ob + (long long)row * o_st + d, y);
#pragma unroll
                    for (int e = 0; e < 8; ++e) s += x[e] * y[e];
                }
            }
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            rd[m][r] = s;
            rl[m][r] = in ? lse[(long long)bh * T_len + row] * FA_LOG2E : 0.0f;
            if (in && (lane & 3) == 0) stats[(long long)bh * T_len + row] = {rl[m][r], s};
        }
    float adq[MT][HD / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) adq[m][n][0] = adq[m][n][1] = adq[m][n][2] = adq[m][n][3] = 0.0f;

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BN;
        const T* cK = sK + (j % NBUF) * BN * LD;
        const T* cV = sV + (j % NBUF) * BN * LD;
        if constexpr (NBUF == 3) {  // tiles j and j + 1 are in flight
            if (j + 1 < n_tiles) fa_cp_wait<1>();
            else fa_cp_wait<0>();
            __syncthreads();  // tile j has landed, and every warp is done with tile j − 1, whose buffer j + 2 takes
            if (j + 2 < n_tiles) {
                load_kv_tile(j + 2);
                fa_cp_commit();
            }
        } else {
            if (j + 1 < n_tiles) {
                load_kv_tile(j + 1);
                fa_cp_commit();
                fa_cp_wait<1>();
            } else {
                fa_cp_wait<0>();
            }
            __syncthreads();
        }
        if (w0 < T_len && (!causal || k0 <= w0 + WQ - 1)) {
            float p[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) p[m][n][e] = dp[m][n][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_frag_a(a[m], sQ + (warp * WQ + m * 16) * LD + kk * 16, LD, lane);
                fa_mma_rows<T, MT, BN / 16, false>(p, a, cK + kk * 16, LD, lane);  // S = Q Kᵀ
            }
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_frag_a(a[m], sdO + (warp * WQ + m * 16) * LD + kk * 16, LD, lane);
                fa_mma_rows<T, MT, BN / 16, false>(dp, a, cV + kk * 16, LD, lane);  // dP = dO Vᵀ
            }
            if (!((causal && k0 + BN - 1 > w0) || k0 + BN > T_len)) {  // no mask: every row sees every key
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)  // dS (without c)
                            p[m][n][e] = fast_exp2(p[m][n][e] * c2 - rl[m][e >> 1]) * (dp[m][n][e] - rd[m][e >> 1]);
            } else {
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int r = e >> 1, key = k0 + n * 8 + c + (e & 1);
                            float pe = fast_exp2(p[m][n][e] * c2 - rl[m][r]);
                            if (!fa_visible(w0 + m * 16 + g + 8 * r, key, T_len, causal)) pe = 0.0f;
                            p[m][n][e] = pe * (dp[m][n][e] - rd[m][r]);
                        }
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {  // dQ += dS K
                unsigned a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) fa_c_to_a<T>(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
                fa_mma_rows<T, MT, HD / 16, true>(adq, a, cK + kk * 16 * LD, LD, lane);
            }
        }
        if constexpr (NBUF == 2) __syncthreads();  // every warp is done with buffer j % 2 before tile j + 2
    }
    T* dqb = dq + b * dq_sb + h * dq_sh;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + m * 16 + g + 8 * r;
            if (row >= T_len) continue;
            T* qrow = dqb + (long long)row * dq_st;
            if constexpr (ROPE)
                fa_rope_backward_row<HD>(adq[m], r, rope_cos + (long long)row * (HD / 2),
                                         rope_sin + (long long)row * (HD / 2), c);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n)
                *reinterpret_cast<unsigned*>(qrow + n * 8 + c) =
                    pack2<T>(adq[m][n][2 * r] * scale, adq[m][n][2 * r + 1] * scale);
        }
}
