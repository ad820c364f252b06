// adamw.cu: one fused AdamW step over a flat fp32 parameter buffer (chapter 4).
//
// Per element, with t the 1-based step and g the (unscaled, clipped) gradient:
//     g  = grad * grad_scale                       (loss-scale unscaling and clipping in one factor)
//     m  = beta1 m + (1 - beta1) g
//     v  = beta2 v + (1 - beta2) g^2
//     p  = p (1 - lr wd)            [decayed tensors only: i < decay_end]  (decoupled, Loshchilov & Hutter)
//     p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// the same arrangement of the bias corrections as torch.optim.AdamW.
//
// The kernel is memory bound: per parameter it reads p, g, m, v and writes p, m, v and the
// working-precision copy (30 bytes with fp32 grads and a bf16 copy) for ~15 flops. Everything that
// can ride along in the same pass does, so those bytes move once per step:
//   * writing the bf16/fp16 working copy the next forward pass reads (no separate cast launch),
//   * zeroing the gradient for the next accumulation (no separate memset),
//   * skipping the whole update when `found_inf` is set (fp16 loss scaling), decided on the device,
//   * advancing the step counter on the device: the last block to finish increments it, so a skipped
//     step leaves it alone and the host never has to read anything back.
// The last-block pattern (a __threadfence, then an atomic ticket counter) is the one of CUDA's
// threadFenceReduction sample. Every block reads the counter before taking its ticket, so the last
// block knows everyone has read it before it writes.
//
// Vector path: 4 elements per access (float4 for fp32, 8 bytes for 16-bit types), two independent
// groups per thread and iteration so more loads are in flight, with streaming cache hints
// (load4_stream / store4_stream, common.cuh): every byte is touched exactly once per step. The host
// enables it (ADAMW_VEC) only when every pointer is 16-byte aligned (8 for 16-bit arrays); the
// remainder n % 4 runs scalar.
#include "common.cuh"

// llmgpu:kernel adamw_kernel<{float,__half,__nv_bfloat16}, {float,__half,__nv_bfloat16}>

#define ADAMW_LR_PTR 1          // lr comes from lr_ptr[0] (device scalar) instead of `lr`
#define ADAMW_GS_PTR 2          // grad_scale comes from gs_ptr[0]
#define ADAMW_FOUND_INF 4       // skip the step when found_inf[0] != 0
#define ADAMW_STEP_PTR 8        // t = step[0] + step_value (a device counter) instead of t = step_value
#define ADAMW_INCREMENT 16      // the last block stores step[0] = t when the step was taken
#define ADAMW_ZERO_GRAD 32      // write zeros into g after reading it
#define ADAMW_WRITE_WORKING 64  // write the updated weights, cast to W, into w
#define ADAMW_VEC 128           // pointers aligned: use 4-wide vector accesses

// One element of the update, shared by the vector and scalar paths. The roundings are spelled out
// (fmaf, __fmul_rn, __fdiv_rn are never re-contracted by the compiler), so every copy of this code
// rounds identically: the fused launch and the per-tensor launches give bit-identical weights.
__device__ __forceinline__ void adamw_elem(float& p, float& m, float& v, float g, float beta1, float beta2,
                                           float eps, float step_size, float inv_sqrt_bc2, float decay) {
    m = fmaf(beta1, m, __fmul_rn(1.0f - beta1, g));
    v = fmaf(beta2, v, __fmul_rn(1.0f - beta2, __fmul_rn(g, g)));
    const float denom = fmaf(sqrtf(v), inv_sqrt_bc2, eps);
    p = fmaf(-step_size, __fdiv_rn(m, denom), __fmul_rn(p, decay));
}

// (No __launch_bounds__(256): with it ptxas capped the 16-bit-gradient variants' registers and
// spilled on sm_90; without it the grid is sized from the real occupancy.)
template <typename G, typename W>
__global__ void adamw_kernel(
    float* __restrict__ p, G* __restrict__ g, float* __restrict__ m, float* __restrict__ v, W* __restrict__ w,
    long long n, long long decay_end,
    float lr, const float* __restrict__ lr_ptr,
    float grad_scale, const float* __restrict__ gs_ptr,
    const float* __restrict__ found_inf,
    int* step, int step_value, unsigned int* done,
    float beta1, float beta2, float eps, float weight_decay, int flags) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    const bool zero_grad = (flags & ADAMW_ZERO_GRAD) != 0;
    const long long n4 = (flags & ADAMW_VEC) ? n / 4 : 0;

    // ---- skipped step (overflow in the fp16 gradients): touch nothing but, if asked, the gradient
    if ((flags & ADAMW_FOUND_INF) && found_inf[0] != 0.0f) {
        if (zero_grad) {
            const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (long long i = tid; i < n4; i += nthreads) store4_stream(g + 4 * i, zero4);
            for (long long i = 4 * n4 + tid; i < n; i += nthreads) g[i] = from_float<G>(0.0f);
        }
        return;  // uniform over the grid: the counter below is not touched either
    }

    const int t = (flags & ADAMW_STEP_PTR) ? step[0] + step_value : step_value;
    const float lr_ = (flags & ADAMW_LR_PTR) ? lr_ptr[0] : lr;
    const float gs = (flags & ADAMW_GS_PTR) ? gs_ptr[0] : grad_scale;
    const float bc1 = 1.0f - powf(beta1, (float)t);
    const float bc2 = 1.0f - powf(beta2, (float)t);
    const float step_size = lr_ / bc1;
    const float inv_sqrt_bc2 = 1.0f / sqrtf(bc2);
    const float decay_on = 1.0f - lr_ * weight_decay;
    const bool write_w = (flags & ADAMW_WRITE_WORKING) != 0;

    // ---- vector path: two groups of 4 per thread and iteration
    for (long long i0 = tid; i0 < n4; i0 += 2 * nthreads) {
        const long long i1 = i0 + nthreads;
        const bool has1 = i1 < n4;
        float pa[4], ga[4], ma[4], va[4], pb[4], gb[4], mb[4], vb[4];
        load4_stream(p + 4 * i0, pa); load4_stream(g + 4 * i0, ga); load4_stream(m + 4 * i0, ma); load4_stream(v + 4 * i0, va);
        if (has1) { load4_stream(p + 4 * i1, pb); load4_stream(g + 4 * i1, gb); load4_stream(m + 4 * i1, mb); load4_stream(v + 4 * i1, vb); }
        // decay_end is a multiple of 4 in FlatParams; per element anyway, so any value is right
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float da = (4 * i0 + k < decay_end) ? decay_on : 1.0f;
            adamw_elem(pa[k], ma[k], va[k], __fmul_rn(ga[k], gs), beta1, beta2, eps, step_size, inv_sqrt_bc2, da);
        }
        store4_stream(p + 4 * i0, pa); store4_stream(m + 4 * i0, ma); store4_stream(v + 4 * i0, va);
        if (write_w) store4_stream(w + 4 * i0, pa);
        if (zero_grad) { const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f}; store4_stream(g + 4 * i0, z); }
        if (has1) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float db = (4 * i1 + k < decay_end) ? decay_on : 1.0f;
                adamw_elem(pb[k], mb[k], vb[k], __fmul_rn(gb[k], gs), beta1, beta2, eps, step_size, inv_sqrt_bc2, db);
            }
            store4_stream(p + 4 * i1, pb); store4_stream(m + 4 * i1, mb); store4_stream(v + 4 * i1, vb);
            if (write_w) store4_stream(w + 4 * i1, pb);
            if (zero_grad) { const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f}; store4_stream(g + 4 * i1, z); }
        }
    }
    // ---- scalar path: everything when unaligned, else the last n % 4 elements
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) {
        float pi = p[i], mi = m[i], vi = v[i];
        const float gi = __fmul_rn(to_float(g[i]), gs);
        adamw_elem(pi, mi, vi, gi, beta1, beta2, eps, step_size, inv_sqrt_bc2, (i < decay_end) ? decay_on : 1.0f);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (write_w) w[i] = from_float<W>(pi);
        if (zero_grad) g[i] = from_float<G>(0.0f);
    }

    // ---- the last block to finish advances the device step counter
    if (flags & ADAMW_INCREMENT) {
        __syncthreads();  // every thread of this block has read step[0] (t above)
        if (threadIdx.x == 0) {
            __threadfence();
            const unsigned int ticket = atomicAdd(done, 1u);
            if (ticket == gridDim.x - 1) {  // all other blocks have read step[0] already
                step[0] = t;
                atomicExch(done, 0u);       // ready for the next launch
            }
        }
    }
}
