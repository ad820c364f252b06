// wgmma.cuh: Hopper's asynchronous warpgroup MMA (wgmma), the wrappers flash_attention_wgmma.cu and the dev/cuda
// experiments (wgmma_probe.cu) use.
//
// wgmma exists on sm_90a only (the arch-specific target, __CUDA_ARCH_FEAT_SM90_ALL); compiled for anything else the
// wrappers are empty and LLMGPU_WGMMA is undefined, so a kernel can trap instead. PTX facts (the PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): the 128 threads of a warpgroup issue one
// m64nNk16 together; wgmma.fence comes before the first wgmma that reads registers written by ordinary
// instructions (accumulators, a register A operand); commit_group closes a group, wait_group N waits until at most
// N groups are pending, and no register of a pending wgmma may be read or written before that.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LLMGPU_WGMMA 1
#endif

template <typename T> struct wg_is_half { static constexpr bool value = false; };
template <> struct wg_is_half<__half> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned wg_saddr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// The 64-bit shared-memory matrix descriptor: start address, LBO and SBO in 16-byte units (bits 0-13, 16-29,
// 32-45), base offset 0 (tiles start on 1024-byte boundaries), swizzle in bits 62-63 (0 none, 1 128-byte).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lbo, unsigned sbo, unsigned swizzle) {
    return static_cast<unsigned long long>((saddr & 0x3FFFF) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32) | (static_cast<unsigned long long>(swizzle) << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (ordinary stores, cp.async) made visible to wgmma's async proxy:
// each writer fences, then a barrier orders the writers before the readers.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The 32 fp32 accumulators of an m64n64 result per thread: as PTX operands %0..%31 and as asm constraints.
#define WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC32(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31])

// Pin accumulators at this point of the program: after a wait, no read of them moves above it.
__device__ __forceinline__ void wg_pin(float (&d)[32]) { asm volatile("" : WG_ACC32(d)::"memory"); }
// One wgmma m64n64k16 with fp32 accumulation on 16-bit inputs of PTX type TY ("f16" or "bf16"): SS reads A and B
// by descriptor (operands 32, 33), RS takes A from four registers (32-35) and B by descriptor (36).
#define WG_MMA_SS(TY)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_D32                    \
                 ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                                    \
                 : WG_ACC32(d)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))
#define WG_MMA_RS(TY)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_D32                    \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                       \
                 : WG_ACC32(d)                                                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))

// d (64 x 64, fp32) = or += A (64 x 16) · B (16 x 64); scale_d 0 ignores d's old value. A and B from shared memory
// by descriptor (ss), or A from registers (rs: warp w of the warpgroup gives rows 16w..16w+15 as mma.m16n8k16's A
// fragment). TRANS_B: B stored MN-major (imm-trans-b), 16-bit types only.
template <typename T, int TRANS_B>
__device__ __forceinline__ void wg_mma_ss(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b,
                                          int scale_d) {
#ifdef LLMGPU_WGMMA
    if constexpr (wg_is_half<T>::value) WG_MMA_SS("f16");
    else WG_MMA_SS("bf16");
#endif
}

template <typename T, int TRANS_B>
__device__ __forceinline__ void wg_mma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long desc_b,
                                          int scale_d) {
#ifdef LLMGPU_WGMMA
    if constexpr (wg_is_half<T>::value) WG_MMA_RS("f16");
    else WG_MMA_RS("bf16");
#endif
}
