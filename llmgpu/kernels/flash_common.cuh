// flash_common.cuh: what the flash-attention kernels share (flash_attention.cu, flash_attention_wgmma.cu): the
// asynchronous global -> shared copies their tiles arrive by. NVIDIA only (inline PTX, sm_80+).
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
