"""The linear layer, y = x Wᵀ + b, and its three gradients (chapter 1).

Weights use PyTorch's layout, ``w [Cout, Cin]``. For ``x [N, Cin]`` (or ``[..., Cin]``) and the
upstream gradient ``dy [N, Cout]``:

* forward   ``y  = x Wᵀ + b``        one GEMM (``gemm(x, w, trans_b=True)``) + the ``bias_add`` kernel
* dgrad     ``dx = dy W``            ``[N, Cout] @ [Cout, Cin] → [N, Cin]``
* wgrad     ``dW = dyᵀ x``           ``[Cout, N] @ [N, Cin] → [Cout, Cin]``: a sum over the N rows
* bias      ``db = Σ_rows dy``       the deterministic two-stage ``bias_grad`` kernels

All GEMMs go through :func:`llmgpu.gemm.gemm` (cuBLAS, fp32 accumulation, no transposing copies;
its docstring explains the row-major/column-major mapping); the weight gradient through
:func:`llmgpu.gemm.ksplit.wgrad_gemm`, which splits a row count N that is not a multiple of 64 into
two GEMMs (cuBLAS' precision trap at N = 2ⁿ + 1, issue 13; one plain GEMM otherwise). The bias kernels live in
``llmgpu/kernels/bias.cu``. With ``accumulate=True`` the weight and bias gradients are *added* into
caller-provided buffers (cuBLAS ``beta = 1``), which is what gradient accumulation over
micro-batches needs.

Why the bias is a separate kernel and not fused: cuBLAS' ``gemmEx`` has no epilogue, so adding the
bias costs one read and one write of y either way (pre-filling y with b and running the GEMM with
``beta = 1`` moves the same bytes). cuBLASLt epilogues (BIAS, BGRADB) fuse it into the GEMM; the
training-loop chapters use them. Here the kernel is the lesson.

The module also holds :func:`colmajor_view` and :func:`colmajor_gemm`, a NumPy emulation of what a
column-major BLAS reads from memory (and, on CuPy arrays, the real cuBLAS call with the same
arguments), so the chapter can show the *wrong* call next to the right one.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_gpu_dtype, check_out, check_same_dtype, reference_dtype
from ..gemm.cublas import CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUDA_DATA_TYPES, gemm
from ..gemm.ksplit import wgrad_gemm
from ..kernels import get_kernel, loader
from ..kernels.launch import stride_grid, vector_width

# Bias-gradient launch shape (see bias.cu). The number of row chunks depends on the shape only, never
# on the device, so the reduction order, and therefore db, is the same on every GPU and every run.
ROW_THREADS = loader.constant("bias", "BIAS_ROW_THREADS")  # blockDim.y of both bias_grad kernels
MIN_ROWS_PER_CHUNK = 64  # at least 8 rows per thread in stage 1
TARGET_BLOCKS = 1024  # enough blocks to fill a large GPU several times over
MAX_CHUNKS = 1024  # bounds the fp32 scratch and stage 2's work
BIAS_ADD_THREADS = 256


# --------------------------------------------------------------------------- public ops


def linear_forward(x, w, b=None, out=None):
    """``y = x wᵀ + b`` for ``x [..., Cin]``, ``w [Cout, Cin]``, ``b [Cout]`` (or None) → ``y [..., Cout]``.

    x, w and b share one dtype (fp32, fp16, bf16; fp64 too on NumPy). ``out`` (optional) receives y.
    """
    xp = array_module(x=x, w=w, b=b, out=out)
    c_out, c_in = _check_weight(x, w, xp)
    if b is not None:
        check_array("b", b, shape=(c_out,))
    check_same_dtype(x=x, w=w, b=b)
    out_shape = (*x.shape[:-1], c_out)
    out = check_out(out, out_shape, x.dtype, xp)
    x2 = x.reshape(-1, c_in)
    y2 = out.reshape(-1, c_out)  # a view: out is C-contiguous
    if xp is np:
        y2[...] = _forward_numpy(x2, w, b)
        return out
    gemm(x2, w, trans_b=True, out=y2)
    if b is not None:
        add_bias(y2, b)
    return out


def linear_backward(dy, x, w, bias=True, *, dx_out=None, dw_out=None, db_out=None, accumulate=False,
                    protect_k: bool = True):
    """Gradients of ``y = x wᵀ + b``: returns ``(dx, dw, db)``; ``db`` is None when ``bias=False``.

    ``dy [..., Cout]`` and ``x [..., Cin]`` share their leading axes; all three inputs share a dtype.
    ``dx`` has x's shape and dtype. ``dw [Cout, Cin]`` and ``db [Cout]`` have dy's dtype unless
    ``dw_out``/``db_out`` are given, which may be fp32 or dy's dtype (fp32 gradient buffers for
    mixed precision). With ``accumulate=True`` the new gradients are *added* to ``dw_out``/``db_out``
    (both required) instead of overwriting them. ``protect_k=False``: the weight gradient as one GEMM whatever
    the row count (``gemm.ksplit``'s protection off: the unprotected baseline of ``tools/probes/probe_gemm_k.py``).
    """
    xp = array_module(dy=dy, x=x, w=w, dx_out=dx_out, dw_out=dw_out, db_out=db_out)
    c_out, c_in = _check_weight(x, w, xp)
    check_array("dy", dy, shape=(*x.shape[:-1], c_out))
    check_same_dtype(dy=dy, x=x, w=w)
    if not bias and db_out is not None:
        raise ValueError("db_out was given but bias=False (there is no bias gradient)")
    if accumulate and (dw_out is None or (bias and db_out is None)):
        raise ValueError("accumulate=True adds into existing gradients: pass dw_out (and db_out when bias=True)")
    dx = check_out(dx_out, x.shape, x.dtype, xp, name="dx_out")
    dw = _check_grad_out("dw_out", dw_out, (c_out, c_in), dy.dtype, xp)
    db = _check_grad_out("db_out", db_out, (c_out,), dy.dtype, xp) if bias else None
    dy2 = dy.reshape(-1, c_out)
    x2 = x.reshape(-1, c_in)
    dx2 = dx.reshape(-1, c_in)

    if xp is np:
        gx, gw, gb = _backward_numpy(dy2, x2, w, bias)
        dx2[...] = gx
        _store(dw, gw, accumulate)
        if bias:
            _store(db, gb, accumulate)
        return dx, dw, db

    gemm(dy2, w, out=dx2)  # dx = dy W
    # dW = dyᵀ x (+ dW), a sum over the N rows: wgrad_gemm splits N when it is not a multiple of 64 (issue 13)
    wgrad_gemm(dy2, x2, out=dw, beta=1.0 if accumulate else 0.0, gemm=gemm, protect=protect_k)
    if bias:
        bias_grad(dy2, out=db, accumulate=accumulate)
    return dx, dw, db


def add_bias(y, b):
    """``y += b`` in place over the rows of ``y [..., C]`` (the ``bias_add`` kernel); returns y."""
    xp = array_module(y=y, b=b)
    check_array("y", y)
    c = y.shape[-1]
    check_array("b", b, shape=(c,))
    check_same_dtype(y=y, b=b)
    if xp is np:
        acc = _acc_dtype(y.dtype)
        y[...] = (y.astype(acc) + b.astype(acc)).astype(y.dtype)
        return y
    check_gpu_dtype("y", y)
    rows = y.size // c
    w_vec = vector_width(y.dtype, c, y, b)
    n_items = rows * (c // w_vec)
    grid = stride_grid(n_items, BIAS_ADD_THREADS, xp, per_sm=16)
    kernel = get_kernel("bias", "bias_add", y.dtype, w_vec)
    kernel((grid,), (BIAS_ADD_THREADS,), (y, b, np.int64(rows), np.int32(c)))
    return y


def bias_grad(dy, out=None, accumulate=False):
    """``db = Σ_rows dy`` for ``dy [..., C]`` → ``db [C]``, summed in fp32 in a fixed order.

    ``out`` may be fp32 or dy's dtype (default: a new array of dy's dtype). ``accumulate=True`` adds
    into ``out`` (required then). The result is bitwise reproducible: the order of additions depends
    on the shape only (two stages, see ``bias_chunks`` and ``kernels/bias.cu``).
    """
    xp = array_module(dy=dy, out=out)
    check_array("dy", dy)
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into out, so out must be given")
    c = dy.shape[-1]
    out = _check_grad_out("out", out, (c,), dy.dtype, xp)
    rows = dy.size // c
    if xp is np:
        acc = _acc_dtype(dy.dtype)
        _store(out, dy.reshape(rows, c).astype(acc).sum(axis=0), accumulate)
        return out
    check_gpu_dtype("dy", dy)
    w_vec = vector_width(dy.dtype, c, dy)
    chunks, rows_per_chunk = bias_chunks(rows, c, w_vec)
    partial = xp.empty((chunks, c), dtype=np.float32)
    tile = 32 * w_vec
    stage1 = get_kernel("bias", "bias_grad_partial", dy.dtype, w_vec)
    args = (dy, partial, np.int64(rows), np.int32(c), np.int64(rows_per_chunk))
    stage1((-(-c // tile), chunks), (32, ROW_THREADS), args)
    stage2 = get_kernel("bias", "bias_grad_final", out.dtype)
    stage2((-(-c // 32),), (32, ROW_THREADS), (partial, out, np.int32(chunks), np.int32(c), np.int32(accumulate)))
    return out


def bias_chunks(rows: int, c: int, w_vec: int = 1) -> tuple[int, int]:
    """(chunks, rows_per_chunk) of the two-stage bias gradient: a function of the shape only."""
    col_tiles = -(-c // (32 * w_vec))
    chunks = min(-(-rows // MIN_ROWS_PER_CHUNK), max(1, -(-TARGET_BLOCKS // col_tiles)), MAX_CHUNKS)
    rows_per_chunk = -(-rows // max(chunks, 1))
    return -(-rows // rows_per_chunk), rows_per_chunk  # no empty chunk


def linear_flops(n: int, c_in: int, c_out: int) -> float:
    """FLOPs of one of the three GEMMs of a linear layer (forward, dgrad and wgrad cost the same)."""
    return 2.0 * n * c_in * c_out


# --------------------------------------------------------------------------- NumPy reference


def _forward_numpy(x, w, b):
    """Reference forward on 2-D x [N, Cin]: float32 math (float64 stays float64), cast back."""
    acc = _acc_dtype(x.dtype)
    y = x.astype(acc) @ w.astype(acc).T  # [N, Cin] @ [Cin, Cout]
    if b is not None:
        y += b.astype(acc)  # broadcast over the N rows
    return y.astype(x.dtype)


def _backward_numpy(dy, x, w, bias):
    """Reference gradients on 2-D dy [N, Cout], x [N, Cin]; returned in the float32/float64 math type."""
    acc = _acc_dtype(dy.dtype)
    dy, x, w = dy.astype(acc), x.astype(acc), w.astype(acc)
    dx = dy @ w  # [N, Cout] @ [Cout, Cin]: each input feeds every output through w
    dw = dy.T @ x  # [Cout, N] @ [N, Cin]: a sum of outer products, one per row
    db = dy.sum(axis=0) if bias else None  # the bias is added to every row
    return dx, dw, db


def _store(dst, value, accumulate):
    """dst = value (or dst += value), computed in the math type and rounded once into dst's dtype."""
    if accumulate:
        value = dst.astype(value.dtype) + value
    dst[...] = value.astype(dst.dtype)


_acc_dtype = reference_dtype


# --------------------------------------------------------------------------- argument checks


def _check_weight(x, w, xp):
    check_array("x", x)
    check_array("w", w, ndim=2)
    c_out, c_in = w.shape
    if x.shape[-1] != c_in:
        raise ValueError(
            f"x has {x.shape[-1]} input features (shape {tuple(x.shape)}) but w [Cout, Cin] has Cin={c_in} "
            f"(shape {tuple(w.shape)})"
        )
    if xp is not np:
        check_gpu_dtype("x", x)
    return c_out, c_in


def _check_grad_out(name, out, shape, dtype, xp):
    """Gradient buffers may be fp32 (mixed-precision master gradients) or the input dtype."""
    if out is None:
        return xp.empty(shape, dtype=dtype)
    if backend.get_array_module(out) is not xp:
        raise TypeError(f"{name} must live on the same device as the inputs")
    check_array(name, out, shape=shape)
    if out.dtype not in (dtype, backend.float32):
        raise TypeError(f"{name} must be float32 or {backend.dtype_name(dtype)}, got {out.dtype}")
    return out




# --------------------------------------------------------------------------- column-major BLAS


def colmajor_view(buf, rows, cols, ld):
    """The ``rows × cols`` matrix a column-major BLAS sees at ``buf`` with leading dimension ``ld``.

    Element (i, j) is ``buf.flat[i + j * ld]``, whatever shape ``buf`` has in NumPy: BLAS gets a
    pointer, not an array. Raises ValueError where cuBLAS would refuse the call (``ld < rows``) or
    read past the end of the buffer.
    """
    flat = np.asarray(buf).reshape(-1)
    _colmajor_bounds(flat.size, rows, cols, ld)
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    return flat[i + j * ld]


def _colmajor_bounds(size, rows, cols, ld):
    """The checks a careful caller makes before handing (pointer, rows, cols, ld) to cuBLAS."""
    if min(rows, cols) < 1:
        raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
    if ld < rows:
        raise ValueError(f"leading dimension {ld} < rows {rows}: cuBLAS rejects this (CUBLAS_STATUS_INVALID_VALUE)")
    last = (rows - 1) + (cols - 1) * ld
    if last >= size:
        raise ValueError(
            f"a {rows} x {cols} matrix with ld={ld} reads element {last}, past the end of a buffer of {size} elements"
        )


def colmajor_gemm(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, alpha=1.0, beta=0.0):
    """``C = alpha op(A) op(B) + beta C`` with cublasGemmEx's arguments and column-major semantics.

    ``a``, ``b``, ``c`` are arrays used as raw buffers (only their memory matters, as for cuBLAS);
    ``transa``/``transb`` are ``"N"`` or ``"T"``; op(A) is m × k, op(B) is k × n, C is m × n. On
    NumPy arrays this *emulates* the BLAS (reading through :func:`colmajor_view`, math in float32); on
    CuPy arrays it makes the real ``cublasGemmEx`` call (fp32 compute) with exactly these arguments,
    after the same bounds checks. ``c`` is written in place and returned.
    """
    ops = {"N": False, "T": True}
    if transa not in ops or transb not in ops:
        raise ValueError(f"transa/transb must be 'N' or 'T', got {transa!r}, {transb!r}")
    xp = array_module(a=a, b=b, c=c)
    for name, arr in (("a", a), ("b", b), ("c", c)):
        check_array(name, arr)
    # What each operand looks like in memory: op(A) = A (m × k) or A is stored k × m and transposed.
    a_rows, a_cols = (k, m) if ops[transa] else (m, k)
    b_rows, b_cols = (n, k) if ops[transb] else (k, n)
    _colmajor_bounds(a.size, a_rows, a_cols, lda)
    _colmajor_bounds(b.size, b_rows, b_cols, ldb)
    _colmajor_bounds(c.size, m, n, ldc)
    if xp is np:
        acc = _acc_dtype(a.dtype)
        A = colmajor_view(a, a_rows, a_cols, lda).astype(acc)
        B = colmajor_view(b, b_rows, b_cols, ldb).astype(acc)
        A = A.T if ops[transa] else A
        B = B.T if ops[transb] else B
        flat = c.reshape(-1)
        idx = np.arange(m)[:, None] + np.arange(n)[None, :] * ldc
        old = flat[idx].astype(acc) if beta != 0.0 else 0.0
        flat[idx] = (alpha * (A @ B) + beta * old).astype(c.dtype)
        return c
    from cupy.cuda import cublas

    if a.dtype != b.dtype or a.dtype not in CUDA_DATA_TYPES or c.dtype not in (a.dtype, backend.float32):
        raise TypeError(f"unsupported dtypes a={a.dtype}, b={b.dtype}, c={c.dtype}")
    handle = xp.cuda.device.get_cublas_handle()
    al = np.array([alpha], np.float32)
    be = np.array([beta], np.float32)
    cublas.gemmEx(
        handle, int(ops[transa]), int(ops[transb]), m, n, k, al.ctypes.data,
        a.data.ptr, CUDA_DATA_TYPES[a.dtype], lda, b.data.ptr, CUDA_DATA_TYPES[b.dtype], ldb, be.ctypes.data,
        c.data.ptr, CUDA_DATA_TYPES[c.dtype], ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip
    return c


__all__ = [
    "add_bias",
    "bias_chunks",
    "bias_grad",
    "colmajor_gemm",
    "colmajor_view",
    "linear_backward",
    "linear_flops",
    "linear_forward",
]
