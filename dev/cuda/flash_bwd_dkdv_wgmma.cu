// dev/cuda/flash_bwd_dkdv_wgmma.cu: the package's Hopper dK/dV kernel (flash_bwd_dkdv_wgmma in
// llmgpu/kernels/flash_attention_wgmma.cu) rewritten with a PIPE switch, FlashAttention-3's intra-warpgroup overlap
// (Shah et al. 2024), for flash_bwd_dkdv_wgmma.py to check and time beside the shipped kernel. The steps of a tile
// become lambdas that two loops share: PIPE = 0 is the shipped kernel's order; PIPE = 1 issues Sᵀ of tile i + 1, dV
// and dK of tile i, then dPᵀ of tile i + 1, and computes the exponentials of tile i + 1 while the tensor cores run
// the rest, with a ring of three Q/dO buffers. flash_wgmma_plan.md says what ran and why it stays here.
// The package's kernels directory is on the include path.
#include "flash_attention_wgmma.cu"

// PIPE = 1 at D = 128 spills (255 registers and 420 bytes), so that one is not built
// llmgpu:kernel flash_bwd_dkdv_wgmma_pipe<{__half,__nv_bfloat16}, 64, 0, 2, {0,1}>
// llmgpu:kernel flash_bwd_dkdv_wgmma_pipe<{__half,__nv_bfloat16}, 128, 0, 2, 0>

template <int HD, int WG, int PIPE> struct bw_pipe_cfg {
    static constexpr int BN = 64 * WG, NT = 128 * WG;  // keys and threads per block
    static constexpr int NBUF = 2 + PIPE;              // Q/dO tile buffers: double-buffered, a ring of three with PIPE
    static constexpr int KV_TILE = BN * HD * 2;        // the block's K or V: HD / 64 swizzled halves of BN x 128 bytes
    static constexpr int Q_TILE = BW_BQ * HD * 2;      // one Q or dO tile
    static constexpr int SMEM = 1024 + 2 * KV_TILE + NBUF * (2 * Q_TILE + BW_BQ * 8);  // with the alignment slack
    static_assert(SMEM <= 227 * 1024, "a tile configuration that does not fit");
};

template <typename T, int HD, int ROPE, int WG, int PIPE>
__global__ void __launch_bounds__(128 * WG, 1)
flash_bwd_dkdv_wgmma_pipe(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const fa_row_stats* __restrict__ stats, T* __restrict__ dk,
                     T* __restrict__ dv, int H, int G, int T_len, float scale, int causal, int n_bh, long long q_sb,
                     long long q_sh, long long q_st, long long k_sb, long long k_sh, long long k_st, long long v_sb,
                     long long v_sh, long long v_st, long long do_sb, long long do_sh, long long do_st,
                     long long dk_sb, long long dk_sh, long long dk_st, long long dv_sb, long long dv_sh,
                     long long dv_st, const float* __restrict__ rope_cos, const float* __restrict__ rope_sin) {
#ifdef LLMGPU_WGMMA
    using cfg = bw_pipe_cfg<HD, WG, PIPE>;
    constexpr int BN = cfg::BN, NT = cfg::NT, BQ = BW_BQ, NH = HD / 64, NBUF = cfg::NBUF;
    constexpr int KV_HALF = BN * 128, Q_HALF = BQ * 128;  // bytes between the 64-column halves of d
    extern __shared__ __align__(1024) unsigned char bw_smem[];
    const unsigned raw = wg_saddr(bw_smem);
    unsigned char* base = bw_smem + ((1024u - (raw & 1023u)) & 1023u);
    const unsigned sK = wg_saddr(base), sV = sK + cfg::KV_TILE;
    const unsigned sQ = sV + cfg::KV_TILE;  // buffer b: Q at sQ + 2·b·Q_TILE, dO one Q_TILE on
    fa_row_stats* sS = reinterpret_cast<fa_row_stats*>(base + 2 * cfg::KV_TILE + NBUF * 2 * cfg::Q_TILE);  // NBUF rows
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
    auto q_buf = [&](int i) { return sQ + (i % NBUF) * 2 * cfg::Q_TILE; };
    auto load_q_tile = [&](int i) {  // Q, dO and the row stats of step i into buffer i % NBUF
        fw_load_tile<T, HD, BQ, NT>(q_buf(i), qb + lj * q_sh, q_st, lq0, T_len);
        fw_load_tile<T, HD, BQ, NT>(q_buf(i) + cfg::Q_TILE, dob + lj * do_sh, do_st, lq0, T_len);
        if (tid < BQ) {
            const int row = lq0 + tid;
            const bool in = row < T_len;
            fa_cp8(sS + (i % NBUF) * BQ + tid, statsb + (long long)lj * T_len + (in ? row : 0), in);
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

    // The steps of one tile, by lambdas shared by both loops below. Tile i sits in buffer i % NBUF; q0 is its first
    // query row. Sᵀ lands in s (Pᵀ in fp32 after p_exp), dPᵀ in dp; pa, ds hold Pᵀ, dSᵀ in 16 bits for dV, dK.
    float s[32], dp[32];  // Sᵀ (then Pᵀ) and dPᵀ: this warpgroup's 64 keys x the tile's 64 queries
    unsigned pa[BQ / 16][4], ds[BQ / 16][4];  // Pᵀ and dSᵀ in 16 bits, A fragments of 16 queries each
    auto active = [&](int q0) { return wk0 < T_len && (!causal || q0 + BQ - 1 >= wk0); };  // per warpgroup
    auto issue_s = [&](int i) {
        mma_t(s, k_lo, fw_desc_lo(q_buf(i), 16));
        wg_commit();
    };
    auto issue_dp = [&](int i) {
        mma_t(dp, v_lo, fw_desc_lo(q_buf(i) + cfg::Q_TILE, 16));
        wg_commit();
    };
    auto p_exp = [&](int i, int q0) {  // s = Sᵀ → Pᵀ = 2^(c·log2e·Sᵀ − lse·log2e), masked
        const fa_row_stats* cS = sS + (i % NBUF) * BQ;
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
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    };
    auto make_ds = [&](int i) {  // dSᵀ / c = Pᵀ ⊙ (dPᵀ − D), with Pᵀ as rounded for dV
        const fa_row_stats* cS = sS + (i % NBUF) * BQ;
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // register r holds elements 8 kk + 2 r, +1: query column 16 kk + 8 (r / 2) + c
                const int e = 8 * kk + 2 * r, col = 8 * (e >> 2) + c;
                float p0, p1;
                unpack2<T>(pa[kk][r], p0, p1);
                ds[kk][r] = pack2<T>(p0 * (dp[e] - cS[col].d), p1 * (dp[e + 1] - cS[col + 1].d));
            }
    };
    auto issue_dvdk = [&](int i) {  // dV += Pᵀ dO, dK += dSᵀ Q
        const unsigned q_lo = fw_desc_lo(q_buf(i), 8192), do_lo = fw_desc_lo(q_buf(i) + cfg::Q_TILE, 8192);
#pragma unroll
        for (int n = 0; n < NH; ++n)
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk) {
                wg_mma_rs<T, 1>(adv[n], pa[kk], fw_desc(do_lo + ((n * Q_HALF + 2048 * kk) >> 4)), 1);
                wg_mma_rs<T, 1>(adk[n], ds[kk], fw_desc(q_lo + ((n * Q_HALF + 2048 * kk) >> 4)), 1);
            }
        wg_commit();
    };
    auto pin_dkdv = [&]() {
#pragma unroll
        for (int n = 0; n < NH; ++n) {
            wg_pin(adv[n]);
            wg_pin(adk[n]);
        }
    };
    auto next_q0 = [&](int q0) { return q0 + BQ < T_len ? q0 + BQ : q_first; };
    auto p_ds = [&](int i, int q0) {  // Sᵀ and dPᵀ of tile i issued and waited for: Pᵀ (pa) and dSᵀ (ds) made
        wg_fence();
        issue_s(i);
        issue_dp(i);
        wg_wait<1>();  // Sᵀ done; dPᵀ may still run
        wg_pin(s);
        p_exp(i, q0);
        pack_p();
        wg_wait<0>();  // dPᵀ done
        wg_pin(dp);
        make_ds(i);
    };
    auto dvdk = [&](int i) {  // dV and dK of tile i issued and waited for
        wg_fence();
        issue_dvdk(i);
        wg_wait<0>();
        pin_dkdv();
    };

    if constexpr (!PIPE) {
        // Per tile: load tile i + 1, then Sᵀ, dPᵀ (two commit groups: the exponentials overlap dPᵀ), dSᵀ, dV and dK,
        // and wait for them: nothing pending across the back edge (the forward's lesson)
        for (int i = 0, q0 = q_first; i < n_steps; ++i, q0 = next_q0(q0)) {
            if (i + 1 < n_steps) {
                load_q_tile(i + 1);
                fa_cp_commit();
                fa_cp_wait<1>();
            } else {
                fa_cp_wait<0>();
            }
            wg_fence_proxy();
            __syncthreads();
            if (active(q0)) {  // wgmma is warpgroup-collective: the skip is per warpgroup
                p_ds(i, q0);
                dvdk(i);  // and the buffer free
            }
            __syncthreads();  // every warpgroup is done with buffer i % 2 before tile i + 2 is copied into it
        }
    } else {
        // FlashAttention-3's intra-warpgroup overlap (Shah et al. 2024): iteration i issues Sᵀ of tile i + 1, dV and
        // dK of tile i (Pᵀ, dSᵀ made in iteration i − 1), then dPᵀ of tile i + 1, and computes the exponentials of
        // tile i + 1 while the tensor cores work on dV, dK and dPᵀ; Pᵀ is packed once dV, dK are done (they read
        // its registers). Still nothing pending across the back edge. Three Q/dO buffers: tile i + 2 is copied,
        // after the barrier, into the buffer of tile i − 1, which every warpgroup finished in iteration i − 1.
        if (n_steps > 1) {
            load_q_tile(1);
            fa_cp_commit();
            fa_cp_wait<1>();
        } else {
            fa_cp_wait<0>();
        }
        wg_fence_proxy();
        __syncthreads();
        bool act = active(q_first);
        if (act) p_ds(0, q_first);
        for (int i = 0, q0 = q_first; i < n_steps; ++i) {
            const int q1 = next_q0(q0);
            const bool more = i + 1 < n_steps;
            fa_cp_wait<0>();  // this thread's copies of tile i + 1
            wg_fence_proxy();
            __syncthreads();  // tile i + 1 in place, and tile i − 1's buffer free
            if (i + 2 < n_steps) {
                load_q_tile(i + 2);
                fa_cp_commit();
            }
            const bool act1 = more && active(q1);
            // one straight sequence per case (a wgmma issued on a path that branches on act or act1 made ptxas
            // serialize them all: its C7520 note)
            if (act && act1) {
                wg_fence();
                issue_s(i + 1);
                issue_dvdk(i);
                issue_dp(i + 1);
                wg_wait<2>();  // Sᵀ of tile i + 1 done
                wg_pin(s);
                p_exp(i + 1, q1);
                wg_wait<1>();  // dV, dK of tile i done: pa, ds free
                pin_dkdv();
                pack_p();
                wg_wait<0>();  // dPᵀ of tile i + 1 done
                wg_pin(dp);
                make_ds(i + 1);
            } else if (act1) {
                p_ds(i + 1, q1);
            } else if (act) {
                dvdk(i);
            }
            act = act1;
            q0 = q1;
        }
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
