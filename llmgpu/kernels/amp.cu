// amp.cu: the dynamic loss scaler's bookkeeping, on the device (chapter 5).
//
// After each backward pass the scaler learns whether the fp16 gradients overflowed (found_inf, from
// grad_norm.cu). The rule is PyTorch's GradScaler:
//     overflow:   scale *= backoff_factor, good_steps = 0            (the step is skipped)
//     otherwise:  good_steps += 1; after growth_interval clean steps in a row
//                 scale *= growth_factor (if still finite), good_steps = 0
// Doing it in one thread of a tiny kernel instead of on the host means the step never waits for the
// GPU to say whether it overflowed; the next step simply reads the new scale from device memory.
// inv_scale (1/scale) is kept next to it: it is the factor that unscales the gradients.
#include "common.cuh"

// llmgpu:kernel scaler_update

extern "C" __global__ void scaler_update(float* scale, float* inv_scale, int* good_steps, const float* found_inf,
                                         float growth_factor, float backoff_factor, int growth_interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float s = scale[0];
    int good = good_steps[0];
    if (found_inf[0] != 0.0f) {
        s *= backoff_factor;
        good = 0;
    } else {
        good += 1;
        if (good >= growth_interval) {
            const float grown = s * growth_factor;
            if ((__float_as_uint(grown) & 0x7f800000u) != 0x7f800000u) s = grown;  // stay finite
            good = 0;
        }
    }
    scale[0] = s;
    inv_scale[0] = 1.0f / s;
    good_steps[0] = good;
}
