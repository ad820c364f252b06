"""Launch arithmetic: the per-SM resources of the device, from which grids and block counts are computed,
and the pointer alignment and vector width the vectorized kernels check.

``SMLimits.for_device()`` reads the resources off the GPU (``cudaGetDeviceProperties``); the
defaults are sm_90's (H100 / H200), used on NumPy and by the GPU-free compile check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import backend

VECTOR_BYTES = 16  # the widest load/store a thread issues: uint4 / float4


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources the occupancy calculation divides up. Defaults: sm_90 (H100 / H200)."""

    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_threads_per_sm: int = 2048  # 64 warps
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # bytes of shared memory blocks can use (228 KiB on sm_90)
    reserved_smem_per_block: int = 1024  # the runtime keeps 1 KiB per block (sm_80 and later)
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256
    smem_alloc_unit: int = 128
    sub_partitions: int = 4  # register file split over the 4 schedulers (sm_70 and later)
    warp_size: int = 32
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
                   warp_size=get("warpSize", d.warp_size), name=f"{name} sm_{props['major']}{props['minor']}")



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


def resident_grid(kernel, n_items: int, threads: int, xp=None) -> int:
    """Blocks for a grid-stride loop over ``n_items`` thread-work items: one full wave of resident blocks
    (from the kernel's register count and the SM's limits), fewer when there is less work."""
    lim = device_limits(xp)
    sms = backend.device_info(xp).sm_count or 132
    regs = max(int(getattr(kernel, "num_regs", 64) or 64), 16)
    per_sm = max(1, min(lim.max_threads_per_sm // threads, lim.regs_per_sm // (regs * threads), lim.max_blocks_per_sm))
    return max(1, min(-(-max(n_items, 1) // threads), per_sm * sms))


__all__ = ["VECTOR_BYTES", "SMLimits", "device_limits", "elements_aligned", "is_aligned", "resident_grid",
           "vector_width"]
