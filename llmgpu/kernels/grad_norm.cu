// grad_norm.cu: the global L2 norm of a flat gradient, the clip coefficient and an inf/nan flag,
// in one launch, deterministic, with no float atomics and no trip to the host (chapters 4 and 5).
//
// Stage 1: every block sums the squares of its grid-stride share (fp32 per thread, 4 lanes kept
// apart then added), reduces over the block, and writes one partial sum and one "saw a non-finite
// value" bit to global memory.
// Stage 2, in the same launch: each block then takes a ticket from an atomic counter; the block that
// draws the last ticket knows all partials are written (each was followed by a __threadfence before
// the ticket), and sums them in a fixed order in fp64, so the result does not depend on which block
// finished first: same input and grid → bit-identical norm. (The pattern of CUDA's
// threadFenceReduction sample; float atomicAdd would make the last bits depend on timing.)
// The last block writes
//     norm      = sqrt(sum of squares) * prescale             (prescale = 1/loss_scale, or 1)
//     scale     = prescale * min(1, max_norm / (norm + GN_CLIP_EPS))  (max_norm <= 0: no clipping)
//     found_inf = 1 if any element was inf or nan, else 0
// so the optimizer can take `scale` as its grad_scale and `found_inf` as its skip flag directly.
// The inf/nan test is on the bits (exponent all ones), not on the sum: a sum of squares can also
// overflow from large finite values, and NVRTC has no <math.h> isfinite.
#include "common.cuh"

// llmgpu:kernel grad_norm_kernel<{float,__half,__nv_bfloat16}>

#define GN_THREADS 256     // the block (the host launches exactly this)
#define GN_CLIP_EPS 1e-6f  // the clip coefficient's guard against a zero norm (optim/clip.py reads it)

__device__ __forceinline__ bool not_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// blockDim.x == GN_THREADS; gridDim.x <= max_partials.
template <typename T>
__global__ void __launch_bounds__(GN_THREADS) grad_norm_kernel(
    const T* __restrict__ x, long long n, int vec,
    float* partial_sq, unsigned int* partial_bad, unsigned int* done,
    const float* __restrict__ prescale_ptr, int has_prescale, float max_norm,
    float* norm_out, float* scale_out, float* found_out) {
    __shared__ float scratch[32];
    __shared__ double scratch_d[32];
    __shared__ bool is_last;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;

    // ---- stage 1: this thread's share
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unsigned int bad = 0u;
    const long long n4 = vec ? n / 4 : 0;
    // 4 independent 4-wide loads per iteration (a read-only kernel needs many loads in flight)
    for (long long i0 = tid; i0 < n4; i0 += 4 * nthreads) {
        float e[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long i = i0 + u * nthreads;
            if (i < n4) {
                load4_stream(x + 4 * i, e[u]);
            } else {
                e[u][0] = e[u][1] = e[u][2] = e[u][3] = 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[k] = fmaf(e[u][k], e[u][k], acc[k]);
                bad |= not_finite(e[u][k]) ? 1u : 0u;
            }
        }
    }
    for (long long i = 4 * n4 + tid; i < n; i += nthreads) {
        const float e = to_float(x[i]);
        acc[0] = fmaf(e, e, acc[0]);
        bad |= not_finite(e) ? 1u : 0u;
    }
    float s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    s = block_sum(s, scratch);
    const int any_bad = __syncthreads_or((int)bad);
    if (threadIdx.x == 0) {
        partial_sq[blockIdx.x] = s;
        partial_bad[blockIdx.x] = any_bad ? 1u : 0u;
        __threadfence();  // partials visible to every block before the ticket is taken
        const unsigned int ticket = atomicAdd(done, 1u);
        is_last = (ticket == gridDim.x - 1);
    }
    __syncthreads();
    if (!is_last) return;

    // ---- stage 2 (last block only): fixed-order sum of the partials in fp64
    __threadfence();
    double d = 0.0;
    unsigned int b = 0u;
    const volatile float* ps = partial_sq;       // volatile: read from L2, not a stale L1 line
    const volatile unsigned int* pb = partial_bad;
    for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) {
        d += (double)ps[i];
        b |= pb[i];
    }
    // block reduction in fp64, fixed tree: deterministic for a fixed blockDim
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    d = warp_sum_d(d);
    if (lane == 0) scratch_d[warp] = d;
    const int b_any = __syncthreads_or((int)b);
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < nwarps; ++w) total += scratch_d[w];
        const float pre = has_prescale ? prescale_ptr[0] : 1.0f;
        const float norm = (float)sqrt(total) * pre;
        const float coef = (max_norm > 0.0f) ? fminf(1.0f, max_norm / (norm + GN_CLIP_EPS)) : 1.0f;
        norm_out[0] = norm;
        scale_out[0] = pre * coef;
        found_out[0] = b_any ? 1.0f : 0.0f;
        atomicExch(done, 0u);  // counter back to zero for the next launch
    }
}
