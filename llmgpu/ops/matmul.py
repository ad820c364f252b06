"""Matrix product C = A @ B, four ways: the introduction's climb from naive to cuBLAS.

``method`` picks the implementation on CuPy arrays (all fp32, row-major):

* ``"naive"``   one thread per output element (``matmul_naive``)
* ``"tiled"``   shared-memory tiles of 32 × 32 (``matmul_tiled<32>``; ``"tiled16"`` for 16 × 16)
* ``"blocked"`` 64 × 64 block tiles, 4 × 4 outputs per thread (``matmul_blocked<64, 64, 16, 4, 4>``)
* ``"blocked8"`` 128 × 128 block tiles, 8 × 8 outputs per thread (``matmul_blocked<128, 128, 8, 8, 8>``)
* ``"cublas"``  the vendor library through CuPy (``cupy.matmul``, fp32, no TF32)

On NumPy arrays every method computes the same product with NumPy (the reference).
"""

from __future__ import annotations

import numpy as np

from ..checks import array_module, check_array, check_method, check_out
from ..kernels import get_kernel

METHODS = ("naive", "tiled16", "tiled", "blocked", "blocked8", "cublas")
_BLOCKED = {"blocked": (64, 64, 16, 4, 4), "blocked8": (128, 128, 8, 8, 8)}


def matmul(a, b, method="blocked", out=None):
    """C[M, N] = A[M, K] @ B[K, N] for fp32 row-major matrices."""
    check_method("matmul", method, METHODS)
    xp = array_module(a=a, b=b)
    check_array("a", a, ndim=2, dtype=np.float32)
    check_array("b", b, ndim=2, dtype=np.float32)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {m}x{k}, b is {k2}x{n}")
    if xp is np or method == "cublas":
        res = xp.matmul(a, b)
        if out is None:
            return res
        check_out(out, (m, n), np.float32, xp)[...] = res
        return out
    if max(m, n, k) >= 2**31:
        raise ValueError("matrix dimensions must be below 2**31")
    out = check_out(out, (m, n), np.float32, xp)
    args = (a, b, out, np.int32(m), np.int32(n), np.int32(k))
    if method == "naive":
        block = (32, 8)
        grid = (-(-n // 32), -(-m // 8))
        get_kernel("matmul", "matmul_naive")(grid, block, args)
    elif method in ("tiled", "tiled16"):
        tile = 16 if method == "tiled16" else 32
        grid = (-(-n // tile), -(-m // tile))
        get_kernel("matmul", "matmul_tiled", tile)(grid, (tile, tile), args)
    else:  # register-blocked: 16 x 16 threads, each owning a TM x TN patch
        bm, bn, *_ = cfg = _BLOCKED[method]
        grid = (-(-n // bn), -(-m // bm))
        get_kernel("matmul", "matmul_blocked", *cfg)(grid, (256,), args)
    return out


def matmul_flops(m: int, n: int, k: int) -> float:
    """Floating-point operations of an M×K by K×N product: one multiply and one add per term."""
    return 2.0 * m * n * k


__all__ = ["METHODS", "matmul", "matmul_flops"]
