// fp8_cast_transpose_regs.cu: the FP8 step's transposing casts (delayed scaling: one pass) with the transpose done in
// registers instead of through a shared-memory tile (issue 37), checked and timed against llmgpu/kernels/fp8.cu's
// shared-tile fp8_cast_transpose_kernel by fp8_cast_transpose_regs.py.
//
// Each thread owns an 8 x 8 block of x: eight 16-byte loads (one per row, all issued before any is used), the cast
// of its 64 values, eight 8-byte stores of y, a byte transpose of the 8 x 8 bytes in registers (__byte_perm), and
// eight 8-byte stores of y^T. A warp's lanes are 4 row groups x 8 column groups, so a warp covers 32 rows x 64
// columns: each load instruction reads four whole 128-byte lines, each y store two whole 32-byte sectors per row,
// each y^T store (4 lanes, 32 consecutive rows of one column) one whole sector. No shared tile, no barrier before
// the stores; only the amax and the column sums (a bias gradient's tile share) reduce across the block at the end.
// The block's 8 warps stack in rows: a block tile is 256 rows x 64 columns (fp8_column_sums_kernel adds the
// blocks' partial sums in blockIdx.x order, as it does the package's 64-row tiles).
//
// The hypothesis, as written before a GPU ran it: the package's cast keeps four 8-byte loads in flight per thread
// and moves the bytes twice through shared memory byte by byte; on an H100 at d36 its three step casts run at
// 58-66 % of the copy rate (chapter 5b's profile). Sixteen times the bytes in flight per thread and no shared tile
// should reach 80-90 %, saving 4-6 ms of the d36 FP8 step's ~141 ms on an H100.
//
// The kernel was written here first; the package took it as fp8_cast_transpose_8x8_kernel, so this file keeps only
// the launch-bounds sweep that chose its MIN_BLOCKS (the kernel's last template parameter, resident blocks per SM
// asked of ptxas): 2 for every cast (at most 128 registers; without a bound ptxas gives the plain cast 185, and at
// 3 it spills) and 3 for the GELU casts.
#include "fp8.cu"

// llmgpu:kernel fp8_cast_transpose_8x8_kernel<__nv_bfloat16, {__NV_E4M3,__NV_E5M2}, {0,1,2}, {0,1}, 2>
// llmgpu:kernel fp8_cast_transpose_8x8_kernel<__nv_bfloat16, {__NV_E4M3,__NV_E5M2}, {1,2}, {0,1}, 3>
