// gelu.cuh: the fast GELU of gelu.cu (tanh approximation, sigmoid form) as device functions, shared by
// the kernels that apply GELU or its derivative on the fly (gelu.cu; fp8.cu casts GELU's output and the
// pre-activation's gradient straight to FP8). Needs common.cuh (fast_exp2) first.
#pragma once
//
// The fast form does the same math in a few instructions per element, without branches:
//   z = -2u log2(e) = x (A + B x^2)                 A = -2 sqrt(2/pi) log2(e), B = 0.044715 A
//   e = 2^z   (ex2.approx.ftz: one MUFU.EX2, ~2 ulp)
//   s = 1 / (1 + e)   (rcp.approx.ftz: one MUFU.RCP, ~1 ulp)   y = x s
// Accuracy: 2 + 1 ulp from the two MUFU ops, and the error of z (a few ulp of |z|) that any float32
// evaluation has: exp amplifies it by |z| ln 2 where GELU is tiny (x ~ -8: ~1e-5 relative; the same
// for expf). The tests check < 5e-6 relative on [-3, 3] against float64. Extremes, no NaN for
// finite x: x < ~-10: e = inf (or 1 + e > 2^126, whose rcp.approx.ftz flushes to 0), s = 0, y = -0;
// x > ~5: 1 + e rounds to 1 and s = 1 exactly (selected, not rcp(1), so y == x bit for bit: MUFU.RCP
// is only promised within 1 ulp). x = -inf gives NaN (-inf * 0), as the tanh formula does.

#define GELU_FAST_A -2.302208198144325f    // -2 sqrt(2/pi) / ln 2
#define GELU_FAST_B -0.1029432395800235f   // 0.044715 * GELU_FAST_A
#define GELU_FAST_C1 1.5957691216057308f   // 2u' = C1 + C2 x^2 = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)
#define GELU_FAST_C2 0.21406444881780076f

__device__ __forceinline__ float gelu_rcp(float d) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    return __builtin_amdgcn_rcpf(d);  // v_rcp_f32, AMD's approximate reciprocal (HIP compile check)
#else
    float r;  // NVIDIA-only fast path (inline PTX)
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
#endif
}

// s = sigmoid(2u) = 1 / (1 + e), e = 2^z = exp(-2u).
__device__ __forceinline__ float gelu_fast_sigmoid(float x, float x2, float& e) {
    e = fast_exp2(x * fmaf(GELU_FAST_B, x2, GELU_FAST_A));
    const float d = 1.0f + e;
    return d == 1.0f ? 1.0f : gelu_rcp(d);  // no branch: a predicated MUFU.RCP in SASS
}

__device__ __forceinline__ float gelu_fast_value(float x) {
    float e;
    return x * gelu_fast_sigmoid(x, x * x, e);
}

// dy/dx = s + x 2u' s (1 - s) = s + (s x (1 - s)) 2u',  1 - s = e s  (no cancellation for x > 0,
// where 1 - s is tiny). Degenerate ends: e = inf gives s = 0 and e s = NaN, which fminf turns into 1;
// at either saturated end s x (1 - s) is exactly 0 for finite x (g = s: 0 or 1), and x^2 is clamped
// in 2u' so that 0 * 2u' stays 0 when x^2 overflows. For x = +-inf, s x (1 - s) is inf * 0 = NaN:
// g = NaN, as the other kernels and the reference give (gelu_grad). A NaN x gives NaN through s.
__device__ __forceinline__ float gelu_fast_grad(float x) {
    const float x2 = x * x;
    float e;
    const float s = gelu_fast_sigmoid(x, x2, e);
    const float one_minus_s = fminf(e * s, 1.0f);
    const float sxo = s * (x * one_minus_s);
    return fmaf(sxo, fmaf(GELU_FAST_C2, fminf(x2, 1e30f), GELU_FAST_C1), s);
}
