// swiglu.cu: SwiGLU, the gated MLP activation of Llama (Shazeer, "GLU Variants Improve Transformer").
//
//   silu(a) = a * sigmoid(a) = a / (1 + exp(-a))
//   h       = silu(gate) * up
//   backward, s = sigmoid(gate):
//     dgate = dh * up * s * (1 + gate * (1 - s))       (d silu / da = s + a s (1 - s))
//     dup   = dh * silu(gate)
//
// Elementwise and memory-bound: the forward moves 3 values per element (gate, up in; h out), the
// backward 5 (dh, gate, up in; dgate, dup out). One fused pass each, shaped as gelu.cu's fast kernels:
// every thread takes UNROLL = 2 packs of 16 bytes per array (W = 4 fp32, 8 fp16/bf16), issues all
// its loads before any arithmetic, and the grid covers the array once. VEC = 0 is the scalar
// fallback the host picks when a pointer is not 16-byte aligned (packs of one element). With VEC = 1
// the last n % W elements (the tail) go one per thread to the first threads of the grid.
//
// Layout: ROWS = 0, every array contiguous, element e at e. ROWS = 1, [n / cols, cols] row views, each
// array with its own row stride (ld_*, elements): element e at (e / cols) * ld + e % cols. That is how
// the fast Llama step reads gate = gu[:, :F] and up = gu[:, F:] of its fused gate|up GEMM's output
// gu [N, 2F] (ld = 2F) and writes dgate, dup back over them. With ROWS = 1 the host picks VEC = 1 only
// when cols and every ld are multiples of W (a pack never straddles two rows; there is no tail).
//
// The arithmetic is PyTorch's F.silu (aten/src/ATen/native/cuda/ActivationSiluKernel.cu): a / (1 + e)
// with e = expf(-a) (accurate expf, IEEE division), and its backward s (1 + a (1 - s)), here with
// 1 - s written e s (no cancellation where s is close to 1). Non-finite input, the same as PyTorch and
// the NumPy reference: NaN gives NaN; silu(+inf) = +inf; silu(-inf) = -inf / inf = NaN; every finite
// a gives a finite silu (a < ~-88: e = inf, silu = -0) and a finite derivative; silu'(+-inf) = NaN
// (inf * 0, and 0 * -inf). h, dgate, dup are products, so inf * 0 there is NaN too (IEEE).
//
// In place: h may be gate or up, dgate and dup may be any input (the host refuses partial overlaps).
// Each element is read and written by one thread, all its loads before its stores, so no pointer is
// __restrict__.
#include "common.cuh"

// llmgpu:kernel swiglu_forward<{float,__half,__nv_bfloat16}, {0,1}, {0,1}>
// llmgpu:kernel swiglu_backward<{float,__half,__nv_bfloat16}, {0,1}, {0,1}>

#define SWIGLU_THREADS 256
#define SWIGLU_UNROLL 2

__device__ __forceinline__ float silu_value(float a) {
    return a / (1.0f + expf(-a));
}

// d silu / da; also silu(a) itself (dup needs it), from the same exponential.
// a = -inf: e = inf, s = 0, e s = NaN, which fminf turns into 1: 0 * (1 - inf) = NaN, as PyTorch's
// (1 - s) gives. Finite a < ~-88: s = 0 and the same 1 gives s (1 + a) = -0, finite.
__device__ __forceinline__ float silu_grad(float a, float& silu) {
    const float e = expf(-a);
    const float d = 1.0f + e;
    const float s = 1.0f / d;
    silu = a / d;
    return s * (1.0f + a * fminf(e * s, 1.0f));
}

// Where element e of one array lies: e itself (ROWS = 0), or row e / cols, column e % cols of rows ld
// apart. The row and column are computed once per pack, kept from the loads to the stores, and reused
// by every array.
template <int ROWS>
struct RowIndex {
    long long row, col;
    RowIndex() = default;
    __device__ __forceinline__ RowIndex(long long e, long long cols, bool narrow) {
        if constexpr (ROWS) {
            row = index_div(e, cols, narrow);
            col = e - row * cols;
        } else {
            row = 0;
            col = e;
        }
    }
    __device__ __forceinline__ long long at(long long ld) const { return ROWS ? row * ld + col : col; }
};

// Grid: ceil(n_packs / (THREADS * UNROLL)) blocks of THREADS threads (at least 1). ld_*: unused when ROWS = 0.
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(SWIGLU_THREADS) swiglu_forward(const T* gate, const T* up, T* h, long long n,
                                                                 long long cols, long long ld_gate,
                                                                 long long ld_up, long long ld_h) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = SWIGLU_UNROLL;
    const long long nvec = n / W;
    const bool narrow = n <= 0xffffffffLL;  // every element index fits 32 bits: cheaper divisions
    const long long j0 = (long long)blockIdx.x * (SWIGLU_THREADS * U) + threadIdx.x;
    float a[U][W], u[U][W];
    RowIndex<ROWS> p[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {  // all loads first: 2 * U * 16 bytes in flight per thread
        const long long j = j0 + k * SWIGLU_THREADS;
        if (j < nvec) {
            p[k] = RowIndex<ROWS>(j * W, cols, narrow);
            load_pack16<T, W>(gate + p[k].at(ld_gate), a[k]);
            load_pack16<T, W>(up + p[k].at(ld_up), u[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * SWIGLU_THREADS;
        if (j < nvec) {
#pragma unroll
            for (int i = 0; i < W; ++i) a[k][i] = silu_value(a[k][i]) * u[k][i];
            store_pack16<T, W>(h + p[k].at(ld_h), a[k]);
        }
    }
    const long long i = nvec * W + (long long)blockIdx.x * SWIGLU_THREADS + threadIdx.x;  // W == 1: i >= n
    if (i < n) {
        const RowIndex<ROWS> q(i, cols, narrow);
        h[q.at(ld_h)] = from_float<T>(silu_value(to_float(gate[q.at(ld_gate)])) * to_float(up[q.at(ld_up)]));
    }
}

// Same shape; three inputs, two outputs.
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(SWIGLU_THREADS) swiglu_backward(const T* dh, const T* gate, const T* up,
                                                                  T* dgate, T* dup, long long n, long long cols,
                                                                  long long ld_dh, long long ld_gate,
                                                                  long long ld_up, long long ld_dgate,
                                                                  long long ld_dup) {
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;
    constexpr int U = SWIGLU_UNROLL;
    const long long nvec = n / W;
    const bool narrow = n <= 0xffffffffLL;  // every element index fits 32 bits: cheaper divisions
    const long long j0 = (long long)blockIdx.x * (SWIGLU_THREADS * U) + threadIdx.x;
    float d[U][W], a[U][W], u[U][W];
    RowIndex<ROWS> p[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * SWIGLU_THREADS;
        if (j < nvec) {
            p[k] = RowIndex<ROWS>(j * W, cols, narrow);
            load_pack16<T, W>(dh + p[k].at(ld_dh), d[k]);
            load_pack16<T, W>(gate + p[k].at(ld_gate), a[k]);
            load_pack16<T, W>(up + p[k].at(ld_up), u[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long j = j0 + k * SWIGLU_THREADS;
        if (j < nvec) {
#pragma unroll
            for (int i = 0; i < W; ++i) {
                float silu;
                const float g = silu_grad(a[k][i], silu);
                a[k][i] = d[k][i] * u[k][i] * g;  // dgate
                u[k][i] = d[k][i] * silu;         // dup
            }
            store_pack16<T, W>(dgate + p[k].at(ld_dgate), a[k]);
            store_pack16<T, W>(dup + p[k].at(ld_dup), u[k]);
        }
    }
    const long long i = nvec * W + (long long)blockIdx.x * SWIGLU_THREADS + threadIdx.x;
    if (i < n) {
        const RowIndex<ROWS> q(i, cols, narrow);
        const float dv = to_float(dh[q.at(ld_dh)]), uv = to_float(up[q.at(ld_up)]);
        float silu;
        const float g = silu_grad(to_float(gate[q.at(ld_gate)]), silu);
        dgate[q.at(ld_dgate)] = from_float<T>(dv * uv * g);
        dup[q.at(ld_dup)] = from_float<T>(dv * silu);
    }
}
