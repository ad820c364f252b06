// HIP stand-in for <cuda_fp16.h> (tools/checks/hip_compile_check.py): HIP's fp16 API has CUDA's names.
#pragma once
#include <hip/hip_fp16.h>
