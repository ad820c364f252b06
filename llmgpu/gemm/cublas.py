"""Row-major GEMMs through cuBLAS, fp32 accumulation, without transposing copies.

cuBLAS speaks column-major (Fortran): an M × N matrix with leading dimension ``ld`` keeps element
(i, j) at ``i + j * ld``. Our arrays are row-major (C): element (i, j) at ``i * N + j``. The same
bytes read column-major are the *transpose*. So instead of copying, we use the identity

    C = op(A) @ op(B)   ⟺   Cᵀ = op(B)ᵀ @ op(A)ᵀ

and ask cuBLAS for Cᵀ (which, written column-major, *is* C row-major): swap the operands, swap M and
N, and pass each array's row length as its leading dimension. No data moves; only the roles change.
(Chapter 1 shows the wrong call too: passing leading dimensions that only fit column-major data.)

Every call computes in fp32 (``CUBLAS_COMPUTE_32F``) whatever the storage type: fp32, fp16 or bf16
inputs; fp32 storage runs true fp32, not TF32.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_gpu_dtype

# cudaDataType and cublasComputeType_t values (library_types.h, cublas_api.h)
CUDA_DATA_TYPES = {backend.float32: 0, backend.float16: 2, backend.bfloat16: 14}  # cudaDataType per storage dtype
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_OP = {False: 0, True: 1}  # CUBLAS_OP_N, CUBLAS_OP_T


_SCALAR_PTRS: dict = {}  # alpha/beta value -> (fp32 host array kept alive, its address)


def scalar_ptr(x) -> int:
    """Host address of an fp32 copy of ``x``: cuBLAS and cuBLASLt read alpha/beta through host pointers.

    ``ndarray.ctypes.data`` costs microseconds per access, so the usual values are cached; past the
    cache, the last 64 arrays are kept alive (the value is read when the call is enqueued).
    """
    hit = _SCALAR_PTRS.get(x)
    if hit is None:
        arr = np.array([x], dtype=np.float32)
        hit = (arr, int(arr.ctypes.data))
        if len(_SCALAR_PTRS) < 1024:
            _SCALAR_PTRS[x] = hit
        else:
            _SCALAR_PTRS.setdefault("overflow", []).append(hit)
            del _SCALAR_PTRS["overflow"][:-64]
    return hit[1]


_cublas = None


def _cublas_module():
    global _cublas
    if _cublas is None:
        from cupy.cuda import cublas

        _cublas = cublas
    return _cublas


def _mk(a, trans):
    """(rows, cols) of op(a) over the last two axes."""
    r, c = a.shape[-2], a.shape[-1]
    return (c, r) if trans else (r, c)


def check_operands(a, b, trans_a, trans_b, xp, op="gemm"):
    """Validate the operands of ``op(a) @ op(b)`` and return ``(m, n, k, batch)``.

    Shared by :func:`gemm` and :func:`llmgpu.gemm.cublaslt.lt_gemm`: same layouts, dtypes and batching rules.
    """
    check_array("a", a)
    check_array("b", b)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"{op} needs matrices: a has shape {tuple(a.shape)}, b has shape {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if xp is not np:
        check_gpu_dtype("a", a, tuple(CUDA_DATA_TYPES))  # check_array let fp64 through for NumPy
    m, k = _mk(a, trans_a)
    k2, n = _mk(b, trans_b)
    if k != k2:
        raise ValueError(f"inner dimensions differ: op(a) is {m}x{k}, op(b) is {k2}x{n}")
    batch = a.shape[:-2]
    if b.ndim > 2 and b.shape[:-2] != batch:
        raise ValueError(f"batch shapes differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return m, n, k, batch


def prepare_out(out, shape, in_dtype, xp, *, beta=0.0, out_dtype=None):
    """The output buffer: a new one (``out_dtype``, default the input dtype) or the caller's, checked.

    ``out`` may hold the input dtype or fp32 (fp64 too on NumPy); ``beta != 0`` accumulates into it,
    so then it must be given.
    """
    if out is None:
        if beta != 0.0:
            raise ValueError("beta != 0 accumulates into out, so out must be given")
        return xp.empty(shape, dtype=backend.resolve_dtype(out_dtype) if out_dtype else in_dtype)
    check_array("out", out, shape=shape)
    allowed = (in_dtype, backend.float32) + ((backend.float64,) if xp is np else ())
    if out.dtype not in allowed:
        raise TypeError(f"out must be {backend.dtype_name(in_dtype)} or fp32, got {out.dtype}")
    return out


def gemm(a, b, *, trans_a=False, trans_b=False, out=None, alpha=1.0, beta=0.0, out_dtype=None):
    """``out = alpha · op(a) @ op(b) + beta · out`` for row-major arrays, fp32 accumulation.

    ``a`` is [..., M, K] (or [..., K, M] with ``trans_a``), ``b`` is [..., K, N] (or [..., N, K]).
    Leading (batch) axes must match, or ``b`` may be 2-D and shared by every batch entry.
    ``out`` defaults to a new array of ``out_dtype`` (default: the input dtype); with ``beta != 0``
    it must be given and is accumulated into (how weight gradients add up across micro-batches).
    """
    xp = array_module(a=a, b=b, out=out)
    m, n, k, batch = check_operands(a, b, trans_a, trans_b, xp)
    out = prepare_out(out, (*batch, m, n), a.dtype, xp, beta=beta, out_dtype=out_dtype)

    if xp is np:
        return _gemm_numpy(a, b, trans_a, trans_b, out, alpha, beta)

    cublas = _cublas_module()
    handle = xp.cuda.device.get_cublas_handle()
    alpha_p, beta_p = scalar_ptr(alpha), scalar_ptr(beta)
    count = math.prod(batch)
    dt_in, dt_out = CUDA_DATA_TYPES[a.dtype], CUDA_DATA_TYPES[out.dtype]
    # The identity above: cuBLAS computes Cᵀ[n, m] = op(b)ᵀ op(a)ᵀ, column-major.
    args_b = (b.data.ptr, dt_in, b.shape[-1], (k * n) if b.ndim > 2 else 0)
    args_a = (a.data.ptr, dt_in, a.shape[-1], m * k)
    if count == 1:
        cublas.gemmEx(
            handle, _OP[trans_b], _OP[trans_a], n, m, k, alpha_p,
            *args_b[:3], *args_a[:3], beta_p,
            out.data.ptr, dt_out, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    else:
        cublas.gemmStridedBatchedEx(
            handle, _OP[trans_b], _OP[trans_a], n, m, k, alpha_p,
            *args_b, *args_a, beta_p,
            out.data.ptr, dt_out, n, m * n, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
    return out


def _gemm_numpy(a, b, trans_a, trans_b, out, alpha, beta):
    """Reference: the same product in float32 (float64 stays float64)."""
    acc = np.float64 if a.dtype == np.float64 else np.float32
    A = a.astype(acc, copy=False)
    B = b.astype(acc, copy=False)
    A = np.swapaxes(A, -1, -2) if trans_a else A
    B = np.swapaxes(B, -1, -2) if trans_b else B
    res = alpha * np.matmul(A, B)
    if beta != 0.0:
        res = res + beta * out.astype(acc)
    out[...] = res.astype(out.dtype)
    return out


def gemm_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    return 2.0 * m * n * k * batch
