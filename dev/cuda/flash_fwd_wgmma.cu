// dev/cuda/flash_fwd_wgmma.cu: an experiment, not part of the llmgpu package (issue 16, steps 2 and 4 of
// flash_wgmma_plan.md, which says what has been run). It takes the layouts of wgmma_probe.py's hypotheses "RS, B
// sw128" (S = Q Kᵀ) and "RS, B MN-major sw128 (imm-trans-b)" (O += P V): run the probe first; if it finds other
// layouts, fw_load_tile and the wg_desc arguments change.
//
// The forward of llmgpu/kernels/flash_attention.cu (flash_fwd: same arguments, same math, same row statistics)
// with its two GEMMs on Hopper's asynchronous warpgroup MMA instead of mma.sync, D = 64 and 128:
//
// * A block owns 128 query rows: two warpgroups (4 warps each) of 64 rows. Q is read once from shared memory
//   into registers (ldmatrix, the A fragments of mma.m16n8k16, warp w of a warpgroup giving rows 16w..16w+15,
//   which is wgmma's register-A layout), so S = Q Kᵀ is wgmma m64n64k16 x D/16 (over d) with A from registers
//   and K from shared memory; O += P V is m64n64k16 x 4 (over 64 keys) per 64 columns of d, with P from
//   registers (the S accumulators are mma.m16n8's C fragments repeated over N, so fa_c_to_a's packing makes P's
//   A fragments) and V from shared memory through imm-trans-b (V is stored [key][d], d contiguous: MN-major).
// * K and V tiles of 64 keys sit in shared memory as D/64 halves of 64 keys x 64 d (128 bytes per row), each in
//   the 128-byte swizzle (chunk c of row r at chunk c ^ (r % 8), 1024-byte atoms of 8 rows), written by cp.async
//   chunk by chunk; no padding, no bank conflicts. Every wgmma reads within one half, so the probe's one-atom
//   layouts are all it needs. A ring of three K/V buffers, one barrier per tile: tile j + 2 is loaded during tile j, into
//   the buffer of tile j - 1, which every warpgroup has finished with (no MMA is pending across tiles).
// * PIPE (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024): per tile, S of tile j + 1 and then
//   O += P V of tile j are issued; the softmax of tile j + 1 runs as soon as its S is done, while the tensor cores
//   still work on P V; P is packed for the next tile once P V is done. PIPE = 0 issues, waits and computes in turn.
//   Nothing is pending across the loop's back edge: with MMAs pending there ptxas serialized every wgmma
//   (its C7514 note), which the compile check's log shows.
// * Causal: a warpgroup skips the tiles wholly above its 64 rows' diagonal (wgmma is warpgroup-collective, so
//   the skip is per warpgroup, not per warp as in flash_fwd); masking is per element as in flash_fwd.
#include "common.cuh"
#include "wgmma.cuh"

// llmgpu:kernel flash_fwd_wgmma<{__half,__nv_bfloat16}, {64,128}, {0,1}>

#define FW_LOG2E 1.4426950408889634f
#define FW_LN2 0.6931471805599453f
#define FW_INF __int_as_float(0x7f800000)

constexpr int FW_BN = 64, FW_WG = 2;                     // keys per tile, warpgroups per block
constexpr int FW_BM = 64 * FW_WG, FW_NT = 128 * FW_WG;    // query rows and threads per block
constexpr int FW_HALF = FW_BN * 64 * 2, FW_BUFS = 3;      // one swizzled 64 x 64 half of a K or V tile: 8 KiB
template <int HD> struct fw_cfg {
    static constexpr int LDQ = HD + 8;                    // Q's padded row (ldmatrix without conflicts)
    static constexpr int Q_BYTES = FW_BM * LDQ * 2;       // 18 or 34 KiB, multiples of 1024
    static constexpr int TILE = HD / 64 * FW_HALF;        // one K or V tile
    static constexpr int MIN_BLOCKS = HD == 64 ? 2 : 1;   // HD = 128: 64 accumulators of O, 32 registers of Q
};

__device__ __forceinline__ void fw_cp16(unsigned s, const void* g, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(in ? 16 : 0));
}
__device__ __forceinline__ void fw_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fw_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Rows [row0, row0 + 64) of a [T, HD] view (row stride st) into a 1024-aligned tile: HD / 64 halves of 64 columns,
// FW_HALF bytes apart, each in the 128-byte swizzle.
template <typename T, int HD>
__device__ __forceinline__ void fw_load_tile(unsigned s, const T* __restrict__ g, long long st, int row0, int T_len) {
    constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
#pragma unroll
    for (int it = 0; it < FW_BN * CHUNKS / FW_NT; ++it) {
        const int i = threadIdx.x + it * FW_NT, r = i / CHUNKS, c = i % CHUNKS;
        const bool in = row0 + r < T_len;
        fw_cp16(s + (c >> 3) * FW_HALF + (r >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4),
                g + ((in ? row0 + r : 0) * static_cast<int>(st) + c * 8), in);
    }
}

// Descriptors of the swizzled tiles (wgmma_probe.py's "sw128" hypotheses): K-major (K for S = Q Kᵀ): k step kk
// starts 32·kk bytes in, SBO = 1024 (the next 8 keys), LBO unused (16); MN-major (V for P V): k step kk starts
// 2048·kk bytes in (16 keys), SBO = 1024 (the next 8 keys), LBO unused (64 d are one 128-byte row; 8192).
constexpr unsigned FW_SW128 = 1;

template <typename T, int HD, int PIPE>
__global__ void __launch_bounds__(FW_NT, fw_cfg<HD>::MIN_BLOCKS)
flash_fwd_wgmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                float* __restrict__ lse, int H, int T_len, float scale, int causal, long long q_sb, long long q_sh,
                long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb, long long v_sh,
                long long v_st, long long o_sb, long long o_sh, long long o_st) {
#ifdef LLMGPU_WGMMA
    extern __shared__ __align__(1024) unsigned char fw_smem[];
    const unsigned raw = wg_saddr(fw_smem);
    unsigned char* base = fw_smem + ((1024u - (raw & 1023u)) & 1023u);
    T* sQ = reinterpret_cast<T*>(base);
    constexpr int LDQ = fw_cfg<HD>::LDQ, TILE = fw_cfg<HD>::TILE, NH = HD / 64;  // NH: 64-column halves of d
    const unsigned kv0 = wg_saddr(base) + fw_cfg<HD>::Q_BYTES;  // buffer b: K at kv0 + 2·b·TILE, V one TILE on
    const int tid = threadIdx.x, wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, c = (lane & 3) * 2;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * FW_BM;  // the longest causal rows first
    const int wg0 = q0 + wg * 64, w0 = wg0 + w4 * 16;     // this warpgroup's and this warp's first row
    const T* kb = k + b * k_sb + h * k_sh;
    const T* vb = v + b * v_sb + h * v_sh;
    const float c2 = scale * FW_LOG2E;
    const int kv_end = causal ? min(T_len, q0 + FW_BM) : T_len;
    const int n_tiles = (kv_end + FW_BN - 1) / FW_BN;
    auto k_tile = [&](int j) { return kv0 + (j % FW_BUFS) * 2 * TILE; };
    auto load_kv = [&](int j) {
        fw_load_tile<T, HD>(k_tile(j), kb, k_st, j * FW_BN, T_len);
        fw_load_tile<T, HD>(k_tile(j) + TILE, vb, v_st, j * FW_BN, T_len);
    };

    {  // Q, padded, as flash_fwd loads it
        const T* qb = q + b * q_sb + h * q_sh;
#pragma unroll
        for (int it = 0; it < FW_BM * (HD / 8) / FW_NT; ++it) {
            const int i = tid + it * FW_NT, r = i / (HD / 8), cc = (i % (HD / 8)) * 8;
            const bool in = q0 + r < T_len;
            fw_cp16(wg_saddr(sQ + r * LDQ + cc), qb + ((in ? q0 + r : 0) * static_cast<int>(q_st) + cc), in);
        }
    }
    load_kv(0);
    fw_cp_commit();
    if (n_tiles > 1) {
        load_kv(1);
        fw_cp_commit();
    }
    fw_cp_wait_all();
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
    auto qk = [&](float (&d)[32], int j) {  // d = Q K_jᵀ (scale-d 0 on the first k step: no zeroing)
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)  // d 16 kk.. lie in half kk / 4, 32 (kk % 4) bytes into its rows
            wg_mma_rs<T, 0>(d, qf[kk], wg_desc(k_tile(j) + (kk >> 2) * FW_HALF + 32 * (kk & 3), 16, 1024, FW_SW128),
                            kk > 0);
        wg_commit();
    };

    // the tiles this warpgroup computes: 0 .. n_wg - 1 (causal: up to its last row's diagonal)
    const int n_wg = wg0 >= T_len ? 0 : causal ? min(n_tiles, (wg0 + 63) / FW_BN + 1) : n_tiles;
    float s[32], acc[NH][32], m[2] = {-FW_INF, -FW_INF}, l[2] = {0.0f, 0.0f};  // acc[n]: d 64 n .. 64 n + 63
#pragma unroll
    for (int n = 0; n < NH; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[n][i] = 0.0f;
    auto pin_acc = [&]() {
#pragma unroll
        for (int n = 0; n < NH; ++n) wg_pin(acc[n]);
    };
    unsigned pf[FW_BN / 16][4];  // P as the A fragments of O += P V, 16 keys each
    float alpha[2];
    // the online softmax of tile j in s: exponentiated in place, the running max and sum updated, alpha the
    // rescale of acc
    auto softmax = [&](int j) {
        const int k0 = j * FW_BN;
        if ((causal && k0 + FW_BN - 1 > w0) || k0 + FW_BN > T_len) {  // the diagonal or the ragged last tile
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int key = k0 + (i >> 2) * 8 + c + (i & 1), row = w0 + g + 8 * ((i >> 1) & 1);
                s[i] = key < T_len && (!causal || key <= row) ? s[i] * c2 : -FW_INF;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] *= c2;
        }
        float mx[2] = {m[0], m[1]}, ref[2];
#pragma unroll
        for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // a row's 64 scores: one quad
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            ref[r] = mx[r] == -FW_INF ? 0.0f : mx[r];  // no -inf - -inf (flash_fwd's fa_ref)
            alpha[r] = fast_exp2(m[r] - ref[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            s[i] = fast_exp2(s[i] - ref[(i >> 1) & 1]);
            l[(i >> 1) & 1] += s[i];
        }
    };
    auto pack_p = [&]() {  // s (exponentiated) -> pf, once the MMAs reading the previous pf are done
#pragma unroll
        for (int kk = 0; kk < FW_BN / 16; ++kk) {
            pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
            pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
            pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
            pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    auto pv = [&](int j) {  // acc = alpha · acc + P V_j, issued (after the MMAs that wrote acc were waited for)
        pin_acc();
#pragma unroll
        for (int n = 0; n < NH; ++n)
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[n][i] *= alpha[(i >> 1) & 1];
        wg_fence();
#pragma unroll
        for (int n = 0; n < NH; ++n)  // V's half n: keys 16 kk.. start 2048 kk bytes in
#pragma unroll
            for (int kk = 0; kk < FW_BN / 16; ++kk)
                wg_mma_rs<T, 1>(acc[n], pf[kk], wg_desc(k_tile(j) + TILE + n * FW_HALF + 2048 * kk, 8192, 1024, FW_SW128),
                                1);
        wg_commit();
    };

    if (n_wg > 0) {
        qk(s, 0);
        wg_wait<0>();
        wg_pin(s);
        softmax(0);
        pack_p();
    }
    // On entry to tile j, P of tile j is in pf and no MMA is pending (so ptxas can follow the groups: with MMAs
    // pending across the loop's back edge it serialized every wgmma).
    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) {  // tile j + 1 (loaded during tile j - 1) is needed now: S of it may be issued
            fw_cp_wait_all();
            wg_fence_proxy();
        }
        __syncthreads();  // and every warpgroup is done with tile j - 1, whose buffer tile j + 2 takes
        if (j + 2 < n_tiles) {
            load_kv(j + 2);
            fw_cp_commit();
        }
        if (PIPE && j + 1 < n_wg) {
            qk(s, j + 1);       // pending: S of j + 1
            pv(j);              // pending: S of j + 1, P V of j
            wg_wait<1>();       // S of j + 1 done
            wg_pin(s);
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
                wg_pin(s);
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
