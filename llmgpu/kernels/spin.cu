// spin.cu: keep the GPU busy for a given wall-clock time (chapters 7 and 8).
//
// A tool for experiments about asynchrony, not a compute kernel: one thread reads the GPU's global
// nanosecond timer (%globaltimer) until the requested time has passed, sleeping between reads so it
// does not hog its SM. Queued before a training step, it tells whether the step waits for the GPU:
// if the host returns from the step while the spin kernel is still running, nothing in the step
// synchronized.
//
// NVIDIA-only (inline PTX %globaltimer, __nanosleep): tools/checks/hip_compile_check.py lists it as such.
#include "common.cuh"

// llmgpu:kernel gpu_spin

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void gpu_spin(unsigned long long ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned long long start = global_ns();
    while (global_ns() - start < ns) __nanosleep(1000);
}
