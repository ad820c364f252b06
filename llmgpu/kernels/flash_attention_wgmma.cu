// flash_attention_wgmma.cu: flash attention on Hopper's asynchronous warpgroup MMA (wgmma), chapter 2b: the
// forward (flash_fwd_wgmma) and the backward's dK/dV kernel (flash_bwd_dkdv_wgmma, at the end of the file). Same
// arguments (grouped K/V heads included), math and row statistics as flash_fwd and flash_bwd_dkdv_wide in
// flash_attention.cu (mma.sync, any sm_80+ GPU); these exist on sm_90a only (llmgpu:arch below: the loader compiles
// the file for that target, and only on such a GPU).
// The layouts it relies on were pinned on the GPU by dev/cuda/wgmma_probe.py ("RS, B sw128" for S = Q Kᵀ, "RS, B
// MN-major sw128 (imm-trans-b)" for O += P V); dev/cuda/flash_fwd_wgmma.py checks and times other tile shapes.
//
// * A block owns 64·WG query rows: WG warpgroups (4 warps each) of 64 rows. Q is read once from shared memory
//   into registers (ldmatrix, the A fragments of mma.m16n8k16, warp w of a warpgroup giving rows 16w..16w+15,
//   which is wgmma's register-A layout), so S = Q Kᵀ is wgmma m64n64k16 x D/16 (over d) per 64 keys with A from
//   registers and K from shared memory; O += P V is m64n64k16 x BN/16 (over the keys) per 64 columns of d, with P
//   from registers (the S accumulators are mma.m16n8's C fragments repeated over N, so flash_fwd's packing makes
//   P's A fragments) and V from shared memory through imm-trans-b (V is stored [key][d], d contiguous: MN-major).
// * K and V tiles of BN keys sit in shared memory as D/64 halves of BN keys x 64 d (128 bytes per row), each in
//   the 128-byte swizzle (chunk c of row r at chunk c ^ (r % 8), 1024-byte atoms of 8 rows), written by cp.async
//   chunk by chunk; no padding, no bank conflicts. A ring of three K/V buffers, one barrier per tile: tile j + 2
//   is loaded during tile j, into the buffer of tile j - 1, which every warpgroup has finished with.
// * PIPE (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024): per tile, S of tile j + 1 and then
//   O += P V of tile j are issued; the softmax of tile j + 1 runs as soon as its S is done, while the tensor cores
//   still work on P V; P is packed for the next tile once P V is done. PIPE = 0 issues, waits and computes in turn.
//   Nothing is pending across the loop's back edge: with MMAs pending there ptxas serialized every wgmma (its
//   C7514 note). ptxas still places the wait for P V early in the softmax (its scheduler hoists the operand-less
//   wait); keeping it after the softmax, with the scale folded into the exponent and the mask branch taken before
//   the MMAs, was measured 2-4 % slower, so the loop stays as written (chapter 2b).
// * Causal: a warpgroup skips the tiles wholly above its 64 rows' diagonal (wgmma is warpgroup-collective, so
//   the skip is per warpgroup, not per warp as in flash_fwd); masking is per element as in flash_fwd.
// * The shipped configuration (the instantiations below): BN = 64 keys, WG = 2, PIPE = 1, two blocks per SM at
//   D = 64. Larger tiles or more warpgroups per block run one block per SM and were slower (dev/cuda).
#include "common.cuh"
#include "flash_common.cuh"
#include "wgmma.cuh"

// llmgpu:arch sm_90a
// llmgpu:kernel flash_fwd_wgmma<{__half,__nv_bfloat16}, {64,128}, 1, 64, 2>
// llmgpu:kernel flash_bwd_dkdv_wgmma<{__half,__nv_bfloat16}, {64,128}, {0,1}, 2>

#define FW_LOG2E 1.4426950408889634f
#define FW_LN2 0.6931471805599453f
#define FW_INF __int_as_float(0x7f800000)

constexpr int FW_BUFS = 3;  // the ring of K/V tiles
// BN keys per tile, WG warpgroups (of 64 query rows) per block
template <int HD, int BN, int WG> struct fw_cfg {
    static constexpr int BM = 64 * WG, NT = 128 * WG;     // query rows and threads per block
    static constexpr int LDQ = HD + 8;                    // Q's padded row (ldmatrix without conflicts)
    static constexpr int Q_BYTES = BM * LDQ * 2;          // a multiple of 1024 for WG = 2 and 3
    static constexpr int HALF = BN * 128;                 // one swizzled BN x 64 half of a K or V tile
    static constexpr int TILE = HD / 64 * HALF;           // one K or V tile
    static constexpr int SMEM = 1024 + Q_BYTES + FW_BUFS * 2 * TILE;  // with the alignment slack
    // blocks per SM: as many as shared memory holds (228 KiB, 1 KiB of it reserved per block), at no fewer than
    // 128 registers a thread
    static constexpr int MIN_BLOCKS = 233472 / (SMEM + 1024) < 65536 / (NT * 128) ? 233472 / (SMEM + 1024)
                                                                                    : 65536 / (NT * 128);
    static_assert(Q_BYTES % 1024 == 0 && SMEM <= 227 * 1024 && MIN_BLOCKS >= 1, "a tile configuration that does not fit");
};

// Rows [row0, row0 + BN) of a [T, HD] view (row stride st) into a 1024-aligned tile: HD / 64 halves of 64 columns,
// BN x 128 bytes apart, each in the 128-byte swizzle; NT threads share the work.
template <typename T, int HD, int BN, int NT>
__device__ __forceinline__ void fw_load_tile(unsigned s, const T* __restrict__ g, long long st, int row0, int T_len) {
    constexpr int CHUNKS = HD / 8, N = BN * CHUNKS;  // 16-byte chunks per row, per tile
#pragma unroll
    for (int it = 0; it < (N + NT - 1) / NT; ++it) {
        const int i = threadIdx.x + it * NT, r = i / CHUNKS, c = i % CHUNKS;
        if (N % NT != 0 && i >= N) break;
        const bool in = row0 + r < T_len;
        fa_cp16(s + (c >> 3) * (BN * 128) + (r >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4),
                g + ((in ? row0 + r : 0) * static_cast<int>(st) + c * 8), in);
    }
}

// Descriptors of the swizzled tiles (wgmma_probe.py's "sw128" hypotheses): K-major (K for S = Q Kᵀ): k step kk
// starts 32·kk bytes in, SBO = 1024 (the next 8 keys), LBO unused (16); MN-major (V for P V): k step kk starts
// 2048·kk bytes in (16 keys), SBO = 1024 (the next 8 keys), LBO unused (64 d are one 128-byte row; 8192).
constexpr unsigned FW_SW128 = 1;

// Both operands' descriptors share their high word (SBO = 1024, the 128-byte swizzle): only the low word (start
// address >> 4, LBO >> 4) is computed, once per operand, and offsets are added to it (wg_desc's fields, split), which
// saves the integer instructions of rebuilding all 64 bits for every MMA.
constexpr unsigned FW_DESC_HI = (1024u >> 4) | (FW_SW128 << 30);
__device__ __forceinline__ unsigned fw_desc_lo(unsigned saddr, unsigned lbo) {
    return ((saddr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ unsigned long long fw_desc(unsigned lo) {
    return (static_cast<unsigned long long>(FW_DESC_HI) << 32) | lo;
}

template <typename T, int HD, int PIPE, int BN, int WG>
__global__ void __launch_bounds__(fw_cfg<HD, BN, WG>::NT, (fw_cfg<HD, BN, WG>::MIN_BLOCKS))
flash_fwd_wgmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                float* __restrict__ lse, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
                long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                long long v_sh, long long v_st, long long o_sb, long long o_sh, long long o_st) {
#ifdef LLMGPU_WGMMA
    extern __shared__ __align__(1024) unsigned char fw_smem[];
    const unsigned raw = wg_saddr(fw_smem);
    unsigned char* base = fw_smem + ((1024u - (raw & 1023u)) & 1023u);
    T* sQ = reinterpret_cast<T*>(base);
    using cfg = fw_cfg<HD, BN, WG>;
    constexpr int LDQ = cfg::LDQ, TILE = cfg::TILE, HALF = cfg::HALF, BM = cfg::BM, NT = cfg::NT;
    constexpr int NH = HD / 64, NB = BN / 64;  // 64-column halves of d, 64-key blocks of a tile
    const unsigned kv0 = wg_saddr(base) + cfg::Q_BYTES;  // buffer b: K at kv0 + 2·b·TILE, V one TILE on
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, c = (lane & 3) * 2;
    const int bh = fa_block_head(), b = bh / H, h = bh % H;
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int q0 = fa_block_tile(true) * BM;  // the longest causal rows first
    const int wg0 = q0 + wg * 64, w0 = wg0 + w4 * 16;     // this warpgroup's and this warp's first row
    const T* kb = k + b * k_sb + fa_udiv(h, G) * k_sh;  // the K/V head of query head h (grouped-query attention)
    const T* vb = v + b * v_sb + fa_udiv(h, G) * v_sh;
    const float c2 = scale * FW_LOG2E;
    const int kv_end = causal ? min(T_len, q0 + BM) : T_len;
    const int n_tiles = (kv_end + BN - 1) / BN;
    auto k_tile = [&](int j) { return kv0 + (j % FW_BUFS) * 2 * TILE; };
    // The descriptors' low words for buffer 0 (K and V); buffer b and an offset within it add (b·2·TILE + off) >> 4
    // to the start-address field, which never carries out of its 14 bits (shared memory ends below 256 KiB).
    const unsigned k_lo0 = fw_desc_lo(kv0, 16), v_lo0 = fw_desc_lo(kv0 + TILE, 8192);
    auto buf_lo = [&](int j) { return (k_tile(j) - kv0) >> 4; };
    auto load_kv = [&](int j) {
        fw_load_tile<T, HD, BN, NT>(k_tile(j), kb, k_st, j * BN, T_len);
        fw_load_tile<T, HD, BN, NT>(k_tile(j) + TILE, vb, v_st, j * BN, T_len);
    };

    {  // Q, padded, as flash_fwd loads it
        const T* qb = q + b * q_sb + h * q_sh;
#pragma unroll
        for (int it = 0; it < BM * (HD / 8) / NT; ++it) {
            const int i = tid + it * NT, r = i / (HD / 8), cc = (i % (HD / 8)) * 8;
            const bool in = q0 + r < T_len;
            fa_cp16(wg_saddr(sQ + r * LDQ + cc), qb + ((in ? q0 + r : 0) * static_cast<int>(q_st) + cc), in);
        }
    }
    load_kv(0);
    fa_cp_commit();
    if (n_tiles > 1) {
        load_kv(1);
        fa_cp_commit();
    }
    fa_cp_wait<0>();
    wg_fence_proxy();
    __syncthreads();

    unsigned qf[HD / 16][4];  // this warp's 16 rows of Q as A fragments, one per 16 d
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const T* p = sQ + (wg * 64 + w4 * 16 + (lane & 15)) * LDQ + kk * 16 + (lane >> 4) * 8;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(qf[kk][0]), "=r"(qf[kk][1]), "=r"(qf[kk][2]), "=r"(qf[kk][3])
                     : "r"(wg_saddr(p)));
    }
    auto qk = [&](float (&d)[NB][32], int j) {  // d = Q K_jᵀ (scale-d 0 on the first k step: no zeroing)
        const unsigned bl = buf_lo(j);
        wg_fence();
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)  // keys 64 nb.. start 8 atoms (8192 bytes) per block in
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk)  // d 16 kk.. lie in half kk / 4, 32 (kk % 4) bytes into its rows
                wg_mma_rs<T, 0>(d[nb], qf[kk],
                                fw_desc(k_lo0 + bl + (((kk >> 2) * HALF + 8192 * nb + 32 * (kk & 3)) >> 4)), kk > 0);
        wg_commit();
    };
    auto pin_s = [&](float (&d)[NB][32]) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) wg_pin(d[nb]);
    };

    // the tiles this warpgroup computes: 0 .. n_wg - 1 (causal: up to its last row's diagonal)
    const int n_wg = wg0 >= T_len ? 0 : causal ? min(n_tiles, (wg0 + 63) / BN + 1) : n_tiles;
    float s[NB][32], acc[NH][32], m[2] = {-FW_INF, -FW_INF}, l[2] = {0.0f, 0.0f};  // acc[n]: d 64 n .. 64 n + 63
#pragma unroll
    for (int n = 0; n < NH; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[n][i] = 0.0f;
    auto pin_acc = [&]() {
#pragma unroll
        for (int n = 0; n < NH; ++n) wg_pin(acc[n]);
    };
    unsigned pf[BN / 16][4];  // P as the A fragments of O += P V, 16 keys each
    float alpha[2];
    // the online softmax of tile j in s: exponentiated in place, the running max and sum updated, alpha the
    // rescale of acc
    auto softmax = [&](int j) {
        const int k0 = j * BN;
        if ((causal && k0 + BN - 1 > w0) || k0 + BN > T_len) {  // the diagonal or the ragged last tile
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const int key = k0 + 64 * nb + (i >> 2) * 8 + c + (i & 1), row = w0 + g + 8 * ((i >> 1) & 1);
                    s[nb][i] = key < T_len && (!causal || key <= row) ? s[nb][i] * c2 : -FW_INF;
                }
        } else {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int i = 0; i < 32; ++i) s[nb][i] *= c2;
        }
        float mx[2] = {m[0], m[1]}, ref[2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[nb][i]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // a row's scores: one quad
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            ref[r] = mx[r] == -FW_INF ? 0.0f : mx[r];  // no -inf - -inf (flash_fwd's fa_ref)
            alpha[r] = fast_exp2(m[r] - ref[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                s[nb][i] = fast_exp2(s[nb][i] - ref[(i >> 1) & 1]);
                l[(i >> 1) & 1] += s[nb][i];
            }
    };
    auto pack_p = [&]() {  // s (exponentiated) -> pf, once the MMAs reading the previous pf are done
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {  // keys 16 kk..: block kk / 4, accumulators 8 (kk % 4)..
            const float* x = s[kk >> 2] + 8 * (kk & 3);
            pf[kk][0] = pack2<T>(x[0], x[1]);
            pf[kk][1] = pack2<T>(x[2], x[3]);
            pf[kk][2] = pack2<T>(x[4], x[5]);
            pf[kk][3] = pack2<T>(x[6], x[7]);
        }
    };
    auto pv = [&](int j) {  // acc = alpha · acc + P V_j, issued (after the MMAs that wrote acc were waited for)
        pin_acc();
#pragma unroll
        for (int n = 0; n < NH; ++n)
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[n][i] *= alpha[(i >> 1) & 1];
        const unsigned bl = buf_lo(j);
        wg_fence();
#pragma unroll
        for (int n = 0; n < NH; ++n)  // V's half n: keys 16 kk.. start 2048 kk bytes in
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wg_mma_rs<T, 1>(acc[n], pf[kk], fw_desc(v_lo0 + bl + ((n * HALF + 2048 * kk) >> 4)), 1);
        wg_commit();
    };

    if (n_wg > 0) {
        qk(s, 0);
        wg_wait<0>();
        pin_s(s);
        softmax(0);
        pack_p();
    }
    // On entry to tile j, P of tile j is in pf and no MMA is pending (so ptxas can follow the groups: with MMAs
    // pending across the loop's back edge it serialized every wgmma).
    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) {  // tile j + 1 (loaded during tile j - 1) is needed now: S of it may be issued
            fa_cp_wait<0>();
            wg_fence_proxy();
        }
        __syncthreads();  // and every warpgroup is done with tile j - 1, whose buffer tile j + 2 takes
        if (j + 2 < n_tiles) {
            load_kv(j + 2);
            fa_cp_commit();
        }
        if (PIPE && j + 1 < n_wg) {
            qk(s, j + 1);       // pending: S of j + 1
            pv(j);              // pending: S of j + 1, P V of j
            wg_wait<1>();       // S of j + 1 done
            pin_s(s);
            softmax(j + 1);     // while the tensor cores work on P V of j
            wg_wait<0>();       // P V of j done: pf may be overwritten
            pin_acc();
            pack_p();
        } else if (j < n_wg) {  // PIPE's last tile, or every tile without PIPE
            pv(j);
            wg_wait<0>();
            pin_acc();
            if (!PIPE && j + 1 < n_wg) {
                qk(s, j + 1);
                wg_wait<0>();
                pin_s(s);
                softmax(j + 1);
                pack_p();
            }
        }
    }
    wg_wait<0>();
    pin_acc();
    T* ob = o + b * o_sb + h * o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int row = w0 + g + 8 * r;
        if (row >= T_len) continue;
        const float inv = 1.0f / l[r];
        T* orow = ob + (long long)row * o_st;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)  // 8 columns 8 n..: half n / 8, accumulators 4 (n % 8)..
            *reinterpret_cast<unsigned*>(orow + n * 8 + c) =
                pack2<T>(acc[n >> 3][4 * (n & 7) + 2 * r] * inv, acc[n >> 3][4 * (n & 7) + 2 * r + 1] * inv);
        if ((lane & 3) == 0) lse[(long long)bh * T_len + row] = ((m[r] == -FW_INF ? 0.0f : m[r]) + log2f(l[r])) * FW_LN2;
    }
#else
    __trap();  // not sm_90a: wgmma does not exist here
#endif
}

// --------------------------------------------------------------------------- dK, dV on wgmma

// flash_bwd_dkdv_wide's job (same arguments, the same row statistics from flash_bwd_dq_wide, the same GQA sum and
// RoPE fold) on warpgroup MMAs. A block owns 64·WG keys, WG warpgroups of 64; it walks the query tiles of its G
// query heads (BQ = 64 rows each, double-buffered by cp.async). Every operand sits in shared memory in the forward's
// swizzled layout (fw_load_tile): K, V of the block once, Q and dO per tile. Per tile a warpgroup issues
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ   (both operands by descriptor, K-major: the forward's S = Q Kᵀ layout for B)
//   dV += Pᵀ dO and dK += dSᵀ Q  (Pᵀ, dSᵀ from registers, dO and Q MN-major: the forward's O += P V layout)
// and between them computes Pᵀ = 2^(c·log2e·Sᵀ − lse·log2e) and dSᵀ = Pᵀ ⊙ (dPᵀ − D) on the accumulators (the
// column's statistics from shared memory). dSᵀ takes the 16-bit Pᵀ that dV reads, as flash_bwd_dkdv_wide does.
// Sᵀ and dPᵀ are two commit groups, so the exponentials of Pᵀ run while the tensor cores still compute dPᵀ.
// Registers: Sᵀ, dPᵀ 32 each, dK, dV 32 per 64 columns of d each, the 16-bit Pᵀ and dSᵀ 16 each (no K, V
// fragments: A comes from shared memory), so one block of WG = 2 per SM.
constexpr int BW_BQ = 64;  // query rows per tile of the dK/dV kernel
template <int HD, int WG> struct bw_cfg {
    static constexpr int BN = 64 * WG, NT = 128 * WG;  // keys and threads per block
    static constexpr int KV_TILE = BN * HD * 2;        // the block's K or V: HD / 64 swizzled halves of BN x 128 bytes
    static constexpr int Q_TILE = BW_BQ * HD * 2;      // one Q or dO tile
    static constexpr int SMEM = 1024 + 2 * KV_TILE + 2 * 2 * Q_TILE + 2 * BW_BQ * 8;  // with the alignment slack
    static_assert(SMEM <= 227 * 1024, "a tile configuration that does not fit");
};

template <typename T, int HD, int ROPE, int WG>
__global__ void __launch_bounds__(128 * WG, 1)
flash_bwd_dkdv_wgmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const fa_row_stats* __restrict__ stats, T* __restrict__ dk,
                     T* __restrict__ dv, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
                     long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                     long long v_sh, long long v_st, long long do_sb, long long do_sh, long long do_st,
                     long long dk_sb, long long dk_sh, long long dk_st, long long dv_sb, long long dv_sh,
                     long long dv_st, const float* __restrict__ rope_cos, const float* __restrict__ rope_sin) {
#ifdef LLMGPU_WGMMA
    using cfg = bw_cfg<HD, WG>;
    constexpr int BN = cfg::BN, NT = cfg::NT, BQ = BW_BQ, NH = HD / 64;
    constexpr int KV_HALF = BN * 128, Q_HALF = BQ * 128;  // bytes between the 64-column halves of d
    extern __shared__ __align__(1024) unsigned char bw_smem[];
    const unsigned raw = wg_saddr(bw_smem);
    unsigned char* base = bw_smem + ((1024u - (raw & 1023u)) & 1023u);
    const unsigned sK = wg_saddr(base), sV = sK + cfg::KV_TILE;
    const unsigned sQ = sV + cfg::KV_TILE;  // buffer b: Q at sQ + 2·b·Q_TILE, dO one Q_TILE on
    fa_row_stats* sS = reinterpret_cast<fa_row_stats*>(base + 2 * cfg::KV_TILE + 4 * cfg::Q_TILE);  // two buffers
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, c = (lane & 3) * 2;
    const int bh = fa_block_head(), b = fa_udiv(bh, H / G), h = bh - b * (H / G);  // K/V head h of batch b
    if (bh >= n_bh) return;  // the last group's blocks beyond the heads
    const int k0 = fa_block_tile(false) * BN;  // causal: the first key tiles see the most queries, and start first
    const int wk0 = k0 + 64 * wg;              // this warpgroup's first key
    const T* qb = q + b * q_sb + h * G * q_sh;  // the group's first query head h·G (its j-th: j · q_sh on)
    const T* dob = dout + b * do_sb + h * G * do_sh;
    const fa_row_stats* statsb = stats + (long long)bh * G * T_len;  // rows of query head b·H + h·G = bh·G
    const float c2 = scale * FW_LOG2E;

    const int q_first = causal ? (k0 / BQ) * BQ : 0;  // the steps: G heads' query tiles, as flash_bwd_dkdv_wide
    const int n_steps = G * ((T_len - q_first + BQ - 1) / BQ);
    int lj = 0, lq0 = q_first;  // the group's query head and first row of the next tile to load
    auto q_buf = [&](int i) { return sQ + (i & 1) * 2 * cfg::Q_TILE; };
    auto load_q_tile = [&](int i) {  // Q, dO and the row stats of step i into buffer i % 2
        fw_load_tile<T, HD, BQ, NT>(q_buf(i), qb + lj * q_sh, q_st, lq0, T_len);
        fw_load_tile<T, HD, BQ, NT>(q_buf(i) + cfg::Q_TILE, dob + lj * do_sh, do_st, lq0, T_len);
        if (tid < BQ) {
            const int row = lq0 + tid;
            const bool in = row < T_len;
            fa_cp8(sS + (i & 1) * BQ + tid, statsb + (long long)lj * T_len + (in ? row : 0), in);
        }
        lq0 += BQ;
        if (lq0 >= T_len) lq0 = q_first, ++lj;
    };
    fw_load_tile<T, HD, BN, NT>(sK, k + b * k_sb + h * k_sh, k_st, k0, T_len);
    fw_load_tile<T, HD, BN, NT>(sV, v + b * v_sb + h * v_sh, v_st, k0, T_len);
    load_q_tile(0);
    fa_cp_commit();

    // Descriptors' low words. K-major (A: this warpgroup's 64 keys, 8 atoms = 8192 bytes per warpgroup into each
    // half; B: a Q or dO tile): d 16 kk.. lie in half kk / 4, 32 (kk % 4) bytes into the rows. MN-major (B of dV, dK:
    // a dO or Q tile): queries 16 kk.. start 2048 kk bytes in, half n of d n · Q_HALF bytes in.
    const unsigned k_lo = fw_desc_lo(sK + 8192 * wg, 16), v_lo = fw_desc_lo(sV + 8192 * wg, 16);
    auto mma_t = [&](float (&d)[32], unsigned a_lo, unsigned b_lo) {  // d = A Bᵀ over the HD columns
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned off = 32 * (kk & 3);
            wg_mma_ss<T, 0>(d, fw_desc(a_lo + (((kk >> 2) * KV_HALF + off) >> 4)),
                            fw_desc(b_lo + (((kk >> 2) * Q_HALF + off) >> 4)), kk > 0);
        }
    };
    float adk[NH][32], adv[NH][32];  // [n]: d 64 n .. 64 n + 63 of this thread's rows
#pragma unroll
    for (int n = 0; n < NH; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) adk[n][i] = adv[n][i] = 0.0f;

    for (int i = 0, q0 = q_first; i < n_steps; ++i, q0 = q0 + BQ < T_len ? q0 + BQ : q_first) {
        if (i + 1 < n_steps) {
            load_q_tile(i + 1);
            fa_cp_commit();
            fa_cp_wait<1>();
        } else {
            fa_cp_wait<0>();
        }
        wg_fence_proxy();
        __syncthreads();
        if (wk0 < T_len && (!causal || q0 + BQ - 1 >= wk0)) {  // per warpgroup: wgmma is warpgroup-collective
            const fa_row_stats* cS = sS + (i & 1) * BQ;
            const unsigned qk_lo = fw_desc_lo(q_buf(i), 16), dok_lo = fw_desc_lo(q_buf(i) + cfg::Q_TILE, 16);
            float s[32], dp[32];  // Sᵀ (then Pᵀ) and dPᵀ: this warpgroup's 64 keys x the tile's 64 queries
            wg_fence();
            mma_t(s, k_lo, qk_lo);
            wg_commit();
            mma_t(dp, v_lo, dok_lo);
            wg_commit();
            wg_wait<1>();  // Sᵀ done; dPᵀ may still run
            wg_pin(s);
            // element e: key wk0 + 16 w4 + g + 8 ((e >> 1) & 1), query q0 + col, col = 8 (e >> 2) + c + (e & 1)
            const bool edge = (causal && q0 < wk0 + 63) || q0 + BQ > T_len || wk0 + 64 > T_len;
            if (!edge) {
#pragma unroll
                for (int e = 0; e < 32; ++e) s[e] = fast_exp2(s[e] * c2 - cS[8 * (e >> 2) + c + (e & 1)].l2);
            } else {
#pragma unroll
                for (int e = 0; e < 32; ++e) {
                    const int col = 8 * (e >> 2) + c + (e & 1), key = wk0 + 16 * w4 + g + 8 * ((e >> 1) & 1);
                    const float pe = fast_exp2(s[e] * c2 - cS[col].l2);
                    s[e] = key < T_len && q0 + col < T_len && (!causal || key <= q0 + col) ? pe : 0.0f;
                }
            }
            unsigned pa[BQ / 16][4], ds[BQ / 16][4];  // Pᵀ and dSᵀ in 16 bits, A fragments of 16 queries each
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
            wg_wait<0>();  // dPᵀ done
            wg_pin(dp);
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {  // register r holds elements 8 kk + 2 r, +1: query column 16 kk + 8 (r / 2) + c
                    const int e = 8 * kk + 2 * r, col = 8 * (e >> 2) + c;
                    float p0, p1;  // dSᵀ / c = Pᵀ ⊙ (dPᵀ − D), with Pᵀ as rounded for dV
                    unpack2<T>(pa[kk][r], p0, p1);
                    ds[kk][r] = pack2<T>(p0 * (dp[e] - cS[col].d), p1 * (dp[e + 1] - cS[col + 1].d));
                }
            const unsigned q_lo = fw_desc_lo(q_buf(i), 8192), do_lo = fw_desc_lo(q_buf(i) + cfg::Q_TILE, 8192);
            wg_fence();
#pragma unroll
            for (int n = 0; n < NH; ++n)
#pragma unroll
                for (int kk = 0; kk < BQ / 16; ++kk) {
                    wg_mma_rs<T, 1>(adv[n], pa[kk], fw_desc(do_lo + ((n * Q_HALF + 2048 * kk) >> 4)), 1);
                    wg_mma_rs<T, 1>(adk[n], ds[kk], fw_desc(q_lo + ((n * Q_HALF + 2048 * kk) >> 4)), 1);
                }
            wg_commit();
            wg_wait<0>();  // nothing pending across the loop's back edge (the forward's lesson), the buffer free
#pragma unroll
            for (int n = 0; n < NH; ++n) {
                wg_pin(adv[n]);
                wg_pin(adk[n]);
            }
        }
        __syncthreads();  // every warpgroup is done with buffer i % 2 before tile i + 2 is copied into it
    }
    T* dkb = dk + b * dk_sb + h * dk_sh;
    T* dvb = dv + b * dv_sb + h * dv_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = wk0 + 16 * w4 + g + 8 * r;
        if (key >= T_len) continue;
        float xk[HD / 8][4];  // dK's row in flash_attention.cu's fragment order: column n·8 + c + e at [n][2r + e]
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) xk[n][e] = adk[n >> 3][4 * (n & 7) + e];
        if constexpr (ROPE)
            fa_rope_backward_row<HD>(xk, r, rope_cos + (long long)key * (HD / 2), rope_sin + (long long)key * (HD / 2),
                                     c);
        T* krow = dkb + (long long)key * dk_st;
        T* vrow = dvb + (long long)key * dv_st;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            *reinterpret_cast<unsigned*>(krow + n * 8 + c) = pack2<T>(xk[n][2 * r] * scale, xk[n][2 * r + 1] * scale);
            *reinterpret_cast<unsigned*>(vrow + n * 8 + c) =
                pack2<T>(adv[n >> 3][4 * (n & 7) + 2 * r], adv[n >> 3][4 * (n & 7) + 2 * r + 1]);
        }
    }
#else
    __trap();  // not sm_90a: wgmma does not exist here
#endif
}
