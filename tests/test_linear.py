"""Chapter 1: the linear layer forward/backward, the bias kernels and the column-major mapping."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import linear as L
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array, rel_error

pytestmark = pytest.mark.ch1

DTYPES = ["fp32", "bf16", "fp16"]


def f64(a):
    return backend.to_numpy(a).astype(np.float64)


def reference(x, w, b, dy):
    """float64 forward and gradients from the NumPy path (itself checked against finite differences)."""
    y = L.linear_forward(f64(x), f64(w), None if b is None else f64(b))
    dx, dw, db = L.linear_backward(f64(dy), f64(x), f64(w), bias=b is not None)
    return y, dx, dw, db


# --------------------------------------------------------------------------- NumPy path (CPU)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 33, 5), (2, 3, 7, 4)])  # (..., N, Cin, Cout)
def test_forward_numpy_vs_float64_formula(rng, dtype, shape):
    *lead, c_in, c_out = shape
    x = random_array(rng, (*lead, c_in), dtype)
    w = random_array(rng, (c_out, c_in), dtype)
    b = random_array(rng, (c_out,), dtype)
    y = L.linear_forward(x, w, b)
    assert y.shape == (*lead, c_out) and y.dtype == x.dtype
    want = np.einsum("...i,oi->...o", f64(x), f64(w)) + f64(b)
    assert_close(y, want, dtype)
    assert_close(L.linear_forward(x, w, None), want - f64(b), dtype)


@pytest.mark.parametrize("lead", [(3,), (2, 3)])
def test_backward_numpy_vs_finite_differences(rng, lead):
    """L = Σ y ⊙ g has dL/dy = g; the analytic dx, dw, db must match central differences (float64)."""
    c_in, c_out = 4, 5
    x = rng.standard_normal((*lead, c_in))
    w = rng.standard_normal((c_out, c_in))
    b = rng.standard_normal(c_out)
    g = rng.standard_normal((*lead, c_out))
    loss = lambda: float(np.sum(L.linear_forward(x, w, b) * g))
    dx, dw, db = L.linear_backward(g, x, w, bias=True)
    check_gradient(loss, x, dx, rtol=1e-7, name="dx")
    check_gradient(loss, w, dw, rtol=1e-7, name="dw")
    check_gradient(loss, b, db, rtol=1e-7, name="db")
    dx2, dw2, db2 = L.linear_backward(g, x, w, bias=False)
    assert db2 is None and np.array_equal(dx2, dx) and np.array_equal(dw2, dw)


def test_finite_difference_check_can_fail(rng):
    """The classic slip, dW = xᵀ dy instead of dyᵀ x, has the right shape for a square w: it must fail."""
    x = rng.standard_normal((3, 4))
    w = rng.standard_normal((4, 4))
    g = rng.standard_normal((3, 4))
    loss = lambda: float(np.sum(L.linear_forward(x, w) * g))
    _, dw, _ = L.linear_backward(g, x, w, bias=False)
    check_gradient(loss, w, dw, rtol=1e-7)
    with pytest.raises(AssertionError):
        check_gradient(loss, w, x.T @ g, rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_numpy_low_precision(rng, dtype):
    x, w, dy = (random_array(rng, s, dtype) for s in [(33, 7), (5, 7), (33, 5)])
    dx, dw, db = L.linear_backward(dy, x, w)
    _, rdx, rdw, rdb = reference(x, w, np.zeros(5, np.float32), dy)
    for got, want in ((dx, rdx), (dw, rdw), (db, rdb)):
        assert got.dtype == x.dtype
        assert_close(got, want, dtype)


@pytest.mark.parametrize("grad_dtype", ["fp32", "same"])
def test_accumulate_numpy(rng, grad_dtype):
    x, w, dy = (random_array(rng, s, "bf16") for s in [(9, 7), (5, 7), (9, 5)])
    gd = np.float32 if grad_dtype == "fp32" else x.dtype
    dw0 = random_array(rng, (5, 7), gd)
    db0 = random_array(rng, (5,), gd)
    dw_out, db_out = dw0.copy(), db0.copy()
    _, dw, db = L.linear_backward(dy, x, w, dw_out=dw_out, db_out=db_out, accumulate=True)
    assert dw is dw_out and db is db_out
    _, rdx, rdw, rdb = reference(x, w, np.zeros(5), dy)
    assert_close(dw, f64(dw0) + rdw, gd)
    assert_close(db, f64(db0) + rdb, gd)


def test_bias_helpers_numpy(rng):
    dy = random_array(rng, (4, 6, 7), "fp32")
    assert_close(L.bias_grad(dy), f64(dy).sum(axis=(0, 1)), "fp32")
    y = random_array(rng, (4, 7), "fp32")
    b = random_array(rng, (7,), "fp32")
    want = f64(y) + f64(b)
    assert L.add_bias(y, b) is y
    assert_close(y, want, "fp32")


def test_bias_chunks_cover_rows_and_depend_on_shape_only():
    for rows in (1, 7, 63, 64, 65, 1000, 16384, 65536, 10**6):
        for c, w in ((1, 1), (768, 8), (3072, 8), (50257, 1), (768, 4)):
            chunks, rpc = L.bias_chunks(rows, c, w)
            assert 1 <= chunks <= L.MAX_CHUNKS
            assert chunks * rpc >= rows and (chunks - 1) * rpc < rows  # every row once, no empty chunk
    assert L.bias_chunks(16384, 768, 8) == (256, 64)


# --------------------------------------------------------------------------- row-major vs column-major


def test_colmajor_view_reads_columns():
    buf = np.arange(12)
    v = L.colmajor_view(buf, 3, 4, 3)
    assert v[1, 2] == 1 + 2 * 3
    assert np.array_equal(v, buf.reshape(4, 3).T)  # row-major bytes read column-major: the transpose
    assert np.array_equal(L.colmajor_view(buf.reshape(3, 4), 3, 2, 5), [[0, 5], [1, 6], [2, 7]])
    with pytest.raises(ValueError, match="leading dimension"):
        L.colmajor_view(buf, 4, 3, 3)
    with pytest.raises(ValueError, match="past the end"):
        L.colmajor_view(buf, 3, 5, 3)


def test_wrong_and_right_cublas_calls_numpy(rng):
    n, c_in, c_out = 6, 5, 4
    x = random_array(rng, (n, c_in))
    w = random_array(rng, (c_out, c_in))
    want = f64(x) @ f64(w).T
    # Wrong: the arrays described as if they were column-major (m=N, n=Cout, k=Cin, lda=N, ...).
    y_wrong = np.zeros((n, c_out), np.float32)
    L.colmajor_gemm("N", "T", n, c_out, c_in, x, n, w, c_out, y_wrong, n)
    assert rel_error(y_wrong, want) > 0.5
    # What it computed: column-major readings of the buffers, written back column-major.
    emul = L.colmajor_view(x, n, c_in, n) @ L.colmajor_view(w, c_out, c_in, c_out).T
    np.testing.assert_allclose(L.colmajor_view(y_wrong, n, c_out, n), emul, rtol=1e-5, atol=1e-5)
    # Right: ask for yᵀ = w xᵀ, operands swapped, leading dimensions = row lengths.
    y_right = np.zeros((n, c_out), np.float32)
    L.colmajor_gemm("T", "N", c_out, n, c_in, w, c_in, x, c_in, y_right, c_out)
    assert_close(y_right, want, "fp32")
    # Row lengths as leading dimensions without swapping the operands: cuBLAS refuses (lda < m).
    with pytest.raises(ValueError, match="leading dimension"):
        L.colmajor_gemm("N", "T", n, c_out, c_in, x, c_in, w, c_in, y_wrong, c_out)


def test_colmajor_gemm_alpha_beta(rng):
    a = random_array(rng, (3, 2), "fp64")
    b = random_array(rng, (2, 4), "fp64")
    c = random_array(rng, (3, 4), "fp64")
    c0 = c.copy()
    # Row-major C = A B through the column-major identity Cᵀ = Bᵀ Aᵀ.
    L.colmajor_gemm("N", "N", 4, 3, 2, b, 4, a, 2, c, 4, alpha=2.0, beta=0.5)
    np.testing.assert_allclose(c, 2.0 * a @ b + 0.5 * c0, rtol=1e-12)
    with pytest.raises(ValueError, match="'N' or 'T'"):
        L.colmajor_gemm("X", "N", 4, 3, 2, b, 4, a, 2, c, 4)


# --------------------------------------------------------------------------- bad input (CPU)


def test_bad_inputs_numpy(rng):
    x = random_array(rng, (4, 3))
    w = random_array(rng, (5, 3))
    b = random_array(rng, (5,))
    dy = random_array(rng, (4, 5))
    with pytest.raises(ValueError, match="x has 4 input features"):
        L.linear_forward(random_array(rng, (3, 4)), w, b)
    with pytest.raises(ValueError, match="^w must be 2-D"):
        L.linear_forward(x, random_array(rng, (5, 3, 1)), b)
    with pytest.raises(ValueError, match="^b must have shape"):
        L.linear_forward(x, w, random_array(rng, (4,)))
    with pytest.raises(TypeError, match="w=bf16"):
        L.linear_forward(x, w.astype(backend.bfloat16), b)
    with pytest.raises(TypeError, match="b=fp16"):
        L.linear_forward(x, w, b.astype(np.float16))
    with pytest.raises(ValueError, match="^x must be C-contiguous"):
        L.linear_forward(random_array(rng, (3, 4)).T, w, b)
    with pytest.raises(ValueError, match="^x is empty"):
        L.linear_forward(np.zeros((0, 3), np.float32), w, b)
    with pytest.raises(TypeError, match="x must be a NumPy or CuPy array"):
        L.linear_forward([[1.0, 2.0, 3.0]], w, b)
    with pytest.raises(ValueError, match="^out must have shape"):
        L.linear_forward(x, w, b, out=np.empty((4, 4), np.float32))
    with pytest.raises(ValueError, match="^dy must have shape"):
        L.linear_backward(random_array(rng, (4, 6)), x, w)
    with pytest.raises(ValueError, match="^dy must have shape"):
        L.linear_backward(random_array(rng, (3, 5)), x, w)
    with pytest.raises(TypeError, match="dy=fp16"):
        L.linear_backward(dy.astype(np.float16), x, w)
    with pytest.raises(ValueError, match="^dy must be C-contiguous"):
        L.linear_backward(random_array(rng, (5, 4)).T, x, w)
    with pytest.raises(ValueError, match="accumulate=True"):
        L.linear_backward(dy, x, w, accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True"):
        L.linear_backward(dy, x, w, dw_out=np.zeros((5, 3), np.float32), accumulate=True)
    with pytest.raises(ValueError, match="bias=False"):
        L.linear_backward(dy, x, w, bias=False, db_out=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="^dw_out must have shape"):
        L.linear_backward(dy, x, w, dw_out=np.zeros((3, 5), np.float32))
    with pytest.raises(TypeError, match="^db_out must be float32 or bf16"):
        L.linear_backward(*(a.astype(backend.bfloat16) for a in (dy, x, w)), db_out=np.zeros(5, np.float16))
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        L.bias_grad(dy, accumulate=True)


# --------------------------------------------------------------------------- GPU path

SHAPES = [  # (N, Cin, Cout)
    (1, 1, 1),
    (1, 7, 33),
    (7, 33, 7),
    (33, 768, 3072),
    (1000, 768, 768),
    (1000, 3072, 768),
    (7, 3072, 1),
    (1000, 33, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_gpu_vs_reference(cp, rng, dtype, shape, bias):
    n, c_in, c_out = shape
    x = random_array(rng, (n, c_in), dtype, cp)
    w = random_array(rng, (c_out, c_in), dtype, cp)
    b = random_array(rng, (c_out,), dtype, cp) if bias else None
    out = poisoned((n, c_out), dtype, cp)
    y = L.linear_forward(x, w, b, out=out)
    assert y is out
    want, *_ = reference(x, w, b, random_array(rng, (n, c_out), "fp32"))
    assert_close(y, want, dtype, name=f"y {dtype} {shape}")
    y2 = L.linear_forward(x, w, b)  # allocating path
    assert isinstance(y2, cp.ndarray) and y2.dtype == x.dtype
    assert_close(y2, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_gpu_vs_reference(cp, rng, dtype, shape):
    n, c_in, c_out = shape
    x = random_array(rng, (n, c_in), dtype, cp)
    w = random_array(rng, (c_out, c_in), dtype, cp)
    dy = random_array(rng, (n, c_out), dtype, cp)
    outs = dict(
        dx_out=poisoned((n, c_in), dtype, cp),
        dw_out=poisoned((c_out, c_in), dtype, cp),
        db_out=poisoned((c_out,), dtype, cp),
    )
    dx, dw, db = L.linear_backward(dy, x, w, **outs)
    assert dx is outs["dx_out"] and dw is outs["dw_out"] and db is outs["db_out"]
    _, rdx, rdw, rdb = reference(x, w, cp.zeros(c_out, x.dtype), dy)
    assert_close(dx, rdx, dtype, name="dx")
    assert_close(dw, rdw, dtype, name="dw")
    assert_close(db, rdb, dtype, name="db")
    dx2, dw2, db2 = L.linear_backward(dy, x, w, bias=False)
    assert db2 is None
    assert_close(dx2, rdx, dtype, name="dx (bias=False)")
    assert_close(dw2, rdw, dtype, name="dw (bias=False)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_input_gpu(cp, rng, dtype):
    B, T, c_in, c_out = 2, 33, 768, 100
    x = random_array(rng, (B, T, c_in), dtype, cp)
    w = random_array(rng, (c_out, c_in), dtype, cp)
    b = random_array(rng, (c_out,), dtype, cp)
    dy = random_array(rng, (B, T, c_out), dtype, cp)
    y = L.linear_forward(x, w, b, out=poisoned((B, T, c_out), dtype, cp))
    dx, dw, db = L.linear_backward(dy, x, w, dx_out=poisoned((B, T, c_in), dtype, cp))
    ry, rdx, rdw, rdb = reference(x, w, b, dy)
    assert y.shape == (B, T, c_out) and dx.shape == x.shape
    for got, want, name in ((y, ry, "y"), (dx, rdx, "dx"), (dw, rdw, "dw"), (db, rdb, "db")):
        assert_close(got, want, dtype, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_dtype", ["fp32", "same"])
def test_accumulate_gpu(cp, rng, dtype, grad_dtype):
    n, c_in, c_out = 1000, 33, 768
    x = random_array(rng, (n, c_in), dtype, cp)
    w = random_array(rng, (c_out, c_in), dtype, cp)
    gd = np.float32 if grad_dtype == "fp32" else x.dtype
    dw0 = random_array(rng, (c_out, c_in), gd, cp, scale=10.0)
    db0 = random_array(rng, (c_out,), gd, cp, scale=10.0)
    dw_out, db_out = dw0.copy(), db0.copy()
    ref_dw, ref_db = f64(dw0), f64(db0)
    for _ in range(2):  # two micro-batches
        dy = random_array(rng, (n, c_out), dtype, cp)
        _, dw, db = L.linear_backward(dy, x, w, dw_out=dw_out, db_out=db_out, accumulate=True)
        assert dw is dw_out and db is db_out
        _, _, rdw, rdb = reference(x, w, cp.zeros(c_out, x.dtype), dy)
        ref_dw, ref_db = ref_dw + rdw, ref_db + rdb
    assert_close(dw_out, ref_dw, gd, name="dw accumulated")
    assert_close(db_out, ref_db, gd, name="db accumulated")


BIAS_SHAPES = [(1, 1), (7, 7), (1000, 33), (1000, 768), (33, 3072), (3000, 768), (65, 50257), (70000, 8), (1, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_bias_grad_gpu(cp, rng, dtype, shape):
    rows, c = shape
    dy = random_array(rng, shape, dtype, cp)
    out = poisoned((c,), dtype, cp)
    assert L.bias_grad(dy, out=out) is out
    assert_close(out, f64(dy).sum(axis=0), dtype, name=f"db {shape}")
    out32 = poisoned((c,), "fp32", cp)
    L.bias_grad(dy, out=out32)  # fp32 output: only the accumulation error remains
    assert_close(out32, f64(dy).sum(axis=0), rtol=1e-5, name=f"db fp32 {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 7), (1000, 33), (1000, 768), (33, 3072), (65, 50257), (5, 1000)])
def test_add_bias_gpu(cp, rng, dtype, shape):
    y = random_array(rng, shape, dtype, cp)
    b = random_array(rng, (shape[1],), dtype, cp)
    want = f64(y) + f64(b)
    assert L.add_bias(y, b) is y
    assert_close(y, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bias_kernels_scalar_fallback_on_unaligned_views(cp, rng, dtype):
    """A view starting one element into a buffer is not 16-byte aligned: the W=1 kernels must run."""
    rows, c = 100, 768
    buf = random_array(rng, (rows * c + 1,), dtype, cp)
    dy = buf[1:].reshape(rows, c)
    assert dy.flags.c_contiguous and dy.data.ptr % 16 != 0
    assert L.vector_width(dy.dtype, c, dy) == 1
    assert L.vector_width(dy.dtype, c, buf[:-1]) > 1
    out = poisoned((c,), dtype, cp)
    assert_close(L.bias_grad(dy, out=out), f64(dy).sum(axis=0), dtype)
    b = random_array(rng, (c,), dtype, cp)
    want = f64(dy) + f64(b)
    first = buf[:1].copy()
    assert_close(L.add_bias(dy, b), want, dtype)
    assert cp.array_equal(buf[:1], first)  # the element before the view is untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_grad_bitwise_deterministic(cp, rng, dtype):
    dy = random_array(rng, (20000, 768), dtype, cp)
    a = L.bias_grad(dy)
    b = L.bias_grad(dy, out=poisoned((768,), dtype, cp))
    c = L.bias_grad(dy, out=cp.zeros(768, np.float32))
    d = L.bias_grad(dy, out=cp.zeros(768, np.float32))
    bits = np.uint16 if a.itemsize == 2 else np.uint32
    assert cp.array_equal(a.view(bits), b.view(bits))
    assert cp.array_equal(c.view(np.uint32), d.view(np.uint32))


@pytest.mark.gpu
def test_wrong_and_right_cublas_calls_gpu(cp, rng):
    """The real cublasGemmEx with the wrong and the right arguments does what the emulation says."""
    n, c_in, c_out = 33, 7, 5
    x = random_array(rng, (n, c_in), "fp32")
    w = random_array(rng, (c_out, c_in), "fp32")
    xg, wg = cp.asarray(x), cp.asarray(w)
    wrong = ("N", "T", n, c_out, c_in, "x", n, "w", c_out, n)
    right = ("T", "N", c_out, n, c_in, "w", c_in, "x", c_in, c_out)
    for args in (wrong, right):
        ta, tb, m, nn, k, a, lda, b, ldb, ldc = args
        host = {"x": x, "w": w}
        dev = {"x": xg, "w": wg}
        y_h = np.zeros((n, c_out), np.float32)
        y_d = cp.zeros((n, c_out), np.float32)
        L.colmajor_gemm(ta, tb, m, nn, k, host[a], lda, host[b], ldb, y_h, ldc)
        L.colmajor_gemm(ta, tb, m, nn, k, dev[a], lda, dev[b], ldb, y_d, ldc)
        assert_close(y_d, y_h, "fp32")


@pytest.mark.gpu
def test_bad_inputs_gpu(cp, rng):
    x = random_array(rng, (4, 3), "fp32", cp)
    w = random_array(rng, (5, 3), "fp32", cp)
    b = random_array(rng, (5,), "fp32", cp)
    dy = random_array(rng, (4, 5), "fp32", cp)
    with pytest.raises(TypeError, match="w=ndarray"):
        L.linear_forward(x, backend.to_numpy(w), b)
    with pytest.raises(TypeError, match="b=ndarray"):
        L.linear_forward(x, w, backend.to_numpy(b))
    with pytest.raises(TypeError, match="x=ndarray"):
        L.linear_backward(dy, backend.to_numpy(x), w)
    with pytest.raises(TypeError, match="dw_out=ndarray"):
        L.linear_backward(dy, x, w, dw_out=np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError, match="x has 4 input features"):
        L.linear_forward(random_array(rng, (3, 4), "fp32", cp), w, b)
    with pytest.raises(ValueError, match="^b must have shape"):
        L.linear_forward(x, w, b[:4])
    with pytest.raises(TypeError, match="w=bf16"):
        L.linear_forward(x, w.astype(backend.bfloat16), b)
    with pytest.raises(ValueError, match="^x must be C-contiguous"):
        L.linear_forward(random_array(rng, (3, 4), "fp32", cp).T, w, b)
    with pytest.raises(TypeError, match="GPU path supports"):
        L.linear_forward(x.astype(np.float64), w.astype(np.float64))
    with pytest.raises(ValueError, match="^dy must have shape"):
        L.linear_backward(dy[:3], x, w)
