"""Softmax forward/backward: the NumPy reference against float64 math, every CUDA kernel against it."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.softmax import METHODS, softmax_backward, softmax_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array, rel_error

pytestmark = pytest.mark.ch2

BF16 = backend.bfloat16
KERNELS = ("naive", "warp", "block")


def ref_softmax(x, scale=1.0, causal=False):
    """Direct float64 formula, written independently of the package: exp(s·x) / Σ exp(s·x) per row,
    with masked entries removed by zeroing their exponentials."""
    t = np.asarray(x, dtype=np.float64) * scale
    t = t - t.max(axis=-1, keepdims=True)  # shift for range only; the masked max is still an upper bound
    e = np.exp(t)
    if causal:
        T = x.shape[-1]
        e = e * (np.arange(T)[None, :] <= np.arange(T)[:, None])
    return e / e.sum(axis=-1, keepdims=True)


def ref_softmax_backward(dp, p, scale=1.0, causal=False):
    """dx = s · (diag(p) − p pᵀ) dp per row, with the Jacobian built explicitly (float64)."""
    dp = np.asarray(dp, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    dx = scale * (p * dp - p * (p * dp).sum(axis=-1, keepdims=True))
    if causal:
        T = p.shape[-1]
        dx = dx * (np.arange(T)[None, :] <= np.arange(T)[:, None])
    return dx


# --------------------------------------------------------------------------- NumPy reference


@pytest.mark.parametrize("cols", [1, 7, 33, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_matches_float64_formula(rng, cols, dtype):
    x = random_array(rng, (5, cols), dtype, scale=3.0)
    p = softmax_forward(x)
    assert p.dtype == dtype and p.shape == x.shape
    assert_close(p, ref_softmax(x), rtol=1e-6 if dtype == np.float32 else 1e-13)
    np.testing.assert_allclose(p.astype(np.float64).sum(-1), 1.0, rtol=1e-5)


def test_forward_without_max_shift_on_small_inputs(rng):
    """Against the textbook formula exp(x)/Σexp(x) where it does not overflow."""
    x = rng.standard_normal((4, 9))
    e = np.exp(x)
    np.testing.assert_allclose(softmax_forward(x), e / e.sum(-1, keepdims=True), rtol=1e-12)


def test_forward_is_stable_for_large_inputs(rng):
    x = (1000.0 + rng.standard_normal((3, 50))).astype(np.float32)
    p = softmax_forward(x)
    assert np.all(np.isfinite(p))
    assert_close(p, ref_softmax(x - 1000.0), rtol=1e-5)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_forward_scaled_causal(rng, T):
    x = rng.standard_normal((2, 3, T, T))
    p = softmax_forward(x, scale=0.37, causal=True)
    np.testing.assert_allclose(p, ref_softmax(x, 0.37, causal=True), rtol=1e-12, atol=1e-15)
    assert np.all(p[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0.0)


def test_forward_bf16_numpy_path(rng):
    x = random_array(rng, (6, 33), BF16)
    p = softmax_forward(x)
    assert p.dtype == BF16
    assert_close(p, ref_softmax(x.astype(np.float32)), BF16)
    p16 = softmax_forward(x.astype(np.float32), out_dtype="bf16")
    assert p16.dtype == BF16


@pytest.mark.parametrize("scale,causal", [(1.0, False), (0.5, False), (0.8, True)])
def test_backward_vs_finite_differences(rng, scale, causal):
    T = 6
    x = rng.standard_normal((2, T, T))
    w = rng.standard_normal((2, T, T))  # loss = Σ w ⊙ softmax(x)

    def loss():
        return float((w * softmax_forward(x, scale=scale, causal=causal)).sum())

    p = softmax_forward(x, scale=scale, causal=causal)
    dx = softmax_backward(w, p, scale=scale, causal=causal)
    check_gradient(loss, x, dx, rtol=1e-7)


def test_backward_equals_explicit_jacobian(rng):
    """dx = J dp with J = diag(p) − p pᵀ: the kernel's formula never builds J, this test does."""
    x, dp = rng.standard_normal((2, 12))
    p = softmax_forward(x)
    J = np.diag(p) - np.outer(p, p)
    np.testing.assert_allclose(softmax_backward(dp, p), J @ dp, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(softmax_backward(dp[None], p[None])[0], ref_softmax_backward(dp, p), rtol=1e-12)


def test_backward_mixed_precision_numpy(rng):
    p = softmax_forward(rng.standard_normal((4, 40))).astype(BF16)
    dp = rng.standard_normal((4, 40)).astype(np.float32)
    dx = softmax_backward(dp, p)
    assert dx.dtype == BF16
    assert_close(dx, ref_softmax_backward(dp, p.astype(np.float32)), BF16)


def test_out_argument_numpy(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    out = poisoned((3, 8), np.float32, np)
    assert softmax_forward(x, out=out) is out
    assert_close(out, ref_softmax(x), rtol=1e-6)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="method"):
        softmax_forward(x, method="fast")
    with pytest.raises(ValueError, match="dp must have shape"):
        softmax_backward(np.zeros((4, 7), np.float32), x)
    with pytest.raises(TypeError, match="dp"):
        softmax_backward(np.zeros((4, 8), np.float16), x.astype(BF16))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        softmax_forward(np.zeros((8, 4), np.float32).T)
    with pytest.raises(ValueError, match="x is empty"):
        softmax_forward(np.zeros((3, 0), np.float32))
    with pytest.raises(TypeError, match="x has dtype int64"):
        softmax_forward(np.zeros((3, 4), np.int64))
    with pytest.raises(ValueError, match="causal softmax needs square"):
        softmax_forward(x, causal=True)
    with pytest.raises(ValueError, match="out must have shape"):
        softmax_forward(x, out=np.zeros((4, 7), np.float32))
    with pytest.raises(TypeError, match="out must be"):
        softmax_forward(x, out=np.zeros((4, 8), np.float16))
    with pytest.raises(TypeError, match="x must be a NumPy or CuPy array"):
        softmax_forward([[1.0, 2.0]])


# --------------------------------------------------------------------------- GPU kernels

GPU_SHAPES = [(3000, 1), (1003, 7), (777, 33), (130, 1000), (257, 1024), (9, 50257)]


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_forward(cp, rng, method, dtype, shape):
    x = random_array(rng, shape, dtype, cp, scale=2.0)
    out = poisoned(shape, dtype, cp)
    res = softmax_forward(x, method=method, out=out)
    assert res is out
    assert_close(out, ref_softmax(backend.to_numpy(x)), dtype, name=f"{method} forward")


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_backward(cp, rng, method, dtype, shape):
    p = cp.asarray(ref_softmax(rng.standard_normal(shape) * 2.0).astype(dtype))
    dp = random_array(rng, shape, dtype, cp)
    out = poisoned(shape, dtype, cp)
    softmax_backward(dp, p, method=method, out=out, scale=0.7)
    ref = ref_softmax_backward(backend.to_numpy(dp), backend.to_numpy(p), 0.7)
    assert_close(out, ref, dtype, name=f"{method} backward")


@pytest.mark.gpu
@pytest.mark.parametrize("method", KERNELS)
@pytest.mark.parametrize("T", [1, 5, 33, 64, 200])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_gpu_scaled_causal(cp, rng, method, T, dtype):
    x = random_array(rng, (3, T, T), dtype, cp, scale=4.0)
    p = poisoned(x.shape, dtype, cp)
    softmax_forward(x, method=method, out=p, scale=0.3, causal=True)
    ref = ref_softmax(backend.to_numpy(x), 0.3, causal=True)
    assert_close(p, ref, dtype, name=f"{method} causal forward")
    upper = np.triu(np.ones((T, T), bool), 1)
    assert np.all(backend.to_numpy(p)[:, upper] == 0)  # exactly zero, not just small
    dp_host = rng.standard_normal(x.shape)
    dp_host[:, upper] = np.nan  # the masked part of dp must never be read
    dp = cp.asarray(dp_host.astype(dtype))
    dx = poisoned(x.shape, dtype, cp)
    softmax_backward(dp, p, method=method, out=dx, scale=0.3, causal=True)
    dp_clean = np.nan_to_num(backend.to_numpy(dp).astype(np.float64))  # ml_dtypes bf16 has no nan_to_num
    dref = ref_softmax_backward(dp_clean, backend.to_numpy(p), 0.3, causal=True)
    # T = 1: p = 1 and dx = 0.3 (dp - dp) is a pure rounding residue (p's last bit decides it), so the
    # error is measured against the terms that cancel, not against the ~0 result
    scale = 0.3 * np.linalg.norm(dp_clean) if T == 1 else None
    assert_close(dx, dref, dtype, name=f"{method} causal backward", scale=scale)
    assert np.all(backend.to_numpy(dx)[:, upper] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("method", KERNELS)
@pytest.mark.parametrize("prob", [BF16, np.float16])
@pytest.mark.parametrize("cols", [7, 1024])
def test_gpu_fp32_scores_16bit_probs(cp, rng, method, prob, cols):
    x = random_array(rng, (65, cols), np.float32, cp, scale=3.0)
    p = poisoned(x.shape, prob, cp)
    softmax_forward(x, method=method, out=p, out_dtype=prob)
    assert_close(p, ref_softmax(backend.to_numpy(x)), prob)
    dp = random_array(rng, x.shape, np.float32, cp)
    dx = poisoned(x.shape, prob, cp)
    softmax_backward(dp, p, method=method, out=dx)
    assert_close(dx, ref_softmax_backward(backend.to_numpy(dp), backend.to_numpy(p).astype(np.float32)), prob)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_gpu_block_misaligned_falls_back_to_scalar(cp, rng, dtype):
    rows, cols = 40, 1024  # a multiple of the vector width: only the pointer offset forces the fallback
    base = random_array(rng, (rows * cols + 1,), dtype, cp, scale=2.0)
    x = base[1:].reshape(rows, cols)
    assert x.flags.c_contiguous and x.data.ptr % 16 != 0
    p = softmax_forward(x, method="block")
    assert_close(p, ref_softmax(backend.to_numpy(x)), dtype)
    gbase = random_array(rng, (rows * cols + 1,), dtype, cp)
    dp = gbase[1:].reshape(rows, cols)
    out = poisoned((rows * cols + 1,), dtype, cp)[1:].reshape(rows, cols)
    softmax_backward(dp, p, method="block", out=out)
    assert_close(out, ref_softmax_backward(backend.to_numpy(dp), backend.to_numpy(p)), dtype)


@pytest.mark.gpu
def test_gpu_methods_agree_and_large_inputs_stay_finite(cp, rng):
    x = random_array(rng, (64, 2048), np.float32, cp) + 5000.0
    outs = [softmax_forward(x, method=m) for m in KERNELS]
    for o in outs:
        assert rel_error(o, outs[0]) < 5e-6
    assert_close(outs[2], ref_softmax(backend.to_numpy(x)), np.float32)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp):
    x = cp.zeros((4, 8), np.float32)
    with pytest.raises(TypeError, match="x=cupy, out=ndarray"):
        softmax_forward(x, out=np.zeros((4, 8), np.float32))
    with pytest.raises(TypeError, match="dp=ndarray, p=cupy"):
        softmax_backward(np.zeros((4, 8), np.float32), x)
    with pytest.raises(TypeError, match="fp32, fp16, bf16"):
        softmax_forward(cp.zeros((4, 8), np.float64))
    with pytest.raises(TypeError, match="must share a dtype"):
        softmax_forward(x.astype(BF16), out_dtype=np.float16)
    with pytest.raises(ValueError, match="C-contiguous"):
        softmax_forward(cp.zeros((8, 4), np.float32).T)
