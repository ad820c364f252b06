// layernorm.cuh: the row statistics of the one-warp-per-row LayerNorm forwards, shared by layernorm.cu
// (layernorm_forward_warp; add_layernorm_forward_warp writes y in the storage type) and fp8.cu
// (fp8_add_layernorm_kernel writes y as FP8 bytes): the variance of a kept row, and the first half of the fused
// residual add + LayerNorm. Needs common.cuh first.
#pragma once

// The rstd of a row that a warp keeps in registers (lane l holds packs j = l, l + 32, ...; P packs of W values),
// given its mean m: the second pass of the two-pass variance, over the kept values (no cancellation).
template <int P, int W>
__device__ __forceinline__ float kept_row_rstd(const float (&v)[P][W], float m, int lane, int nvec, int C, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (lane + 32 * p < nvec) {
#pragma unroll
            for (int k = 0; k < W; ++k) {
                const float d = v[p][k] - m;
                ss += d * d;
            }
        }
    }
    return rsqrtf(warp_sum(ss) / (float)C + eps);
}

// s = a + b for one row (offset `off`, C = nvec * W elements, W = 16 / sizeof(T)), rounded to T and written to s;
// the rounded row kept in registers as fp32 v (lane l holds packs j = l, l + 32, ...; 0 past the row's end), and
// its mean m and rstd r (two-pass variance from v: no cancellation). s may alias a or b: every pack of a and b is
// loaded before any of s is stored, and only this lane touches those addresses (a, b, s are not __restrict__).
template <typename T, int P>
__device__ __forceinline__ void add_layernorm_row(const T* a, const T* b, T* s, long long off, int lane, int nvec,
                                                  int C, float eps, float (&v)[P][16 / sizeof(T)], float& m,
                                                  float& r) {
    constexpr int W = 16 / (int)sizeof(T);
    using Pack = Packed<T, W>;
    Pack ra[P], rb[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j = lane + 32 * p;
        if (j < nvec) {
            ra[p] = *reinterpret_cast<const Pack*>(a + off + j * W);
            rb[p] = *reinterpret_cast<const Pack*>(b + off + j * W);
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int j = lane + 32 * p;
        if (j < nvec) {
            Pack st;
#pragma unroll
            for (int k = 0; k < W; ++k) {
                st.v[k] = from_float<T>(to_float(ra[p].v[k]) + to_float(rb[p].v[k]));
                v[p][k] = to_float(st.v[k]);  // the rounded sum: what the next layer will read
                sum += v[p][k];
            }
            *reinterpret_cast<Pack*>(s + off + j * W) = st;
        } else {
#pragma unroll
            for (int k = 0; k < W; ++k) v[p][k] = 0.0f;
        }
    }
    m = warp_sum(sum) / (float)C;
    r = kept_row_rstd(v, m, lane, nvec, C, eps);
}
