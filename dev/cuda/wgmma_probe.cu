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
#include "wgmma.cuh"

// llmgpu:kernel wgmma_probe<{0,1}, {0,1}>

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
    const unsigned raw = wg_saddr(smem_raw);
    const unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* a_s = smem_raw + pad;
    unsigned char* b_s = a_s + ((a_bytes + 1023) & ~1023);
    for (int i = tid; i < a_bytes / 16; i += 128) reinterpret_cast<uint4*>(a_s)[i] = a_img[i];
    for (int i = tid; i < b_bytes / 16; i += 128) reinterpret_cast<uint4*>(b_s)[i] = b_img[i];
    wg_fence_proxy();  // ordinary stores -> the async proxy
    __syncthreads();

    const unsigned long long a_base = wg_saddr(a_s) >> 4, b_base = wg_saddr(b_s) >> 4;
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    wg_fence();
    for (int ks = 0; ks < nk; ++ks) {
        const unsigned long long db = desc_b[ks] + b_base;  // the start field cannot carry: smem addresses are < 2^18
        if (A_REGS) {
            unsigned a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = a_frags[(ks * 128 + tid) * 4 + j];
            wg_mma_rs<__nv_bfloat16, TRANS_B>(d, a, db, 1);
        } else {
            wg_mma_ss<__nv_bfloat16, TRANS_B>(d, desc_a[ks] + a_base, db, 1);
        }
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; ++i) out[tid * 32 + i] = d[i];
#else
    __trap();  // not sm_90a: wgmma does not exist here
#endif
}
