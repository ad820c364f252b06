"""GELU (tanh approximation) forward/backward (chapter 3): reference vs float64 math and finite
differences, CUDA kernels vs the reference, argument checks."""

import math

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.gelu import METHODS, gelu_backward, gelu_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3


def _gelu64(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


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
def test_gpu_misaligned_view_and_extremes(cp, rng, dtype):
    dt = backend.resolve_dtype(dtype)
    x = np.concatenate([random_array(rng, (1001,), dtype, scale=3.0),
                        np.array([-1e4, -100, -20, -5, 0, 5, 20, 100, 1e4], dtype=dt)])
    dy = random_array(rng, x.shape, dtype)
    buf = cp.empty(x.size + 1, dtype=dt)
    buf[1:] = cp.asarray(x)
    xd = buf[1:]
    assert xd.data.ptr % 16 != 0
    y = gelu_forward(xd)
    assert_close(y, gelu_forward(x), dtype)
    assert_close(gelu_backward(cp.asarray(dy), xd), gelu_backward(dy, x), dtype)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    x = random_array(rng, (4, 8), "fp32")
    with pytest.raises(TypeError, match="dy=ndarray|dy=numpy"):
        gelu_backward(x, cp.asarray(x))
    with pytest.raises(TypeError, match="float64"):
        gelu_forward(cp.asarray(x, dtype=cp.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        gelu_forward(cp.asarray(x).T)
