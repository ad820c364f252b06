// dev/cuda/flash_fwd_wgmma.cu: the package's Hopper flash forward (llmgpu/kernels/flash_attention_wgmma.cu) in
// the tile shapes and PIPE settings it does not ship, for flash_fwd_wgmma.py to check and time beside the shipped
// one (issue 16; flash_wgmma_plan.md says what ran). The package's kernels directory is on the include path.
#include "flash_attention_wgmma.cu"

// llmgpu:kernel flash_fwd_wgmma<{__half,__nv_bfloat16}, {64,128}, {0,1}, 64, 2>
// The larger tiles, bf16 only, without the configurations that spill (PIPE = 1 at D = 128 with 3 warpgroups or
// 128 keys, PIPE = 1 at D = 64 with both):
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 64, {0,1}, {64,128}, 1>
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 64, {0,1}, 64, 3>
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 64, {0,1}, 128, 2>
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 64, 0, 128, 3>
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 128, 0, 64, 3>
// llmgpu:kernel flash_fwd_wgmma<__nv_bfloat16, 128, 0, 128, 2>
