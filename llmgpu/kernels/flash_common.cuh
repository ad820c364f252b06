// flash_common.cuh: what the flash-attention kernels share (flash_attention.cu, flash_attention_wgmma.cu): the
// asynchronous global -> shared copies their tiles arrive by (NVIDIA only: inline PTX, sm_80+), the order in
// which their blocks take (head, tile) pairs, the backward's per-row statistics, and RoPE's backward on a row of a
// gradient before its store.
#pragma once

__device__ __forceinline__ unsigned fa_saddr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// cp.async (sm_80+): copy 16 (or 4) bytes global -> shared without passing through registers, so a tile's
// load runs while the warps compute on the other buffer. With `in` false nothing is read and the destination is
// zero-filled (the source-size operand is 0; g must still be a valid address). The destination is a shared-memory
// pointer, or its 32-bit shared address (for layouts computed on addresses, as the swizzled tiles of the wgmma
// kernel are).
__device__ __forceinline__ void fa_cp16(unsigned s, const void* g, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(in ? 16 : 0));
}
__device__ __forceinline__ void fa_cp16(void* s, const void* g, bool in) { fa_cp16(fa_saddr(s), g, in); }
__device__ __forceinline__ void fa_cp8(void* s, const void* g, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(fa_saddr(s)), "l"(g), "r"(in ? 8 : 0));
}
__device__ __forceinline__ void fa_cp4(void* s, const void* g, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(fa_saddr(s)), "l"(g), "r"(in ? 4 : 0));
}
// Close the group of copies issued so far; wait until at most N groups are still in flight (this thread's).
__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void fa_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Which (head, tile) a block of a flash kernel computes. Blocks start roughly in the order of their linear index
// (x fastest, then y, then z), so the grid's shape decides which blocks run together and which run last. The grid
// is (group, n_tiles, n_bh / group rounded up): heads in groups of `group`; within a group the tiles in turn, the
// group's heads fastest, each head's longest tile first (longest_last: the causal forward's and dQ's last query
// tile; otherwise the first, dK/dV's first key tile). The blocks in flight then read the K and V (dK/dV: Q and dO)
// of a group's heads, which the L2 keeps between them; and as long as a group holds a few waves of blocks, the grid
// still ends on short tiles. group = n_bh is the plain order (every head's longest tile first, then the next ...).
// The host picks the group (flash_launch.tile_group), as CUTLASS's and FlashAttention-3's tile schedulers order
// tiles for L2 reuse. Blocks of a last group beyond the n_bh heads return at once. Read from the block's own
// index, these cost no registers: the compiler reads them again where they are needed.
__device__ __forceinline__ int fa_block_head() { return blockIdx.z * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int fa_block_tile(bool longest_last) {
    return longest_last ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
}

// a / b for a >= 0, b > 0 (the K/V head h / G of query head h, a block's batch and head): unsigned division takes
// fewer instructions than the signed one, so ptxas recomputes it where needed instead of holding it in a register
// (with signed divisions the D = 64 wgmma forward and wide dK/dV kernels, at their register caps, spilled).
__device__ __forceinline__ int fa_udiv(int a, int b) {
    return static_cast<int>(static_cast<unsigned>(a) / static_cast<unsigned>(b));
}

// One row's statistics for the backward: lse · log2 e (the exponent's offset in base 2) and D = rowsum(dO ⊙ O),
// written by flash_bwd_dq_wide, read by the dK/dV kernels (one 8-byte copy per row).
struct fa_row_stats {
    float l2, d;
};

// RoPE's backward on one row of a gradient about to be stored (flash_attention.cu's header gives the formula), in
// place on the fp32 accumulators: x[n][2r + e] holds column n·8 + c + e of the row (r = 0: lane row g, r = 1: g + 8).
// Column j pairs with j + HD/2, which is tile n + HD/16 of the same lane (the C fragments put a lane's columns at
// c, c + 1 of every 8-column tile), so a lane rotates its own values. cos_row, sin_row: the rows of the [S, HD/2]
// fp32 tables at this row's position (8-byte aligned: the host checks, and runs a separate pass otherwise).
template <int HD>
__device__ __forceinline__ void fa_rope_backward_row(float (&x)[HD / 8][4], int r, const float* __restrict__ cos_row,
                                                     const float* __restrict__ sin_row, int c) {
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
        const float2 cs = *reinterpret_cast<const float2*>(cos_row + n * 8 + c);
        const float2 sn = *reinterpret_cast<const float2*>(sin_row + n * 8 + c);
        const float cv[2] = {cs.x, cs.y}, sv[2] = {sn.x, sn.y};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float lo = x[n][2 * r + e], hi = x[n + HD / 16][2 * r + e];
            x[n][2 * r + e] = lo * cv[e] + hi * sv[e];
            x[n + HD / 16][2 * r + e] = hi * cv[e] - lo * sv[e];
        }
    }
}
