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
    with pytest.raises(ValueError, match=r"inv_rms must have shape \(4,\), got \(3,\)$"):  # one shape, said once
        rmsnorm_backward(dy, x, w, inv[:3].copy())
    x3, dy3 = x.reshape(2, 2, 6), dy.reshape(2, 2, 6)
    with pytest.raises(ValueError, match=r"inv_rms must have shape \(2, 2\) or \(4,\), got \(3,\)$"):
        rmsnorm_backward(dy3, x3, w, inv[:3].copy())
    with pytest.raises(TypeError, match=r"dweight must be fp32 \(weight's dtype\), got float64$"):
        rmsnorm_backward(dy, x, w, inv, dweight=np.zeros(6, np.float64))
    with pytest.raises(TypeError, match="inv_rms has dtype"):
        rmsnorm_backward(dy, x, w, inv.astype(np.float16))
    with pytest.raises(ValueError, match="accumulate=True adds into dweight"):
        rmsnorm_backward(dy, x, w, inv, accumulate=True)
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        rmsnorm_backward(dy, x, w, inv, accumulate="yes")
    xb, wb, dyb = (a.astype(backend.bfloat16) for a in (x, w, dy))
    with pytest.raises(TypeError, match=r"dweight must be bf16 \(weight's dtype\) or fp32, got float16"):
        rmsnorm_backward(dyb, xb, wb, inv, dweight=np.zeros(6, np.float16))
    with pytest.raises(ValueError, match="dx overlaps dy"):
        rmsnorm_backward(dy, x, w, inv, dx=dy)


# --------------------------------------------------------------------------- fused residual forms (NumPy)


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
def test_add_rmsnorm_is_add_then_rmsnorm(rng, dtype):
    """s = x + a rounded to the dtype, then the norm of that rounded s: equal to the unfused pair."""
    x, w, _ = _inputs(rng, (2, 3, 10), dtype)
    a = random_array(rng, (2, 3, 10), dtype)
    s, y, inv = rms.add_rmsnorm_forward(x, a, w, 1e-5)
    s_ref = (x.astype(np.float64) + a.astype(np.float64)).astype(x.dtype)
    y_ref, inv_ref = rmsnorm_forward(s_ref, w, 1e-5)
    assert s.dtype == y.dtype == x.dtype and inv.shape == (2, 3)
    for u, v in ((s, s_ref), (y, y_ref), (inv, inv_ref)):
        np.testing.assert_array_equal(u, v)


def test_add_rmsnorm_in_place_and_out(rng):
    x, w, _ = _inputs(rng, (5, 12))
    a = random_array(rng, (5, 12))
    s_ref, y_ref, _ = rms.add_rmsnorm_forward(x, a, w)
    x0 = x.copy()
    out = poisoned((5, 12), "fp32", np)
    s, y, _ = rms.add_rmsnorm_forward(x, a, w, residual_out=a, out=out)
    assert s is a and y is out
    np.testing.assert_array_equal(a, s_ref)
    np.testing.assert_array_equal(out, y_ref)
    np.testing.assert_array_equal(x, x0)  # x, the stream a model keeps, is untouched


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5)])
def test_fused_backward_finite_differences(rng, shape):
    """loss = sum(y * r) + sum(s * q) with (s, y) = add_rmsnorm(x, a): d/dx = d/da = the norm's backward at s
    with dresidual = q (the residual branch's gradient), checked by fp64 central differences."""
    x, a, r, q = (rng.standard_normal(shape) for _ in range(4))
    w = rng.standard_normal(shape[-1])

    def loss():
        s, y, _ = rms.add_rmsnorm_forward(x, a, w)
        return float((y * r).sum() + (s * q).sum())

    s, _, inv = rms.add_rmsnorm_forward(x, a, w)
    dx, dw = rmsnorm_backward(r, s, w, inv, dresidual=q)
    check_gradient(loss, x, dx, name="dx (with dresidual)")
    check_gradient(loss, a, dx, name="da (with dresidual)")
    check_gradient(loss, w, dw, name="dweight")
    dx0, dw0 = rmsnorm_backward(r, s, w, inv)
    np.testing.assert_allclose(dx, dx0 + q, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(dw, dw0)


def test_fused_backward_in_place_rounds_once(rng):
    """dx written over dresidual; bf16: the sum in fp32, rounded once (not the rounded dx plus dresidual)."""
    x, w, dy = _inputs(rng, (6, 16), "bf16")
    dres = random_array(rng, (6, 16), "bf16")
    _, inv = rmsnorm_forward(x, w)
    gx, _ = rms.rmsnorm_backward_reference(dy, x, w, inv)
    want = (gx + dres.astype(np.float32)).astype(backend.bfloat16)
    buf = dres.copy()
    dx, _ = rmsnorm_backward(dy, x, w, inv, dresidual=buf, dx=buf)
    assert dx is buf
    np.testing.assert_array_equal(dx.view(np.uint16), want.view(np.uint16))


def test_fused_nonfinite_rule_reference():
    """A NaN in a makes that row of s's norm NaN; NaN in dresidual[r, c] makes dx[r, c] NaN alone."""
    x = np.ones((3, 4), np.float32)
    a = np.zeros((3, 4), np.float32)
    a[0, 2] = np.nan
    s, y, inv = rms.add_rmsnorm_forward(x, a, np.ones(4, np.float32))
    assert np.isnan(s[0, 2]) and np.isfinite(np.delete(s[0], 2)).all()
    assert np.isnan(y[0]).all() and np.isnan(inv[0]) and np.isfinite(y[1:]).all()
    xf = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    _, invf = rmsnorm_forward(xf, np.ones(5, np.float32))
    dres = np.zeros((3, 5), np.float32)
    dres[1, 2] = np.nan
    dx, dw = rmsnorm_backward(np.ones((3, 5), np.float32), xf, np.ones(5, np.float32), invf, dresidual=dres)
    assert np.isnan(dx[1, 2]) and np.isfinite(np.delete(dx.ravel(), 1 * 5 + 2)).all() and np.isfinite(dw).all()


def test_fused_bad_inputs(rng):
    x, w, dy = _inputs(rng, (4, 6))
    a = random_array(rng, (4, 6))
    _, inv = rmsnorm_forward(x, w)
    with pytest.raises(ValueError, match="a must have shape"):
        rms.add_rmsnorm_forward(x, a[:3].copy(), w)
    with pytest.raises(TypeError, match="dtypes must match"):
        rms.add_rmsnorm_forward(x, a.astype(np.float64), w)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        rms.add_rmsnorm_forward(x, a, w, -1.0)
    with pytest.raises(ValueError, match="residual_out overlaps x"):
        rms.add_rmsnorm_forward(x, a, w, residual_out=x)
    buf = np.zeros(4 * 6 + 1, np.float32)
    with pytest.raises(ValueError, match="residual_out overlaps a without being the same buffer"):
        rms.add_rmsnorm_forward(x, buf[1:].reshape(4, 6), w, residual_out=buf[:-1].reshape(4, 6))
    with pytest.raises(ValueError, match="out overlaps a"):
        rms.add_rmsnorm_forward(x, a, w, out=a)
    with pytest.raises(ValueError, match="out overlaps residual_out"):
        s = np.empty((4, 6), np.float32)
        rms.add_rmsnorm_forward(x, a, w, residual_out=s, out=s)
    with pytest.raises(ValueError, match="residual_out must have shape"):
        rms.add_rmsnorm_forward(x, a, w, residual_out=np.empty((4, 7), np.float32))
    dres = random_array(rng, (4, 6))
    with pytest.raises(ValueError, match="dresidual must have shape"):
        rmsnorm_backward(dy, x, w, inv, dresidual=dres[:3].copy())
    with pytest.raises(TypeError, match="dtypes must match"):
        rmsnorm_backward(dy, x, w, inv, dresidual=dres.astype(np.float64))
    with pytest.raises(ValueError, match="dx overlaps dresidual without being the same buffer"):
        rmsnorm_backward(dy, x, w, inv, dresidual=buf[1:].reshape(4, 6), dx=buf[:-1].reshape(4, 6))
    with pytest.raises(ValueError, match="dweight overlaps dresidual"):
        rmsnorm_backward(dy, x, w, inv, dresidual=dres, dweight=dres.reshape(-1)[:6])


def test_traffic_bytes_of_the_fused_forms():
    n, c = 10, 8
    assert rms.traffic_bytes(n, c, "bf16") == 2 * n * c * 2 + 4 * n
    assert rms.traffic_bytes(n, c, "bf16", residual=True) == 4 * n * c * 2 + 4 * n  # x, a in; s, y out
    assert rms.traffic_bytes(n, c, "bf16", backward=True, residual=True) == 4 * n * c * 2 + 4 * n


# --------------------------------------------------------------------------- GPU


def _to(cp, *arrays):
    return [cp.asarray(a) for a in arrays]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (5, 3, 64), (64, 768), (33, 1000), (8, 2048), (16, 4096),
                                   (3, 5120), (2, 13000)])
@pytest.mark.parametrize("method", rms.METHODS)
def test_gpu_matches_reference(cp, rng, dtype, shape, method):
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
                              dweight=poisoned((shape[-1],), dtype, cp), method=method)
    assert_close(dx, dx_ref, dtype, name="dx")
    assert_close(dw, dw_ref, dtype, name="dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("method", rms.METHODS)
def test_gpu_dweight_fp32_accumulate_and_deterministic(cp, rng, dtype, method):
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
    _, dw = rmsnorm_backward(dyd, xd, wd, inv, dweight=buf, accumulate=True, method=method)
    assert dw is buf
    assert_close(dw, g0 + dw_ref, rtol=1e-4, name="dweight accumulated")
    a = rmsnorm_backward(dyd, xd, wd, inv, dweight=cp.zeros(c, cp.float32), method=method)
    b = rmsnorm_backward(dyd, xd, wd, inv, dweight=cp.zeros(c, cp.float32), method=method)
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


def _bits(a):
    a = backend.to_numpy(a)
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(7, 576), (5, 960), (3, 33), (2, 3, 1000), (9, 2048), (3, 4096), (2, 13000)])
def test_gpu_add_rmsnorm_bitwise_the_unfused_pair(cp, rng, dtype, shape):
    """s, y, inv_rms of the fused kernel are the bits of a CuPy add in the dtype followed by rmsnorm_forward,
    on every variant (registers P = 3, 4, 8 ...; the re-read P = 0 above 32 * 8 * W; the scalar fallback,
    C = 33), outputs poisoned, then again in place (residual_out=a)."""
    x, w, _ = (cp.asarray(t) for t in _inputs(rng, shape, dtype))
    a = cp.asarray(random_array(rng, shape, dtype))
    s_ref = cp.add(x, a)
    y_ref, inv_ref = rmsnorm_forward(s_ref, w)
    s, y, inv = rms.add_rmsnorm_forward(x, a, w, residual_out=poisoned(shape, dtype, cp),
                                        out=poisoned(shape, dtype, cp))
    for name, u, v in (("s", s, s_ref), ("y", y, y_ref), ("inv_rms", inv, inv_ref)):
        np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=name)
    x0 = x.copy()
    s2, y2, inv2 = rms.add_rmsnorm_forward(x, a, w, residual_out=a)
    assert s2 is a
    for name, u, v in (("s in place", s2, s_ref), ("y in place", y2, y_ref), ("inv in place", inv2, inv_ref)):
        np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=name)
    np.testing.assert_array_equal(_bits(x), _bits(x0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(7, 576), (5, 960), (3, 33), (2, 3, 1000), (9, 2048), (3, 4096), (2, 13000),
                                   (300, 960)])
@pytest.mark.parametrize("method", rms.METHODS)
def test_gpu_backward_with_dresidual(cp, rng, dtype, shape, method):
    """dx = the norm's gradient + dresidual, rounded once, on every variant (16-bit C = 2048: P = 8, the one that
    loads dresidual pack by pack; "fast": P = 3, 4, 4, 6, the rest its fallback). dweight: the bits of the plain
    backward ("optimized"; "fast" with dresidual may run another grid, so another fixed order: close). dresidual =
    0: the plain dx bit for bit. fp32: bitwise the backward followed by an add; fp16/bf16: within one rounding of
    that pair, and as close to the fp64 reference as the dtype allows. Then in place (dx=dresidual)."""
    x, w, dy = _inputs(rng, shape, dtype)
    dres = random_array(rng, shape, dtype)
    xd, wd, dyd, dresd = _to(cp, x, w, dy, dres)
    _, inv = rmsnorm_forward(xd, wd)
    dx0, dw0 = rmsnorm_backward(dyd, xd, wd, inv, method=method)
    dx, dw = rmsnorm_backward(dyd, xd, wd, inv, dresidual=dresd, dx=poisoned(shape, dtype, cp),
                              dweight=poisoned((shape[-1],), dtype, cp), method=method)
    if method == "optimized":
        np.testing.assert_array_equal(_bits(dw), _bits(dw0))
    else:
        assert_close(dw, dw0, dtype, name="dweight with dresidual")
    dxz, _ = rmsnorm_backward(dyd, xd, wd, inv, dresidual=cp.zeros_like(dresd), method=method)
    np.testing.assert_array_equal(_bits(dxz), _bits(dx0))
    pair = cp.add(dx0, dresd)
    if dtype == "fp32":
        np.testing.assert_array_equal(_bits(dx), _bits(pair))
    else:
        f = (backend.to_numpy(t).astype(np.float64) for t in (dx, pair, dx0, dresd))
        fused, unfused, d0, r = f
        eps = float(np.finfo(np.float16).eps) if dtype == "fp16" else 2.0 ** -7
        assert np.all(np.abs(fused - unfused) <= 2 * eps * (np.abs(d0) + np.abs(r)))  # <= 3 unit roundoffs
    C = shape[-1]  # the reference takes rows [N, C]
    gx, _ = rms.rmsnorm_backward_reference(*(a.astype(np.float64).reshape(-1, C) for a in (dy, x)),
                                           w.astype(np.float64), backend.to_numpy(inv).astype(np.float64).ravel(),
                                           dres.astype(np.float64).reshape(-1, C))
    assert_close(dx, gx.reshape(shape), dtype, name="dx with dresidual")
    buf = dresd.copy()
    dx2, _ = rmsnorm_backward(dyd, xd, wd, inv, dresidual=buf, dx=buf, method=method)
    assert dx2 is buf
    np.testing.assert_array_equal(_bits(dx2), _bits(dx))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_fused_unaligned_takes_the_scalar_kernels(cp, rng, dtype):
    """a one element off 16 bytes: the fused forward and the residual backward run the scalar kernels and agree
    with the reference (the unfused pair on aligned buffers takes the vector kernels: other sum orders, so no
    bitwise claim here)."""
    n, c = 9, 256
    x, w, dy = _inputs(rng, (n, c), dtype)
    a = random_array(rng, (n, c), dtype)
    buf = cp.empty(n * c + 1, dtype=x.dtype)
    buf[1:] = cp.asarray(a).ravel()
    au = buf[1:].reshape(n, c)
    s_ref, y_ref, inv_ref = rms.add_rmsnorm_forward(x, a, w)
    s, y, inv = rms.add_rmsnorm_forward(cp.asarray(x), au, cp.asarray(w), residual_out=au)
    np.testing.assert_array_equal(_bits(s), _bits(s_ref))
    assert_close(y, y_ref, dtype, name="y (unaligned)")
    dx, _ = rmsnorm_backward(cp.asarray(dy), s.copy(), cp.asarray(w), inv, dresidual=au, dx=au)
    gx, _ = rms.rmsnorm_backward_reference(dy, s_ref, w, inv_ref, s_ref)
    assert_close(dx, gx, dtype, name="dx (unaligned, in place)")


@pytest.mark.gpu
@pytest.mark.parametrize("c", [64, 4096])
def test_gpu_fused_nonfinite_like_the_pair(cp, c):
    """NaN and inf rows through the fused forward give the unfused pair's bits (NaN positions included); a NaN
    in dresidual[r, c] makes dx[r, c] NaN alone."""
    x = np.ones((4, c), np.float32)
    a = np.zeros((4, c), np.float32)
    x[0, 1] = np.nan
    a[1, 2] = np.inf
    a[2, 3] = 3e19
    xd, ad, wd = cp.asarray(x), cp.asarray(a), cp.ones(c, cp.float32)
    s_ref = cp.add(xd, ad)
    y_ref, inv_ref = rmsnorm_forward(s_ref, wd)
    s, y, inv = rms.add_rmsnorm_forward(xd, ad, wd)
    for u, v in ((s, s_ref), (y, y_ref), (inv, inv_ref)):
        np.testing.assert_array_equal(_bits(u), _bits(v))
    assert np.isnan(backend.to_numpy(y)[0]).all()
    xf = cp.asarray(np.random.default_rng(2).standard_normal((3, c)).astype(np.float32))
    _, invf = rmsnorm_forward(xf, wd)
    dres = cp.zeros((3, c), cp.float32)
    dres[1, 2] = cp.nan
    dx = backend.to_numpy(rmsnorm_backward(cp.ones((3, c), cp.float32), xf, wd, invf, dresidual=dres)[0])
    assert np.isnan(dx[1, 2]) and np.isfinite(np.delete(dx.ravel(), c + 2)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("c", [576, 960, 1536])
@pytest.mark.parametrize("res", [False, True])
def test_gpu_fast_backward_agrees_with_optimized_and_repeats(cp, rng, dtype, c, res):
    """Llama's rows (C = 576, 960: SmolLM-135M/360M; 1536: P = 6, the longest "fast" takes), more rows than one
    wave of warps (4000: two rows in flight, several per warp): "fast" dx within one rounding of "optimized"
    (the same expressions; equal unless the compiler contracts them differently), dweight in fp32 within 1e-5
    of it (another fixed order), and the same bits on a second run; the grid is the plan's."""
    n = 4000
    x, w, dy = _to(cp, *_inputs(rng, (n, c), dtype))
    dres = cp.asarray(random_array(rng, (n, c), dtype)) if res else None
    _, inv = rmsnorm_forward(x, w)
    assert rms.fast_backward_plan(n, c, dtype, residual=res, xp=cp) is not None
    runs = []
    for method in ("optimized", "fast", "fast"):
        runs.append(rmsnorm_backward(dy, x, w, inv, dresidual=dres, dweight=cp.zeros(c, cp.float32), method=method))
    (dx_o, dw_o), (dx_f, dw_f), (dx_f2, dw_f2) = runs
    a, b = (backend.to_numpy(t).astype(np.float64) for t in (dx_f, dx_o))
    eps = float(np.finfo(np.float16).eps) if dtype == "fp16" else 2.0 ** -7
    assert np.all(np.abs(a - b) <= eps * np.abs(b) + 1e-6)
    assert_close(dw_f, dw_o, rtol=1e-5, name="dweight fast vs optimized")
    np.testing.assert_array_equal(_bits(dx_f2), _bits(dx_f))
    np.testing.assert_array_equal(_bits(dw_f2), _bits(dw_f))


def test_fast_backward_plan_refuses_rows_it_does_not_take():
    """fp32, C not a multiple of 8, rows longer than FAST_PACKS[-1] packs per lane: None (the caller runs
    "optimized"); decided before any kernel is fetched, so on any backend."""
    assert rms.fast_backward_plan(10, 960, "fp32", xp=np) is None
    assert rms.fast_backward_plan(10, 964, "bf16", xp=np) is None
    assert rms.fast_backward_plan(10, 32 * 8 * rms.FAST_PACKS[-1] + 8, "bf16", xp=np) is None
    assert rms.FAST_PACKS == (1, 2, 3, 4, 5, 6) and rms.BACKWARD_METHOD in rms.METHODS


def test_backward_method_checked_and_numpy_runs_the_reference(rng):
    x, w, dy = _inputs(rng, (6, 16))
    _, inv = rmsnorm_forward(x, w)
    want = rmsnorm_backward(dy, x, w, inv)
    for method in rms.METHODS:
        got = rmsnorm_backward(dy, x, w, inv, method=method)
        for u, v in zip(got, want):
            np.testing.assert_array_equal(u, v)
    with pytest.raises(ValueError, match="method"):
        rmsnorm_backward(dy, x, w, inv, method="naive")


def test_llama_kernels_benchmark_runs_quick(capsys, tmp_path):
    """benchmarks/bench_ch10_llama_kernels.py --quick (NumPy on a CPU, small rows on a GPU): every case timed, both
    backward methods compared, the JSON written where --out says."""
    import json
    import runpy
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        main = runpy.run_path(str(Path(bench_dir) / "bench_ch10_llama_kernels.py"), run_name="bench")["main"]
        assert main(["--quick", "--reps", "2", "--rounds", "1", "--out", str(tmp_path / "k.json")]) == 0
    finally:
        sys.path.remove(bench_dir)
    data = json.loads((tmp_path / "k.json").read_text())
    ops = {(r["op"], r["method"]) for r in data["rows"]}
    assert {("rmsnorm+residual bwd", m) for m in rms.METHODS} <= ops and ("rope q,k bwd", "fast") in ops
    assert data["fast_vs_optimized"]["dx_max_rel_diff"] < 1e-2
    assert "fast speedup over optimized" in capsys.readouterr().out
