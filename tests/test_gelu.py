"""GELU (tanh approximation) forward/backward (chapter 3): reference vs float64 math and finite
differences, CUDA kernels vs the reference, argument checks."""

import math
import re
from pathlib import Path

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.kernels import loader
from llmgpu.ops.gelu import METHODS, gelu_backward, gelu_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3


def _gelu64(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu64_sigmoid(x):
    """GELU and GELU' in float64 through the sigmoid: 0.5 (1 + tanh u) = s = 1 / (1 + exp(-2u)).

    The tanh form cancels in float64 too where GELU is below ~1e-16 (x < ~ -6); this one does not.
    Also returns the scale of the gradient's two terms, |s| + |2 x u' s (1 - s)|, to measure its
    error against near its zero (x ~ -0.75, where the terms cancel).
    """
    x = np.asarray(x, dtype=np.float64)
    c = math.sqrt(2.0 / math.pi)
    u = c * (x + 0.044715 * x**3)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * u))
    term = 2.0 * x * s * (1.0 - s) * c * (1.0 + 3.0 * 0.044715 * x * x)
    return x * s, s + term, np.abs(s) + np.abs(term)


def test_fast_kernel_constants():
    """The constants of the fast form (gelu.cuh), and the form itself in float64, against the tanh formula."""
    text = (Path(loader.source_path("gelu")).parent / "gelu.cuh").read_text()
    k = {m[0]: float(m[1]) for m in re.findall(r"#define (GELU_FAST_\w+) (-?[0-9.e-]+)f", text)}
    c = math.sqrt(2.0 / math.pi)
    assert k["GELU_FAST_A"] == pytest.approx(-2.0 * c / math.log(2.0), rel=1e-15)
    assert k["GELU_FAST_B"] == pytest.approx(0.044715 * k["GELU_FAST_A"], rel=1e-15)
    assert k["GELU_FAST_C1"] == pytest.approx(2.0 * c, rel=1e-15)
    assert k["GELU_FAST_C2"] == pytest.approx(6.0 * c * 0.044715, rel=1e-15)
    x = np.linspace(-6.0, 6.0, 2001)
    e = np.exp2(x * (k["GELU_FAST_A"] + k["GELU_FAST_B"] * x * x))
    s = 1.0 / (1.0 + e)
    y = x * s
    g = s * (1.0 + x * (k["GELU_FAST_C1"] + k["GELU_FAST_C2"] * x * x) * (e * s))
    y_ref, g_ref, _ = _gelu64_sigmoid(x)
    np.testing.assert_allclose(y, _gelu64(x), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=0)
    np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-15)


def test_forward_matches_float64_formula(rng):
    x = random_array(rng, (13, 29), "fp32", scale=3.0)
    y = gelu_forward(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert_close(y, _gelu64(x), "fp32")


def test_forward_known_values():
    x = np.array([-1e4, -30.0, -1.0, 0.0, 1.0, 30.0, 1e4], dtype=np.float32)
    y = gelu_forward(x)
    np.testing.assert_allclose(y, _gelu64(x), rtol=1e-6, atol=1e-7)
    assert y[3] == 0.0 and y[-1] == np.float32(1e4) and abs(y[0]) < 1e-30


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 2, 3)])
def test_backward_matches_finite_differences(rng, shape):
    x = rng.standard_normal(shape) * 2.0
    r = rng.standard_normal(shape)
    check_gradient(lambda: float((gelu_forward(x) * r).sum()), x, gelu_backward(r, x), name="dx")


def test_bf16_reference_and_out(rng):
    x = random_array(rng, (4, 8), "bf16")
    y = gelu_forward(x)
    assert y.dtype == backend.bfloat16
    assert_close(y, _gelu64(x.astype(np.float32)), "bf16")
    out = poisoned((4, 8), "bf16", np)
    assert gelu_backward(x, x, out=out) is out and np.all(np.isfinite(out.astype(np.float32)))


def test_bad_inputs(rng):
    x = random_array(rng, (4, 8), "fp32")
    with pytest.raises(ValueError, match="dy"):
        gelu_backward(x[:3].copy(), x)
    with pytest.raises(TypeError, match="dtypes must match"):
        gelu_backward(x.astype(np.float16), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        gelu_forward(x.T)
    with pytest.raises(TypeError, match="x has dtype"):
        gelu_forward(x.astype(np.int64))
    with pytest.raises(ValueError, match="method"):
        gelu_forward(x, method="tanh")
    with pytest.raises(ValueError, match="out"):
        gelu_forward(x, out=np.empty((4, 9), np.float32))
    with pytest.raises(TypeError):
        gelu_forward([1.0, 2.0])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1,), (7,), (33,), (1000,), (7, 33), (3, 768 * 4 + 5), (64, 3072)])
def test_gpu_matches_reference(cp, rng, dtype, method, shape):
    x = random_array(rng, shape, dtype, scale=2.0)
    dy = random_array(rng, shape, dtype)
    xd, dyd = cp.asarray(x), cp.asarray(dy)
    y = gelu_forward(xd, out=poisoned(shape, dtype, cp), method=method)
    assert_close(y, gelu_forward(x), dtype, name="y")
    dx = gelu_backward(dyd, xd, out=poisoned(shape, dtype, cp), method=method)
    assert_close(dx, gelu_backward(dy, x), dtype, name="dx")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_misaligned_view_and_extremes(cp, rng, dtype, method):
    dt = backend.resolve_dtype(dtype)
    x = np.concatenate([random_array(rng, (1001,), dtype, scale=3.0),
                        np.array([-1e4, -100, -20, -5, 0, 5, 20, 100, 1e4], dtype=dt)])
    dy = random_array(rng, x.shape, dtype)
    buf = cp.empty(x.size + 1, dtype=dt)
    buf[1:] = cp.asarray(x)
    xd = buf[1:]
    assert xd.data.ptr % 16 != 0
    y = gelu_forward(xd, method=method)
    assert_close(y, gelu_forward(x), dtype)
    assert_close(gelu_backward(cp.asarray(dy), xd, method=method), gelu_backward(dy, x), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_fp32_accuracy_wide_range(cp, rng, method):
    """Elementwise relative error against float64 on x in [-20, 20], fp32 storage.

    Bounds (catch a 1e-4 relative error anywhere): 5e-6 on [-3, 3] and x > 3; 4e-5 on [-9.3, -3),
    where GELU is tiny and float32 rounding of the exponent (~|z| ulp, z ~ 100) is amplified by exp:
    any float32 evaluation has it (a NumPy model of both kernels gives ~1e-5 there, ~1e-6 elsewhere).
    Below ~1e-30 (x < -9.3) the output must just be that small, and far out it must be exact:
    y == x and dy/dx == 1 for x >= 10; y == 0 and dy/dx == 0 for x <= -20. No NaN for finite x.
    """
    far = [10.0, 20.0, 100.0, 1e4, -20.0, -30.0, -100.0, -1e4]
    if method == "fast":  # the expf kernels give NaN for dy/dx when x^2 overflows; the fast one does not
        far += [1e20, 3e38, -1e20, -3e38]
    x = np.concatenate([np.linspace(-20.0, 20.0, 400_001), rng.uniform(-20.0, 20.0, 100_000),
                        np.array(far)]).astype(np.float32)
    xd = cp.asarray(x)
    y = backend.to_numpy(gelu_forward(xd, method=method)).astype(np.float64)
    g = backend.to_numpy(gelu_backward(cp.ones_like(xd), xd, method=method)).astype(np.float64)
    assert np.isfinite(y).all() and np.isfinite(g).all()
    y_ref, g_ref, g_scale = _gelu64_sigmoid(x)
    normal = np.abs(y_ref) > 1e-30
    for lo, hi, tol in [(-9.3, -3.0, 4e-5), (-3.0, 3.0, 5e-6), (3.0, np.inf, 5e-6)]:
        sel = normal & (x >= lo) & (x < hi)
        err_y = (np.abs(y - y_ref) / np.abs(y_ref))[sel]
        err_g = (np.abs(g - g_ref) / g_scale)[sel]
        xs = x[sel]
        assert err_y.max() <= tol, f"y on [{lo}, {hi}): relative error {err_y.max():.2e} at x = {xs[err_y.argmax()]}"
        assert err_g.max() <= tol, f"dy/dx on [{lo}, {hi}): error {err_g.max():.2e} at x = {xs[err_g.argmax()]}"
    tiny = ~normal & (x < -9.0)
    assert tiny.sum() > 1000 and np.abs(y[tiny]).max() <= 1e-29 and np.abs(g[tiny]).max() <= 1e-27
    big, small = x >= 10.0, x <= -20.0
    np.testing.assert_array_equal(y[big], x[big].astype(np.float64))
    np.testing.assert_array_equal(g[big], 1.0)
    np.testing.assert_array_equal(y[small], 0.0)
    np.testing.assert_array_equal(g[small], 0.0)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    x = random_array(rng, (4, 8), "fp32")
    with pytest.raises(TypeError, match="dy=ndarray|dy=numpy"):
        gelu_backward(x, cp.asarray(x))
    with pytest.raises(TypeError, match="float64"):
        gelu_forward(cp.asarray(x, dtype=cp.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        gelu_forward(cp.asarray(x).T)
