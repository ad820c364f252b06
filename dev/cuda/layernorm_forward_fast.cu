// dev/cuda/layernorm_forward_fast.cu: an experiment, not part of the llmgpu package.
//
// A LayerNorm forward shaped like the package's layernorm_backward_fast (rows held as raw 16-byte
// packs, the next row's loads in flight while the current one is reduced, a persistent grid). It was
// the "fast" forward behind a switch that stayed off: the package's layernorm_forward_warp moves the
// same bytes faster (README.md beside this file has the measurements). It lives here so that it can
// be checked and timed again (layernorm_forward_fast.py) and keeps compiling (tests/test_dev_cuda.py);
// the package's kernels directory is on the include path for common.cuh.
#include "common.cuh"

// llmgpu:kernel layernorm_forward_fast<{__half,__nv_bfloat16}, {1,2,3,4}>
// llmgpu:kernel layernorm_forward_fast<float, {1,2,3,4,6}>

// Forward written for bandwidth, the counterpart of layernorm_backward_fast: one warp per row, rows
// gw, gw + nw, ... (gw = global warp id, nw = warps in the grid, the host sizes the grid to the resident
// warps), the row held as raw 16-byte packs (4 registers each, whatever T is: half the registers of
// keeping it as fp32 for 16-bit types), converted on use, and the NEXT row's loads issued before the
// current row is reduced (two rows in flight per warp). The statistics come from the registers in
// two passes (mean, then sum of (x - mean)^2: no cancellation), as in layernorm_forward_warp; x is
// read from DRAM once. gamma/beta are re-read per row through L1 (3 KB, always resident).
// y may be x itself (out=x): each element is loaded by the lane that later stores it, before the store.
template <typename T, int P>
__global__ void __launch_bounds__(256) layernorm_forward_fast(const T* x, const T* __restrict__ gamma,
                                                              const T* __restrict__ beta, T* y,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int N, int C, float eps) {
    constexpr int W = 16 / (int)sizeof(T);
    using Pack = Packed<T, W>;
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int nvec = C / W;  // the host guarantees C % W == 0 and nvec <= 32 * P
    const float inv_c = 1.0f / (float)C;
    const int nw = gridDim.x * wpb;
    int row = blockIdx.x * wpb + (threadIdx.x >> 5);

    Pack cx[P];
    if (row < N) {
        const long long off = (long long)row * C + lane * W;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) cx[p] = load_raw16_stream(x + off + 32 * W * p);
        }
    }
    for (; row < N; row += nw) {
        const int nxt = row + nw;
        Pack nx[P];
        if (nxt < N) {
            const long long off = (long long)nxt * C + lane * W;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                if (lane + 32 * p < nvec) nx[p] = load_raw16_stream(x + off + 32 * W * p);
            }
        }
        float sum = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
#pragma unroll
                for (int k = 0; k < W; ++k) sum += pack_elem(cx[p], k);
            }
        }
        const float m = warp_sum(sum) * inv_c;
        float ss = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (lane + 32 * p < nvec) {
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    const float d = pack_elem(cx[p], k) - m;
                    ss += d * d;
                }
            }
        }
        const float r = rsqrtf(warp_sum(ss) * inv_c + eps);
        T* yr = y + (long long)row * C + lane * W;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = lane + 32 * p;
            if (j < nvec) {
                const Pack g = *reinterpret_cast<const Pack*>(gamma + j * W);
                const Pack b = *reinterpret_cast<const Pack*>(beta + j * W);
                Pack o;
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    o.v[k] = from_float<T>((pack_elem(cx[p], k) - m) * r * pack_elem(g, k) + pack_elem(b, k));
                }
                *reinterpret_cast<Pack*>(yr + 32 * W * p) = o;
            }
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
#pragma unroll
        for (int p = 0; p < P; ++p) cx[p] = nx[p];
    }
}
