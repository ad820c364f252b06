"""Launch arithmetic: the device's per-SM resources, and the grids, block counts and vector widths
computed from them. Every op sizes its launches here, so one rule is written once.

``SMLimits.for_device()`` reads the resources off the GPU (``cudaGetDeviceProperties``); the
defaults are sm_90's (H100 / H200), used on NumPy and by the GPU-free compile check. This module
imports only ``llmgpu.backend`` and NumPy: the ops, the optimizer and ``llmgpu.perf`` all build on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import backend

# Dynamic shared memory any kernel may use without raising its limit (every CUDA GPU).
SMEM_WITHOUT_OPT_IN = 48 * 1024
VECTOR_BYTES = 16  # the widest load/store a thread issues: uint4 / float4
_UNKNOWN_REGS = 64  # registers assumed for a kernel that does not report its count


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources the occupancy calculation divides up, and the SM count. Defaults: sm_90 (H100 / H200)."""

    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_threads_per_sm: int = 2048  # 64 warps
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # bytes of shared memory blocks can use (228 KiB on sm_90)
    reserved_smem_per_block: int = 1024  # the runtime keeps 1 KiB per block (sm_80 and later)
    smem_per_block_optin: int = 232448  # the most one block may opt in to (227 KiB on sm_90)
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256
    smem_alloc_unit: int = 128
    sub_partitions: int = 4  # register file split over the 4 schedulers (sm_70 and later)
    warp_size: int = 32
    sm_count: int = 132  # H100 SXM / H200
    name: str = "sm_90 defaults"

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @classmethod
    def for_device(cls, xp=None) -> SMLimits:
        """The limits of the current GPU (``cudaGetDeviceProperties``); the sm_90 defaults on NumPy."""
        xp = xp or backend.default_xp()
        if xp is np:
            return cls()
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

        def get(key, default):
            v = props.get(key)
            return int(v) if v else default

        d = cls()
        return cls(regs_per_sm=get("regsPerMultiprocessor", d.regs_per_sm),
                   regs_per_block=get("regsPerBlock", d.regs_per_block),
                   max_threads_per_sm=get("maxThreadsPerMultiProcessor", d.max_threads_per_sm),
                   max_blocks_per_sm=get("maxBlocksPerMultiProcessor", d.max_blocks_per_sm),
                   smem_per_sm=get("sharedMemPerMultiprocessor", d.smem_per_sm),
                   reserved_smem_per_block=get("reservedSharedMemPerBlock", d.reserved_smem_per_block),
                   smem_per_block_optin=get("sharedMemPerBlockOptin", d.smem_per_block_optin),
                   warp_size=get("warpSize", d.warp_size), sm_count=get("multiProcessorCount", d.sm_count),
                   name=f"{name} sm_{props['major']}{props['minor']}")


@functools.cache
def _device_limits(device_id: int) -> SMLimits:
    return SMLimits.for_device(backend.cupy_module())


def device_limits(xp=None) -> SMLimits:
    """``SMLimits.for_device`` of the current GPU, read once per device (the sm_90 defaults on NumPy)."""
    xp = xp or backend.default_xp()
    if xp is np:
        return SMLimits()
    return _device_limits(int(xp.cuda.Device().id))


# --------------------------------------------------------------------------- alignment and vector width


def is_aligned(nbytes: int, *arrays) -> bool:
    """Whether every array (CuPy, or anything with ``.data.ptr``; None skipped) starts on a multiple
    of ``nbytes``."""
    return all(a.data.ptr % nbytes == 0 for a in arrays if a is not None)


def elements_aligned(n: int, *arrays) -> bool:
    """Whether every array (None skipped) starts on a multiple of ``n`` of its own elements: what an
    ``n``-wide vector access needs (e.g. float4 for fp32, 4 x 16 bits for fp16/bf16)."""
    return all(is_aligned(n * a.dtype.itemsize, a) for a in arrays if a is not None)


def vector_width(dtype, c, *arrays) -> int:
    """Elements per 16-byte access for rows of ``c`` elements of ``dtype``, or 1 when ``c`` is not a
    multiple of it or a pointer of ``arrays`` is not 16-byte aligned: the vectorized kernels'
    scalar fallback."""
    w = VECTOR_BYTES // np.dtype(dtype).itemsize
    if c % w or not is_aligned(VECTOR_BYTES, *arrays):
        return 1
    return w


# --------------------------------------------------------------------------- resident blocks and grids


def kernel_registers(kernel) -> int:
    """Registers per thread of a compiled kernel (``num_regs``); 64 when it does not say."""
    try:
        regs = int(kernel.num_regs)
    except Exception:  # a stand-in without attributes, or a driver that refuses the query
        return _UNKNOWN_REGS
    return regs or _UNKNOWN_REGS


def blocks_per_sm(regs: int, threads: int, smem_bytes: int = 0, limits: SMLimits | None = None) -> int:
    """Blocks of ``threads`` threads that fit on one SM at once (at least 1): the smallest of the
    register limit (per warp, in allocation units), the thread limit, the shared-memory limit (with
    the per-block reservation) and the block limit."""
    lim = limits or SMLimits()
    warps = -(-threads // lim.warp_size)
    regs_per_warp = -(-max(regs, 1) * lim.warp_size // lim.reg_alloc_unit) * lim.reg_alloc_unit
    by_regs = lim.regs_per_sm // (regs_per_warp * warps)
    by_threads = lim.max_threads_per_sm // threads
    by_smem = lim.smem_per_sm // (smem_bytes + lim.reserved_smem_per_block) if smem_bytes else lim.max_blocks_per_sm
    return max(1, min(by_regs, by_threads, by_smem, lim.max_blocks_per_sm))


def resident_blocks(kernel, threads: int, smem_bytes: int = 0, xp=None, *, limits: SMLimits | None = None) -> int:
    """Blocks that fill the GPU once: SMs x ``blocks_per_sm`` for the kernel's registers."""
    lim = limits or device_limits(xp)
    return lim.sm_count * blocks_per_sm(kernel_registers(kernel), threads, smem_bytes, lim)


def resident_grid(kernel, n_items: int, threads: int, xp=None, *, limits: SMLimits | None = None) -> int:
    """Blocks for a grid-stride loop over ``n_items`` thread-work items: one full wave of resident blocks
    (from the kernel's register count and the SM's limits), fewer when there is less work."""
    return max(1, min(-(-max(n_items, 1) // threads), resident_blocks(kernel, threads, 0, xp, limits=limits)))


def stride_grid(n_items: int, threads: int, xp=None, *, per_sm: int = 8, limits: SMLimits | None = None) -> int:
    """Blocks for a grid-stride loop that needs no register count: ``per_sm`` blocks per SM, fewer when
    there is less work than that."""
    lim = limits or device_limits(xp)
    return max(1, min(-(-n_items // threads), per_sm * lim.sm_count))


def persistent_grid(kernel, n_rows: int, threads: int, smem_bytes: int = 0, xp=None, *,
                    limits: SMLimits | None = None) -> int:
    """Blocks for warps that each own a run of rows (one warp per row at a time): as many rows per
    warp as one wave of resident warps needs, then as few blocks as give every warp that many, so
    all warps finish together (and a per-block second stage has fewer partial rows to add)."""
    lim = limits or device_limits(xp)
    warps = threads // lim.warp_size
    resident = resident_blocks(kernel, threads, smem_bytes, xp, limits=lim)
    rows_per_warp = -(-n_rows // (resident * warps))
    return -(-n_rows // (warps * rows_per_warp))


_OPTED_IN: dict = {}  # id(kernel) -> (kernel, the dynamic shared memory it was opted in to); the kernel is held so
# that its id is not reused (get_kernel's kernels live for the process anyway)


def opt_in_shared_memory(kernel, nbytes: int, xp=None, *, limits: SMLimits | None = None) -> bool:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory; False when the device does not allow that
    much per block (or refuses). Up to ``SMEM_WITHOUT_OPT_IN`` nothing is needed; above it the kernel's limit is
    raised once and remembered: asking again for no more than that costs a dictionary lookup, and the limit is
    never lowered (a smaller launch fits under it)."""
    if nbytes <= max(SMEM_WITHOUT_OPT_IN, _OPTED_IN.get(id(kernel), (None, 0))[1]):
        return True
    lim = limits or device_limits(xp)
    if nbytes > lim.smem_per_block_optin:
        return False
    try:
        kernel.max_dynamic_shared_size_bytes = nbytes
    except Exception:
        return False
    _OPTED_IN[id(kernel)] = (kernel, nbytes)
    return True


__all__ = [
    "SMEM_WITHOUT_OPT_IN",
    "SMLimits",
    "blocks_per_sm",
    "device_limits",
    "elements_aligned",
    "is_aligned",
    "kernel_registers",
    "opt_in_shared_memory",
    "persistent_grid",
    "resident_blocks",
    "resident_grid",
    "stride_grid",
    "vector_width",
]
