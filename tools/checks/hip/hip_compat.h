// Force-included before every kernel source by tools/checks/hip_compile_check.py (hipcc -include).
//
// What it maps, and what that means on an AMD GPU:
// * CUDA's *_sync warp shuffles -> HIP's shuffles with width 32. A gfx90a wavefront has 64 lanes;
//   width 32 makes each half a group of 32 for the shuffle, which is what our kernels' warp
//   reductions assume (warp = 32 threads, lane = threadIdx.x & 31). The mask is dropped: HIP 5.2 has
//   no masked shuffles. Kernels that need more than shuffles from a warp (__match_any_sync,
//   __syncwarp with a mask, inline PTX) do not compile here, and that is the point of the check.
#pragma once
#include <hip/hip_runtime.h>

#define __shfl_sync(mask, v, lane) __shfl((v), (lane), 32)
#define __shfl_xor_sync(mask, v, m) __shfl_xor((v), (m), 32)
#define __shfl_up_sync(mask, v, d) __shfl_up((v), (d), 32)
#define __shfl_down_sync(mask, v, d) __shfl_down((v), (d), 32)
