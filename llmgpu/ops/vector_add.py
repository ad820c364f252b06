"""Vector add, c = a + b: the first kernel of the introduction (``kernels/vector_add.cu``)."""

from __future__ import annotations

import numpy as np

from ..checks import array_module, check_array, check_out, check_same_dtype
from ..kernels import get_kernel
from ..kernels.launch import stride_grid

THREADS = 256


def vector_add(a, b, out=None):
    """Elementwise sum of two 1-D arrays of the same dtype (fp32, fp16 or bf16)."""
    xp = array_module(a=a, b=b)
    check_array("a", a, ndim=1)
    check_array("b", b, shape=a.shape)
    check_same_dtype(a=a, b=b)
    if xp is np:
        res = (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)
        if out is None:
            return res
        check_out(out, a.shape, a.dtype, xp)[...] = res
        return out
    out = check_out(out, a.shape, a.dtype, xp)
    n = a.size
    # A grid-stride loop needs only enough blocks to fill the GPU: 8 per SM of 256 threads each.
    blocks = stride_grid(n, THREADS, xp, per_sm=8)
    get_kernel("vector_add", "vector_add", a.dtype)((blocks,), (THREADS,), (a, b, out, np.int64(n)))
    return out
