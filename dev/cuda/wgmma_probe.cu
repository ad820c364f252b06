// dev/cuda/wgmma_probe.cu: an experiment, not part of the llmgpu package (issue 16, step 1 of flash_wgmma_plan.md).
//
// One warpgroup (128 threads) runs nk chained wgmma.mma_async m64n64k16 (bf16 in, fp32 accumulate) on operands
// the HOST laid out, and writes its 32 accumulator registers per thread raw. The kernel assumes nothing about
// layouts: the shared-memory images of A and B are copied in byte for byte, the descriptors (one per k step)
// come from the host with their start-address field relative to the image, and with A_REGS the A fragments come
// per thread from the host too. wgmma_probe.py states each layout as a hypothesis (image, descriptor bits,
// fragment order), runs it, and compares with NumPy; it also recovers the accumulator layout from the values.
//
// wgmma exists on sm_90a only (the arch-specific target). Compiled for anything else (the package's sm_80 /
// sm_90 compile check) the body traps, so the file still builds everywhere; wgmma_probe.py compiles it for
// sm_90a. PTX facts used: the PTX ISA's "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" sections
// (wgmma.fence before the first wgmma that reads registers written by ordinary instructions; shared memory
// written by ordinary stores made visible to the async proxy by fence.proxy.async; commit_group / wait_group).
#include "common.cuh"

// llmgpu:kernel wgmma_probe<{0,1}, {0,1}>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LLMGPU_WGMMA 1
#endif

template <int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
#ifdef LLMGPU_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#endif
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long desc_b, int scale_d) {
#ifdef LLMGPU_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
#endif
}

// a_img, b_img: the shared-memory images (a_bytes, b_bytes, multiples of 16); A_REGS: a_frags [nk][128][4] replace
// A's image. desc_a, desc_b: [nk] descriptors whose start-address field (bits 0-13, bytes >> 4) is relative to the
// image; each image starts on a 1024-byte boundary (the 128-byte swizzle repeats every 1024 bytes of address).
// out: [128][32] floats, thread t's accumulator i at out[32 t + i].
template <int A_REGS, int TRANS_B>
__global__ void __launch_bounds__(128) wgmma_probe(const uint4* __restrict__ a_img, int a_bytes,
                                                   const unsigned* __restrict__ a_frags,
                                                   const uint4* __restrict__ b_img, int b_bytes,
                                                   const unsigned long long* __restrict__ desc_a,
                                                   const unsigned long long* __restrict__ desc_b, int nk,
                                                   float* __restrict__ out) {
#ifdef LLMGPU_WGMMA
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
    const unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* a_s = smem_raw + pad;
    unsigned char* b_s = a_s + ((a_bytes + 1023) & ~1023);
    for (int i = tid; i < a_bytes / 16; i += 128) reinterpret_cast<uint4*>(a_s)[i] = a_img[i];
    for (int i = tid; i < b_bytes / 16; i += 128) reinterpret_cast<uint4*>(b_s)[i] = b_img[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // ordinary stores -> the async proxy
    __syncthreads();

    const unsigned long long a_base = static_cast<unsigned>(__cvta_generic_to_shared(a_s)) >> 4;
    const unsigned long long b_base = static_cast<unsigned>(__cvta_generic_to_shared(b_s)) >> 4;
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    for (int ks = 0; ks < nk; ++ks) {
        const unsigned long long db = desc_b[ks] + b_base;  // the start field cannot carry: smem addresses are < 2^18
        if (A_REGS) {
            unsigned a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = a_frags[(ks * 128 + tid) * 4 + j];
            wgmma_rs<TRANS_B>(d, a, db, 1);
        } else {
            wgmma_ss<TRANS_B>(d, desc_a[ks] + a_base, db, 1);
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; ++i) out[tid * 32 + i] = d[i];
#else
    __trap();  // not sm_90a: wgmma does not exist here
#endif
}
