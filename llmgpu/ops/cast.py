"""Casts between fp32, bf16 and fp16 (chapter 5): one vectorized launch, round-to-nearest-even.

The flat parameters of chapter 4 refresh their bf16/fp16 working copy with it after every optimizer
step, and mixed precision (``llmgpu.amp``) builds on it; so it lives here, below both.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import GPU_DTYPES, array_module, check_array, check_out
from ..kernels import get_kernel
from ..kernels.launch import elements_aligned, resident_grid

THREADS = 256
CAST_DTYPES = GPU_DTYPES  # the kernel's types; the NumPy reference takes the same


def _cast_numpy(x, dtype):
    """NumPy reference: 16-bit inputs go through float32 (exact), then one round-to-nearest-even."""
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32, copy=False)
        return x32.astype(dtype)


def cast(x, dtype, out=None):
    """``x`` converted to ``dtype`` ('fp32', 'bf16', 'fp16'), same shape; one vectorized launch on CuPy.

    Rounding is to nearest, ties to even; fp16 overflow gives ±inf; NaN stays NaN. ``out``: optional
    preallocated array of the target dtype and x's shape.
    """
    xp = array_module(x=x, out=out)
    dtype = backend.resolve_dtype(dtype)
    if dtype not in CAST_DTYPES:
        raise TypeError(f"dtype must be fp32, fp16 or bf16, got {dtype}")
    check_array("x", x, dtypes=CAST_DTYPES)
    out = check_out(out, x.shape, dtype, xp)
    if xp is np:
        out[...] = _cast_numpy(x, dtype)
        return out
    n = x.size
    vec = int(elements_aligned(4, x, out))  # groups of 4 elements
    kern = get_kernel("cast", "cast_kernel", x.dtype, dtype)
    kern((resident_grid(kern, -(-n // 8), THREADS, xp),), (THREADS,), (x, out, np.int64(n), np.int32(vec)))
    return out


__all__ = ["CAST_DTYPES", "cast"]
