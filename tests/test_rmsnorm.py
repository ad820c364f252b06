"""RMSNorm forward/backward (Llama's normalization): reference vs float64 math and finite differences, the
non-finite rule, dweight buffers and accumulation, argument checks; CUDA kernels vs the reference and
determinism of dweight."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import rmsnorm as rms
from llmgpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3
GPU_DTYPES = ["fp32", "bf16", "fp16"]


def _inputs(rng, shape, dtype="fp32"):
    x = random_array(rng, shape, dtype, scale=2.0)
    w = random_array(rng, (shape[-1],), dtype)
    dy = random_array(rng, shape, dtype)
    return x, w, dy


def _hf_rmsnorm64(x, w, eps):
    """LlamaRMSNorm's math in float64: x * rsqrt(mean(x^2) + eps) * w."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_float64_formula(rng):
    x, w, _ = _inputs(rng, (9, 33))
    y, inv = rmsnorm_forward(x, w, eps=1e-5)
    assert y.dtype == np.float32 and inv.dtype == np.float32 and inv.shape == (9,)
    assert_close(y, _hf_rmsnorm64(x, w, 1e-5), "fp32")
    x64 = x.astype(np.float64)
    assert_close(inv, 1.0 / np.sqrt((x64 * x64).mean(axis=1) + 1e-5), "fp32")


def test_forward_leading_axes_and_eps(rng):
    x, w, _ = _inputs(rng, (2, 3, 8))
    y, inv = rmsnorm_forward(x, w)
    assert y.shape == (2, 3, 8) and inv.shape == (2, 3)
    y2, _ = rmsnorm_forward(x.reshape(6, 8), w)
    np.testing.assert_array_equal(y.reshape(6, 8), y2)
    tiny = np.full((1, 4), 1e-4, np.float32)  # mean(x^2) = 1e-8: eps dominates, so it is really added
    _, inv_eps = rmsnorm_forward(tiny, np.ones(4, np.float32), eps=1e-5)
    assert inv_eps[0] == pytest.approx(1.0 / np.sqrt(1e-8 + 1e-5), rel=1e-6)


def test_is_layernorm_without_mean_and_bias(rng):
    """For rows of mean 0, RMSNorm equals LayerNorm with beta = 0 (the two normalizations differ only by
    the mean): a cross-check against the chapter 3 op."""
    from llmgpu.ops.layernorm import layernorm_forward

    x = rng.standard_normal((5, 16))
    x -= x.mean(axis=1, keepdims=True)
    w = rng.standard_normal(16)
    y, inv = rmsnorm_forward(x, w)
    y_ln, _, rstd = layernorm_forward(x, w, np.zeros(16))
    np.testing.assert_allclose(y, y_ln, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(inv, rstd, rtol=1e-12)


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5), (4, 1)])
def test_backward_matches_finite_differences(rng, shape):
    x = rng.standard_normal(shape)
    w = rng.standard_normal(shape[-1])
    r = rng.standard_normal(shape)  # loss = sum(y * r), so dy = r

    def loss():
        return float((rmsnorm_forward(x, w)[0] * r).sum())

    _, inv = rmsnorm_forward(x, w)
    dx, dw = rmsnorm_backward(r, x, w, inv)
    check_gradient(loss, x, dx, name="dx")
    check_gradient(loss, w, dw, name="dweight")


def test_backward_closed_form_and_flat_statistic(rng):
    x, w, dy = (a.astype(np.float64) for a in _inputs(rng, (2, 3, 6)))
    _, inv = rmsnorm_forward(x, w)
    dx, dw = rmsnorm_backward(dy, x, w, inv)
    xhat, g = x * inv[..., None], dy * w
    np.testing.assert_allclose(dx, inv[..., None] * (g - xhat * (g * xhat).mean(-1, keepdims=True)), rtol=1e-13)
    np.testing.assert_allclose(dw, (dy * xhat).sum(axis=(0, 1)), rtol=1e-13)
    dx2, dw2 = rmsnorm_backward(dy, x, w, inv.reshape(-1))
    np.testing.assert_array_equal(dx, dx2)
    np.testing.assert_array_equal(dw, dw2)


def test_bf16_reference_computes_in_fp32(rng):
    x, w, dy = _inputs(rng, (5, 16), "bf16")
    y, inv = rmsnorm_forward(x, w)
    assert y.dtype == backend.bfloat16 and inv.dtype == np.float32
    assert_close(y, _hf_rmsnorm64(x.astype(np.float32), w.astype(np.float32), 1e-5), "bf16")
    dx, dw = rmsnorm_backward(dy, x, w, inv)
    assert dx.dtype == dw.dtype == backend.bfloat16


def test_dweight_buffers_and_accumulate(rng):
    x, w, dy = _inputs(rng, (7, 16), "bf16")
    _, inv = rmsnorm_forward(x, w)
    _, dw_ref = rms.rmsnorm_backward_reference(dy, x, w, inv)  # fp32 sums, not rounded
    g0 = random_array(rng, 16, "fp32")
    buf = g0.copy()
    out_dx = poisoned((7, 16), "bf16", np)
    dx, dw = rmsnorm_backward(dy, x, w, inv, dx=out_dx, dweight=buf, accumulate=True)
    assert dx is out_dx and dw is buf and np.all(np.isfinite(dx.astype(np.float32)))
    np.testing.assert_allclose(dw, g0 + dw_ref, rtol=1e-6, atol=1e-6)
    _, dw2 = rmsnorm_backward(dy, x, w, inv, dweight=np.full(16, np.nan, np.float32))  # overwritten
    np.testing.assert_allclose(dw2, dw_ref, rtol=1e-6)


def test_nonfinite_rule_reference():
    """NaN in a row: that row NaN; inf in a row: inv_rms 0, y 0 at finite entries and NaN at the inf; a
    finite square overflowing fp32 likewise gives 0; NaN in dy[r, c]: dx row r and dweight[c] NaN only."""
    x = np.ones((4, 4), np.float32)
    x[0, 1] = np.nan
    x[1, 2] = np.inf
    x[2, 3] = 3e19
    y, inv = rmsnorm_forward(x, np.ones(4, np.float32))
    assert np.isnan(y[0]).all() and np.isnan(inv[0])
    assert inv[1] == 0.0 and np.isnan(y[1, 2]) and (y[1, [0, 1, 3]] == 0.0).all()
    assert inv[2] == 0.0 and (y[2] == 0.0).all()
    np.testing.assert_allclose(y[3], 1.0 / np.sqrt(1.0 + 1e-5), rtol=1e-6)  # eps: 1e-5
    xf = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    _, invf = rmsnorm_forward(xf, np.ones(5, np.float32))
    dy = np.ones((3, 5), np.float32)
    dy[1, 2] = np.nan
    dx, dw = rmsnorm_backward(dy, xf, np.ones(5, np.float32), invf)
    assert np.isnan(dx[1]).all() and np.isfinite(dx[[0, 2]]).all()
    assert np.isnan(dw[2]) and np.isfinite(np.delete(dw, 2)).all()


def test_bad_inputs(rng):
    x, w, dy = _inputs(rng, (4, 6))
    _, inv = rmsnorm_forward(x, w)
    with pytest.raises(ValueError, match="x must be at least 2-D"):
        rmsnorm_forward(x[0], w)
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm_forward(x, w[:5].copy())
    with pytest.raises(TypeError, match="dtypes must match"):
        rmsnorm_forward(x, w.astype(np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm_forward(np.asfortranarray(x), w)
    with pytest.raises(TypeError, match="x has dtype"):
        rmsnorm_forward(x.astype(np.int32), w.astype(np.int32))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        rmsnorm_forward(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="out must have shape"):
        rmsnorm_forward(x, w, out=np.empty((4, 7), np.float32))
    with pytest.raises(ValueError, match="out overlaps x"):
        rmsnorm_forward(x, w, out=x)
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array"):
        rmsnorm_forward(x.tolist(), w)
    with pytest.raises(ValueError, match="dy must have shape"):
        rmsnorm_backward(dy[:3].copy(), x, w, inv)
    with pytest.raises(ValueError, match="inv_rms must have shape"):
        rmsnorm_backward(dy, x, w, inv[:3].copy())
    with pytest.raises(TypeError, match="inv_rms has dtype"):
        rmsnorm_backward(dy, x, w, inv.astype(np.float16))
    with pytest.raises(ValueError, match="accumulate=True adds into dweight"):
        rmsnorm_backward(dy, x, w, inv, accumulate=True)
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        rmsnorm_backward(dy, x, w, inv, accumulate="yes")
    xb, wb, dyb = (a.astype(backend.bfloat16) for a in (x, w, dy))
    with pytest.raises(TypeError, match="dweight must be bf16"):
        rmsnorm_backward(dyb, xb, wb, inv, dweight=np.zeros(6, np.float16))
    with pytest.raises(ValueError, match="dx overlaps dy"):
        rmsnorm_backward(dy, x, w, inv, dx=dy)


# --------------------------------------------------------------------------- GPU


def _to(cp, *arrays):
    return [cp.asarray(a) for a in arrays]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (5, 3, 64), (64, 768), (33, 1000), (8, 2048), (16, 4096),
                                   (3, 5120), (2, 13000)])
def test_gpu_matches_reference(cp, rng, dtype, shape):
    """Kernels vs reference, outputs poisoned. Shapes cover every path: registers (P = 1..8), shared-memory
    accumulators (C above 32 * 8 * W: 4096 fp32, 5120; 13000: one warp per block, opted in above 48 KB),
    the scalar fallback (C = 33). Tolerance: the dtype's (1e-5 fp32, 5e-3 fp16, 2e-2 bf16, relative norm)
    for y, dx, dweight; 1e-5 for inv_rms (fp32 in every case)."""
    x, w, dy = _inputs(rng, shape, dtype)
    y_ref, inv_ref = rmsnorm_forward(x, w)
    xd, wd, dyd = _to(cp, x, w, dy)
    y, inv = rmsnorm_forward(xd, wd, out=poisoned(shape, dtype, cp))
    assert inv.dtype == np.float32 and inv.shape == shape[:-1]
    assert_close(y, y_ref, dtype, name="y")
    assert_close(inv, inv_ref, rtol=1e-5, name="inv_rms")
    dx_ref, dw_ref = rmsnorm_backward(dy, x, w, inv_ref)
    dx, dw = rmsnorm_backward(dyd, xd, wd, inv, dx=poisoned(shape, dtype, cp),
                              dweight=poisoned((shape[-1],), dtype, cp))
    assert_close(dx, dx_ref, dtype, name="dx")
    assert_close(dw, dw_ref, dtype, name="dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_dweight_fp32_accumulate_and_deterministic(cp, rng, dtype):
    """Many rows per warp (n = 5000): fp32 dweight buffer, accumulate=True adds in fp32, and the same inputs
    give the same bits twice (fixed summation order, no atomics). Tolerance 1e-4 (relative norm): sums of
    5000 terms in fp32 in another order than NumPy's; a missing or doubled g0 is off by ~1."""
    n, c = 5000, 768
    x, w, dy = _inputs(rng, (n, c), dtype)
    xd, wd, dyd = _to(cp, x, w, dy)
    _, inv = rmsnorm_forward(xd, wd)
    _, dw_ref = rms.rmsnorm_backward_reference(dy, x, w, backend.to_numpy(inv))
    g0 = random_array(rng, c, "fp32")
    buf = cp.asarray(g0)
    _, dw = rmsnorm_backward(dyd, xd, wd, inv, dweight=buf, accumulate=True)
    assert dw is buf
    assert_close(dw, g0 + dw_ref, rtol=1e-4, name="dweight accumulated")
    a = rmsnorm_backward(dyd, xd, wd, inv, dweight=cp.zeros(c, cp.float32))
    b = rmsnorm_backward(dyd, xd, wd, inv, dweight=cp.zeros(c, cp.float32))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(backend.to_numpy(u).view(np.uint8), backend.to_numpy(v).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_unaligned_rows(cp, rng, dtype):
    """x one element off 16 bytes: the scalar kernels."""
    n, c = 9, 256
    x, w, dy = _inputs(rng, (n, c), dtype)
    buf = cp.empty(n * c + 1, dtype=x.dtype)
    buf[1:] = cp.asarray(x).ravel()
    xu = buf[1:].reshape(n, c)
    assert xu.data.ptr % 16 != 0
    y_ref, inv_ref = rmsnorm_forward(x, w)
    y, inv = rmsnorm_forward(xu, cp.asarray(w))
    assert_close(y, y_ref, dtype, name="y (unaligned)")
    dx, dw = rmsnorm_backward(cp.asarray(dy), xu, cp.asarray(w), inv)
    dx_ref, dw_ref = rmsnorm_backward(dy, x, w, inv_ref)
    assert_close(dx, dx_ref, dtype, name="dx (unaligned)")
    assert_close(dw, dw_ref, dtype, name="dweight (unaligned)")


@pytest.mark.gpu
@pytest.mark.parametrize("c", [64, 4096])
def test_gpu_nonfinite_like_reference(cp, c):
    x = np.ones((4, c), np.float32)
    x[0, 1] = np.nan
    x[1, 2] = np.inf
    x[2, 3] = 3e19
    w = np.ones(c, np.float32)
    y_ref, inv_ref = rmsnorm_forward(x, w)
    y, inv = (backend.to_numpy(a) for a in rmsnorm_forward(cp.asarray(x), cp.asarray(w)))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    np.testing.assert_array_equal(np.isnan(inv), np.isnan(inv_ref))
    ok = ~np.isnan(y_ref)
    np.testing.assert_allclose(y[ok], y_ref[ok], rtol=1e-6)
    np.testing.assert_array_equal(inv[:3][~np.isnan(inv_ref[:3])], inv_ref[:3][~np.isnan(inv_ref[:3])])


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    x, w, dy = _inputs(rng, (4, 8))
    xd, wd, dyd = _to(cp, x, w, dy)
    _, inv = rmsnorm_forward(xd, wd)
    with pytest.raises(TypeError, match="weight=ndarray|weight=numpy"):
        rmsnorm_forward(xd, w)
    with pytest.raises(TypeError, match="float64"):
        rmsnorm_forward(xd.astype(cp.float64), wd.astype(cp.float64))
    with pytest.raises(TypeError, match="inv_rms must be fp32 on the GPU path"):
        rmsnorm_backward(dyd, xd, wd, inv.astype(cp.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm_forward(cp.asfortranarray(xd), wd)
