"""LayerNorm forward/backward (chapter 3): NumPy reference vs float64 math and finite differences,
CUDA kernels vs the reference, determinism of dgamma/dbeta, argument checks."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import layernorm as ln
from llmgpu.ops.layernorm import METHODS, add_layernorm_forward, layernorm_backward, layernorm_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array, tolerance

pytestmark = pytest.mark.ch3


def _inputs(rng, n, c, dtype="fp32", lead=None):
    shape = (n, c) if lead is None else (*lead, c)
    x = random_array(rng, shape, dtype, scale=2.0) + np.asarray(0.5, dtype=backend.resolve_dtype(dtype))
    gamma = random_array(rng, (c,), dtype)
    beta = random_array(rng, (c,), dtype)
    dy = random_array(rng, shape, dtype)
    return x, gamma, beta, dy


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_float64_formula(rng):
    x, gamma, beta, _ = _inputs(rng, 9, 33)
    y, mean, rstd = layernorm_forward(x, gamma, beta, eps=1e-5)
    xd = x.astype(np.float64)
    mu = xd.mean(axis=1, keepdims=True)
    var = ((xd - mu) ** 2).mean(axis=1, keepdims=True)
    ref = (xd - mu) / np.sqrt(var + 1e-5) * gamma + beta
    assert y.dtype == np.float32 and mean.dtype == np.float32 and rstd.dtype == np.float32
    assert mean.shape == (9,) and rstd.shape == (9,)
    assert_close(y, ref, "fp32")
    assert_close(mean, mu[:, 0], "fp32")
    assert_close(rstd, 1 / np.sqrt(var[:, 0] + 1e-5), "fp32")


def test_forward_leading_axes(rng):
    x, gamma, beta, _ = _inputs(rng, None, 8, lead=(2, 3))
    y, mean, rstd = layernorm_forward(x, gamma, beta)
    assert y.shape == (2, 3, 8) and mean.shape == (2, 3) and rstd.shape == (2, 3)
    y2, _, _ = layernorm_forward(x.reshape(6, 8), gamma, beta)
    np.testing.assert_array_equal(y.reshape(6, 8), y2)


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5), (4, 1)])
def test_backward_matches_finite_differences(rng, shape):
    c = shape[-1]
    x = rng.standard_normal(shape)
    gamma = rng.standard_normal(c)
    beta = rng.standard_normal(c)
    r = rng.standard_normal(shape)  # loss = sum(y * r), so dy = r

    def loss():
        return float((layernorm_forward(x, gamma, beta)[0] * r).sum())

    _, mean, rstd = layernorm_forward(x, gamma, beta)
    dx, dgamma, dbeta = layernorm_backward(r, x, gamma, mean, rstd)
    check_gradient(loss, x, dx, name="dx")
    check_gradient(loss, gamma, dgamma, name="dgamma")
    check_gradient(loss, beta, dbeta, name="dbeta")


def test_backward_accepts_flat_statistics(rng):
    x, gamma, beta, dy = _inputs(rng, None, 6, lead=(2, 3))
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    a = layernorm_backward(dy, x, gamma, mean, rstd)
    b = layernorm_backward(dy, x, gamma, mean.reshape(-1), rstd.reshape(-1))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_bf16_reference_computes_in_fp32(rng):
    x, gamma, beta, dy = _inputs(rng, 5, 16, "bf16")
    y, mean, rstd = layernorm_forward(x, gamma, beta)
    assert y.dtype == backend.bfloat16 and mean.dtype == np.float32
    y32, _, _ = layernorm_forward(x.astype(np.float32), gamma.astype(np.float32), beta.astype(np.float32))
    assert_close(y, y32, "bf16")
    dx, dg, db = layernorm_backward(dy, x, gamma, mean, rstd)
    assert dx.dtype == dg.dtype == db.dtype == backend.bfloat16


def test_out_buffer_numpy(rng):
    x, gamma, beta, _ = _inputs(rng, 4, 5)
    out = poisoned((4, 5), "fp32", np)
    y, _, _ = layernorm_forward(x, gamma, beta, out=out)
    assert y is out and np.all(np.isfinite(out))


# --------------------------------------------------------------------------- bad input


def test_bad_inputs(rng):
    x, gamma, beta, dy = _inputs(rng, 4, 6)
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    with pytest.raises(ValueError, match="x must be at least 2-D"):
        layernorm_forward(x[0], gamma, beta)
    with pytest.raises(ValueError, match="gamma"):
        layernorm_forward(x, gamma[:5].copy(), beta)
    with pytest.raises(ValueError, match="beta"):
        layernorm_forward(x, gamma, np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="dtypes must match"):
        layernorm_forward(x, gamma.astype(np.float64), beta)
    with pytest.raises(ValueError, match="C-contiguous"):
        layernorm_forward(np.asfortranarray(x), gamma, beta)
    with pytest.raises(TypeError, match="x has dtype"):
        layernorm_forward(x.astype(np.int32), gamma, beta)
    with pytest.raises(ValueError, match="method"):
        layernorm_forward(x, gamma, beta, method="fastest")
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        layernorm_forward(x, gamma, beta, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite and >= 0.0, got inf"):  # every row would be 0
        layernorm_forward(x, gamma, beta, eps=float("inf"))
    with pytest.raises(TypeError, match="eps must be a real number, got str"):  # float("1e-5") took it
        layernorm_forward(x, gamma, beta, eps="1e-5")
    with pytest.raises(ValueError, match="out"):
        layernorm_forward(x, gamma, beta, out=np.empty((4, 7), np.float32))
    with pytest.raises(ValueError, match="dy"):
        layernorm_backward(dy[:3].copy(), x, gamma, mean, rstd)
    with pytest.raises(ValueError, match="mean"):
        layernorm_backward(dy, x, gamma, mean[:3].copy(), rstd)
    with pytest.raises(TypeError, match="rstd"):
        layernorm_backward(dy, x, gamma, mean, rstd.astype(np.float16))
    with pytest.raises(TypeError, match="must all be NumPy arrays or all CuPy|must be a NumPy or CuPy array"):
        layernorm_forward(x.tolist(), gamma, beta)


# --------------------------------------------------------------------------- fused variants (NumPy)


def _bits(a):
    """The raw bits of an array (NumPy or CuPy), for bitwise comparisons."""
    a = np.ascontiguousarray(backend.to_numpy(a))
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def test_add_layernorm_is_rounded_add_then_layernorm(rng):
    for dtype in ("fp32", "bf16", "fp16"):
        a, gamma, beta, b = _inputs(rng, 6, 40, dtype)
        s, y, mean, rstd = add_layernorm_forward(a, b, gamma, beta, eps=1e-5)
        want_s = (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)  # rounded to storage first
        np.testing.assert_array_equal(_bits(s), _bits(want_s))
        want = layernorm_forward(want_s, gamma, beta, eps=1e-5)  # from the ROUNDED s
        for got, ref in zip((y, mean, rstd), want):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_add_layernorm_gradients_finite_differences(rng):
    """loss = sum(y * r) + sum(s * q): d/da = d/db = LN backward(r) + q (dresidual), through a and b."""
    shape, c = (2, 3, 5), 5
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(c), rng.standard_normal(c)
    r, q = rng.standard_normal(shape), rng.standard_normal(shape)

    def loss():
        s, y, _, _ = add_layernorm_forward(a, b, gamma, beta)
        return float((y * r).sum() + (s * q).sum())

    s, _, mean, rstd = add_layernorm_forward(a, b, gamma, beta)
    dx, dgamma, dbeta = layernorm_backward(r, s, gamma, mean, rstd, dresidual=q)
    check_gradient(loss, a, dx, name="da")
    check_gradient(loss, b, dx, name="db")
    check_gradient(loss, gamma, dgamma, name="dgamma")
    check_gradient(loss, beta, dbeta, name="dbeta")


def test_add_layernorm_out_buffers_and_in_place(rng):
    a, gamma, beta, b = _inputs(rng, None, 12, "bf16", lead=(2, 3))
    ref = add_layernorm_forward(a, b, gamma, beta)
    for target in ("a", "b"):
        a2, b2 = a.copy(), b.copy()
        res = a2 if target == "a" else b2
        y_out = poisoned(a.shape, "bf16", np)
        s, y, mean, rstd = add_layernorm_forward(a2, b2, gamma, beta, residual_out=res, out=y_out)
        assert s is res and y is y_out and mean.shape == (2, 3)
        for got, want in zip((s, y, mean, rstd), ref):
            np.testing.assert_array_equal(_bits(got), _bits(want))


def test_backward_dresidual_and_in_place(rng):
    x, gamma, beta, dy = _inputs(rng, 5, 24)
    dres = random_array(rng, (5, 24), "fp32")
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    plain = layernorm_backward(dy, x, gamma, mean, rstd)
    dx, dg, db = layernorm_backward(dy, x, gamma, mean, rstd, dresidual=dres)
    np.testing.assert_allclose(dx, plain[0] + dres, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(dg, plain[1])
    np.testing.assert_array_equal(db, plain[2])
    buf = dres.copy()
    dx2, _, _ = layernorm_backward(dy, x, gamma, mean, rstd, dresidual=buf, dx_out=buf)
    assert dx2 is buf
    np.testing.assert_array_equal(dx2, dx)
    # bf16: dx = round(LN backward + dresidual), one rounding of the fp32 sum
    xb, gb, bb, dyb = _inputs(rng, 4, 16, "bf16")
    dresb = random_array(rng, (4, 16), "bf16")
    _, mb, rb = layernorm_forward(xb, gb, bb)
    dxb, _, _ = layernorm_backward(dyb, xb, gb, mb, rb, dresidual=dresb)
    f32 = [a.astype(np.float32) for a in (dyb, xb, gb)]
    want = ln.layernorm_backward_reference(*f32, mb, rb, dresidual=dresb.astype(np.float32))[0]
    np.testing.assert_array_equal(_bits(dxb), _bits(want.astype(xb.dtype)))


def test_backward_accumulate_params(rng):
    x, gamma, beta, dy = _inputs(rng, 7, 16, "bf16")
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    f32 = [a.astype(np.float32) for a in (dy, x, gamma)]
    _, dg_ref, db_ref = ln.layernorm_backward_reference(*f32, mean, rstd)  # fp32 sums, not rounded to bf16
    g0 = random_array(rng, 16, "fp32")
    b0 = random_array(rng, 16, "fp32")
    dg_buf, db_buf = g0.copy(), b0.copy()
    _, dg, db = layernorm_backward(dy, x, gamma, mean, rstd, dgamma_out=dg_buf, dbeta_out=db_buf,
                                   accumulate_params=True)
    assert dg is dg_buf and db is db_buf and dg.dtype == np.float32
    np.testing.assert_allclose(dg, g0 + dg_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(db, b0 + db_ref, rtol=1e-6, atol=1e-6)
    # fp32 buffers without accumulation: overwritten with the unrounded fp32 sums
    _, dg2, db2 = layernorm_backward(dy, x, gamma, mean, rstd, dgamma_out=np.zeros(16, np.float32),
                                     dbeta_out=np.zeros(16, np.float32))
    np.testing.assert_allclose(dg2, dg_ref, rtol=1e-6)
    # buffers in gamma's dtype accumulate too (sum in fp32, rounded once)
    gb = g0.astype(backend.bfloat16)
    _, dg3, _ = layernorm_backward(dy, x, gamma, mean, rstd, dgamma_out=gb, dbeta_out=np.zeros(16, gb.dtype),
                                   accumulate_params=True)
    assert dg3 is gb
    assert_close(dg3, g0.astype(backend.bfloat16).astype(np.float32) + dg_ref, "bf16")


def test_traffic_bytes_fused():
    n, c = 10, 8
    assert ln.traffic_bytes(n, c, "bf16", residual=True) - ln.traffic_bytes(n, c, "bf16") == 2 * n * c * 2
    assert (ln.traffic_bytes(n, c, "fp32", backward=True, residual=True)
            - ln.traffic_bytes(n, c, "fp32", backward=True)) == n * c * 4


def test_fast_backward_takes_every_preset_width_in_16_bit():
    """Every GPT preset's width runs the fast backward in bf16/fp16, not the fallback: C = 1280 and 1600 once
    fell back to the "optimized" kernels plus separate residual and accumulation passes (8x slower on the H200)."""
    from llmgpu.model.config import PRESETS

    for name, cfg in PRESETS.items():
        for dtype in ("bf16", "fp16"):
            assert ln._fast_packs(cfg.n_embd, backend.resolve_dtype(dtype), ()) is not None, (name, cfg.n_embd)


def test_accumulators_argument(rng):
    """accumulators= is checked on every path; the NumPy reference has no kernels, so it gives the same result."""
    x, gamma, beta, dy = _inputs(rng, 5, 8)
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    want = layernorm_backward(dy, x, gamma, mean, rstd)
    for acc in ln.ACCUMULATORS:
        for g, e in zip(layernorm_backward(dy, x, gamma, mean, rstd, accumulators=acc), want):
            np.testing.assert_array_equal(g, e)
    with pytest.raises(ValueError, match="accumulators must be one of"):
        layernorm_backward(dy, x, gamma, mean, rstd, accumulators="smem")

def test_fused_bad_inputs(rng):
    x, gamma, beta, dy = _inputs(rng, 4, 6)
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    with pytest.raises(ValueError, match="dresidual"):
        layernorm_backward(dy, x, gamma, mean, rstd, dresidual=dy[:3].copy())
    with pytest.raises(TypeError, match="dtypes must match"):
        layernorm_backward(dy, x, gamma, mean, rstd, dresidual=dy.astype(np.float64))
    with pytest.raises(ValueError, match="dresidual must be C-contiguous"):
        layernorm_backward(dy, x, gamma, mean, rstd, dresidual=np.asfortranarray(dy))
    buf = np.zeros(4 * 6 + 1, np.float32)
    with pytest.raises(ValueError, match="dx_out overlaps dresidual"):
        layernorm_backward(dy, x, gamma, mean, rstd, dresidual=buf[:24].reshape(4, 6), dx_out=buf[1:].reshape(4, 6))
    with pytest.raises(ValueError, match="accumulate_params"):
        layernorm_backward(dy, x, gamma, mean, rstd, accumulate_params=True, dgamma_out=np.zeros(6, np.float32))
    with pytest.raises(TypeError, match="accumulate_params"):
        layernorm_backward(dy, x, gamma, mean, rstd, accumulate_params="yes")
    xb, gb = x.astype(backend.bfloat16), gamma.astype(backend.bfloat16)
    with pytest.raises(TypeError, match="dgamma_out must be bf16"):
        layernorm_backward(dy.astype(xb.dtype), xb, gb, mean, rstd, dgamma_out=np.zeros(6, np.float16))
    with pytest.raises(TypeError, match="share one dtype"):
        layernorm_backward(dy.astype(xb.dtype), xb, gb, mean, rstd, dgamma_out=np.zeros(6, np.float32),
                           dbeta_out=np.zeros(6, xb.dtype))
    with pytest.raises(ValueError, match="dgamma_out must have shape"):
        layernorm_backward(dy, x, gamma, mean, rstd, dgamma_out=np.zeros(5, np.float32))
    p2 = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="separate buffers"):
        layernorm_backward(dy, x, gamma, mean, rstd, dgamma_out=p2, dbeta_out=p2)

    a, b = x, dy
    with pytest.raises(ValueError, match="a must be at least 2-D"):
        add_layernorm_forward(a[0], b[0], gamma, beta)
    with pytest.raises(ValueError, match="b must have shape"):
        add_layernorm_forward(a, b[:3].copy(), gamma, beta)
    with pytest.raises(ValueError, match="gamma"):
        add_layernorm_forward(a, b, gamma[:5].copy(), beta)
    with pytest.raises(TypeError, match="dtypes must match"):
        add_layernorm_forward(a, b.astype(np.float64), gamma, beta)
    with pytest.raises(ValueError, match="b must be C-contiguous"):
        add_layernorm_forward(a, np.asfortranarray(b), gamma, beta)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        add_layernorm_forward(a, b, gamma, beta, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a real number"):
        add_layernorm_forward(a, b, gamma, beta, eps="1e-5")
    with pytest.raises(ValueError, match="residual_out must have shape"):
        add_layernorm_forward(a, b, gamma, beta, residual_out=np.zeros((4, 7), np.float32))
    with pytest.raises(TypeError, match="out must be fp32"):
        add_layernorm_forward(a, b, gamma, beta, out=np.zeros((4, 6), np.float64))
    with pytest.raises(ValueError, match="out overlaps a"):
        add_layernorm_forward(a, b, gamma, beta, out=a)
    with pytest.raises(ValueError, match="out overlaps residual_out"):
        r = np.zeros((4, 6), np.float32)
        add_layernorm_forward(a, b, gamma, beta, residual_out=r, out=r)
    buf = np.zeros(4 * 6 + 2, np.float32)
    a_view = buf[:24].reshape(4, 6)
    a_view[...] = a
    with pytest.raises(ValueError, match="residual_out overlaps a"):
        add_layernorm_forward(a_view, b, gamma, beta, residual_out=buf[2:].reshape(4, 6))
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        add_layernorm_forward(a.tolist(), b, gamma, beta)


# --------------------------------------------------------------------------- GPU


def _to(cp, *arrays):
    return tuple(cp.asarray(a) for a in arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("c", [1, 7, 33, 768, 1000])
def test_gpu_matches_reference(cp, rng, dtype, method, n, c):
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    ref_y, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref_dx, ref_dg, ref_db = layernorm_backward(dy, x, gamma, ref_m, ref_r)

    xd, gd, bd, dyd = _to(cp, x, gamma, beta, dy)
    y, mean, rstd = layernorm_forward(xd, gd, bd, out=poisoned((n, c), dtype, cp), method=method)
    assert mean.dtype == np.float32 and rstd.dtype == np.float32 and mean.shape == (n,)
    assert_close(y, ref_y, dtype, name="y")
    assert_close(mean, ref_m, rtol=1e-5, name="mean")
    assert_close(rstd, ref_r, rtol=1e-5, name="rstd")

    dx, dg, db = layernorm_backward(
        dyd, xd, gd, mean, rstd, method=method, dx_out=poisoned((n, c), dtype, cp),
        dgamma_out=poisoned((c,), dtype, cp), dbeta_out=poisoned((c,), dtype, cp),
    )
    if c == 1:
        # With one channel x̂ = 0 and dx is exactly 0 in exact arithmetic; what is left after rounding
        # is a residue of order eps · rstd · |dy·γ| (rstd = 1/sqrt(eps) ≈ 316 here), not an error
        # that a relative measure against 0 could judge. Bound it by that scale instead.
        f64 = lambda a: np.asarray(a, np.float64)
        scale = np.abs(f64(ref_r)[:, None] * f64(dy) * f64(gamma))
        residue = np.abs(backend.to_numpy(dx).astype(np.float64))
        assert np.all(np.isfinite(residue)) and residue.max() <= tolerance(dtype) * scale.max()
    else:
        assert_close(dx, ref_dx, dtype, name="dx")
    assert_close(dg, ref_dg, dtype, name="dgamma")
    assert_close(db, ref_db, dtype, name="dbeta")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("c", [256, 1024, 2048, 4096, 7000, 13000])
def test_gpu_long_rows_every_variant(cp, rng, dtype, c):
    """Long rows walk the register (P = 1..8), shared-memory (P = 0), opt-in and re-read variants."""
    n = 37
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    ref_y, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref = layernorm_backward(dy, x, gamma, ref_m, ref_r)
    xd, gd, bd, dyd = _to(cp, x, gamma, beta, dy)
    y, mean, rstd = layernorm_forward(xd, gd, bd, out=poisoned((n, c), dtype, cp))
    assert_close(y, ref_y, dtype, name="y")
    got = layernorm_backward(dyd, xd, gd, mean, rstd, dx_out=poisoned((n, c), dtype, cp))
    for g, r, name in zip(got, ref, ("dx", "dgamma", "dbeta")):
        assert_close(g, r, dtype, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_misaligned_and_leading_axes(cp, rng, dtype):
    """A contiguous view that starts 1 element into its buffer takes the scalar (W = 1) path."""
    c = 768
    x, gamma, beta, dy = _inputs(rng, None, c, dtype, lead=(2, 5))
    ref_y, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref = layernorm_backward(dy, x, gamma, ref_m, ref_r)
    dt = backend.resolve_dtype(dtype)
    buf = cp.empty(x.size + 1, dtype=dt)
    buf[1:] = cp.asarray(x).ravel()
    xd = buf[1:].reshape(x.shape)
    assert xd.flags.c_contiguous and xd.data.ptr % 16 != 0
    gd, bd, dyd = _to(cp, gamma, beta, dy)
    y, mean, rstd = layernorm_forward(xd, gd, bd)
    assert mean.shape == (2, 5)
    assert_close(y, ref_y, dtype)
    for g, r in zip(layernorm_backward(dyd, xd, gd, mean, rstd), ref):
        assert_close(g, r, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("c", [768, 7, 5000])
def test_gpu_param_grads_bitwise_deterministic(cp, rng, dtype, c):
    n = 4096
    x, gamma, beta, dy = _to(cp, *_inputs(rng, n, c, dtype))
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    first = [backend.to_numpy(a).tobytes() for a in layernorm_backward(dy, x, gamma, mean, rstd)]
    for _ in range(2):
        again = [backend.to_numpy(a).tobytes() for a in layernorm_backward(dy, x, gamma, mean, rstd)]
        assert again == first, "dx/dgamma/dbeta changed between two identical runs"


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    x, gamma, beta, dy = _inputs(rng, 4, 8)
    xd, gd, bd, dyd = _to(cp, x, gamma, beta, dy)
    with pytest.raises(TypeError, match="gamma=numpy|gamma=ndarray"):
        layernorm_forward(xd, gamma, bd)
    with pytest.raises(TypeError, match="float64"):
        layernorm_forward(xd.astype(cp.float64), gd.astype(cp.float64), bd.astype(cp.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        layernorm_forward(cp.asfortranarray(xd), gd, bd)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    with pytest.raises(TypeError):
        layernorm_backward(dyd, xd, gd, backend.to_numpy(mean), rstd)
    with pytest.raises(TypeError, match="mean must be fp32"):
        layernorm_backward(dyd, xd, gd, mean.astype(cp.float64), rstd)
    with pytest.raises(ValueError, match="gamma"):
        layernorm_backward(dyd, xd, gd[:7].copy(), mean, rstd)


# --------------------------------------------------------------------------- GPU: "fast" and the fusions

AWKWARD_N = [1, 7, 33, 1000]
AWKWARD_C = [1, 7, 33, 768, 1000, 1600, 2056, 3072, 4100]


def _fast_expected(c, dtype):
    """Whether layernorm_backward_fast (not the fallback) should take rows of length c."""
    size = backend.resolve_dtype(dtype).itemsize
    w = 16 // size
    return c % w == 0 and -(-(c // w) // 32) <= max(ln._FAST_PACKS[size])


@pytest.fixture
def fast_spy(monkeypatch):
    """Records what each call of the fast launcher returned (True: the fast kernels ran)."""
    calls = []
    real = ln._backward_fast

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(ln, "_backward_fast", spy)
    return calls


def _assert_dx(dx, ref_dx, dtype, c, ref_r, dy, gamma):
    if c == 1:  # x̂ = 0: dx is a rounding residue of order eps · rstd · |dy·γ| (see test_gpu_matches_reference)
        f64 = lambda a: np.asarray(backend.to_numpy(a), np.float64)  # noqa: E731
        scale = np.abs(f64(ref_r)[:, None] * f64(dy) * f64(gamma)).max()
        residue = np.abs(f64(dx))
        assert np.all(np.isfinite(residue)) and residue.max() <= tolerance(dtype) * scale
    else:
        assert_close(dx, ref_dx, dtype, name="dx")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", AWKWARD_N)
@pytest.mark.parametrize("c", AWKWARD_C)
def test_gpu_fast_backward_matches_reference(cp, rng, fast_spy, dtype, n, c):
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref_dx, ref_dg, ref_db = layernorm_backward(dy, x, gamma, ref_m, ref_r)
    xd, gd, bd, dyd = _to(cp, x, gamma, beta, dy)
    y, mean, rstd = layernorm_forward(xd, gd, bd, out=poisoned((n, c), dtype, cp), method="fast")
    dx, dg, db = layernorm_backward(
        dyd, xd, gd, mean, rstd, method="fast", dx_out=poisoned((n, c), dtype, cp),
        dgamma_out=poisoned((c,), dtype, cp), dbeta_out=poisoned((c,), dtype, cp),
    )
    assert fast_spy == [_fast_expected(c, dtype)]
    _assert_dx(dx, ref_dx, dtype, c, ref_r, dy, gamma)
    assert_close(dg, ref_dg, dtype, name="dgamma")
    assert_close(db, ref_db, dtype, name="dbeta")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("c", [8, 64, 256, 384, 512, 520, 740, 768, 1000, 1024, 1032, 1280, 1536, 1600, 1800, 2048])
def test_gpu_fast_every_instantiation(cp, rng, fast_spy, dtype, c):
    """Packs per lane P = 1..8 (16-bit; GPT-2 medium to XL rows C = 1024, 1280, 1600 among them) and 1..6
    (fp32), full and partly filled last packs, with and without dresidual, overwriting and accumulating
    fp32 parameter buffers."""
    n = 37
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    dres = random_array(rng, (n, c), dtype)
    g0, b0 = random_array(rng, c, "fp32"), random_array(rng, c, "fp32")
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    xd, gd, bd, dyd, dresd = _to(cp, x, gamma, beta, dy, dres)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    for with_res in (False, True):
        for acc in (False, True):
            r = dres if with_res else None
            ref_dx, ref_dg, ref_db = layernorm_backward(
                dy, x, gamma, ref_m, ref_r, dresidual=r, dgamma_out=g0.copy(), dbeta_out=b0.copy(),
                accumulate_params=acc)
            dgo = cp.asarray(g0) if acc else poisoned((c,), "fp32", cp)
            dbo = cp.asarray(b0) if acc else poisoned((c,), "fp32", cp)
            dx, dg, db = layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dx_out=poisoned((n, c), dtype, cp),
                                            dresidual=dresd if with_res else None, dgamma_out=dgo, dbeta_out=dbo,
                                            accumulate_params=acc)
            assert dg is dgo and dg.dtype == np.float32
            assert_close(dx, ref_dx, dtype, name=f"dx (dresidual={with_res}, accumulate={acc})")
            assert_close(dg, ref_dg, dtype, name=f"dgamma (dresidual={with_res}, accumulate={acc})")
            assert_close(db, ref_db, dtype, name=f"dbeta (dresidual={with_res}, accumulate={acc})")
    assert fast_spy == [_fast_expected(c, dtype)] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,c", [(1, 768), (33, 7), (1000, 768), (7, 1600), (33, 4100)])
def test_gpu_dresidual_accumulate_every_method(cp, rng, method, dtype, n, c):
    """dresidual / accumulate_params / gamma-dtype buffers give the reference's results on every method."""
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    dres = random_array(rng, (n, c), dtype)
    g0 = random_array(rng, c, dtype)
    b0 = random_array(rng, c, dtype)
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref = layernorm_backward(dy, x, gamma, ref_m, ref_r, dresidual=dres, dgamma_out=g0.copy(), dbeta_out=b0.copy(),
                             accumulate_params=True)
    xd, gd, bd, dyd, dresd, g0d, b0d = _to(cp, x, gamma, beta, dy, dres, g0, b0)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    got = layernorm_backward(dyd, xd, gd, mean, rstd, method=method, dresidual=dresd, dgamma_out=g0d,
                             dbeta_out=b0d, accumulate_params=True)
    assert got[1] is g0d and got[2] is b0d
    for g, r, name in zip(got, ref, ("dx", "dgamma", "dbeta")):
        assert_close(g, r, dtype, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("c", [768, 33])
def test_gpu_backward_dx_in_place_over_dresidual(cp, rng, method, dtype, c):
    n = 300
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    dres = random_array(rng, (n, c), dtype)
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref = layernorm_backward(dy, x, gamma, ref_m, ref_r, dresidual=dres)
    xd, gd, bd, dyd, buf = _to(cp, x, gamma, beta, dy, dres)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    dx, dg, db = layernorm_backward(dyd, xd, gd, mean, rstd, method=method, dresidual=buf, dx_out=buf)
    assert dx is buf
    for g, r, name in zip((dx, dg, db), ref, ("dx", "dgamma", "dbeta")):
        assert_close(g, r, dtype, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("c", [768, 1024, 7, 4100])
def test_gpu_fast_bitwise_deterministic(cp, rng, dtype, c):
    n = 4096
    x, gamma, beta, dy = _to(cp, *_inputs(rng, n, c, dtype))
    dres = cp.asarray(random_array(rng, (n, c), dtype))
    g0 = cp.asarray(random_array(rng, c, "fp32"))
    _, mean, rstd = layernorm_forward(x, gamma, beta)

    def run():
        plain = layernorm_backward(dy, x, gamma, mean, rstd, method="fast")
        dg, db = g0.copy(), g0.copy()
        fused = layernorm_backward(dy, x, gamma, mean, rstd, method="fast", dresidual=dres, dgamma_out=dg,
                                   dbeta_out=db, accumulate_params=True)
        return [backend.to_numpy(a).tobytes() for a in (*plain, *fused)]

    first = run()
    for _ in range(2):
        assert run() == first, "fast backward changed between two identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_fast_misaligned_falls_back(cp, rng, fast_spy, dtype):
    """Views 1 element into their buffers (dy, then only dresidual) are not 16-byte aligned."""
    n, c = 10, 768
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    dres = random_array(rng, (n, c), dtype)
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    ref = layernorm_backward(dy, x, gamma, ref_m, ref_r, dresidual=dres)
    dt = backend.resolve_dtype(dtype)

    def shifted(a):
        buf = cp.empty(a.size + 1, dtype=dt)
        buf[1:] = cp.asarray(a).ravel()
        v = buf[1:].reshape(a.shape)
        assert v.data.ptr % 16 != 0
        return v

    xd, gd, bd, dyd, dresd = _to(cp, x, gamma, beta, dy, dres)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    for args in ((shifted(dy), dresd), (dyd, shifted(dres))):
        got = layernorm_backward(args[0], xd, gd, mean, rstd, method="fast", dresidual=args[1])
        for g, r, name in zip(got, ref, ("dx", "dgamma", "dbeta")):
            assert_close(g, r, dtype, name=name)
    assert fast_spy == [False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 7, 33, 1000])
@pytest.mark.parametrize("c", AWKWARD_C)
def test_gpu_add_layernorm_matches_reference(cp, rng, dtype, n, c):
    a, gamma, beta, b = _inputs(rng, n, c, dtype)
    ref_s, ref_y, ref_m, ref_r = add_layernorm_forward(a, b, gamma, beta)
    ad, bd, gd, btd = _to(cp, a, b, gamma, beta)
    s_out, y_out = poisoned((n, c), dtype, cp), poisoned((n, c), dtype, cp)
    s, y, mean, rstd = add_layernorm_forward(ad, bd, gd, btd, residual_out=s_out, out=y_out)
    assert s is s_out and y is y_out and mean.dtype == rstd.dtype == np.float32 and mean.shape == (n,)
    np.testing.assert_array_equal(_bits(s), _bits(ref_s))  # fp32 add, one round-to-nearest-even: exact
    assert_close(y, ref_y, dtype, name="y")
    assert_close(mean, ref_m, rtol=1e-5, name="mean")
    assert_close(rstd, ref_r, rtol=1e-5, name="rstd")
    # and y is layernorm_forward of the rounded sum on the GPU too
    y2, _, _ = layernorm_forward(s, gd, btd)
    assert_close(y, y2, rtol=tolerance(dtype) / 4, name="y vs layernorm_forward(s)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("c", [768, 33])
@pytest.mark.parametrize("target", ["a", "b"])
def test_gpu_add_layernorm_in_place(cp, rng, dtype, c, target):
    n = 129
    a, gamma, beta, b = _inputs(rng, None, c, dtype, lead=(3, n))
    ref = add_layernorm_forward(a, b, gamma, beta)
    ad, bd, gd, btd = _to(cp, a, b, gamma, beta)
    res = ad if target == "a" else bd
    s, y, mean, rstd = add_layernorm_forward(ad, bd, gd, btd, residual_out=res)
    assert s is res and mean.shape == (3, n)
    np.testing.assert_array_equal(_bits(s), _bits(ref[0]))
    assert_close(y, ref[1], dtype, name="y")
    assert_close(rstd, ref[3], rtol=1e-5, name="rstd")


@pytest.mark.gpu
def test_gpu_fused_bad_inputs(cp, rng):
    x, gamma, beta, dy = _inputs(rng, 4, 8)
    xd, gd, bd, dyd = _to(cp, x, gamma, beta, dy)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    with pytest.raises(TypeError, match="dresidual=numpy|dresidual=ndarray"):
        layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dresidual=dy)
    with pytest.raises(TypeError, match="dgamma_out=numpy|dgamma_out=ndarray"):
        layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dgamma_out=np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="dresidual must be C-contiguous"):
        layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dresidual=cp.asfortranarray(dyd))
    with pytest.raises(ValueError, match="dresidual must have shape"):
        layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dresidual=dyd[:3].copy())
    xb, gb, dyb = xd.astype(backend.bfloat16), gd.astype(backend.bfloat16), dyd.astype(backend.bfloat16)
    with pytest.raises(TypeError, match="dgamma_out must be bf16"):
        layernorm_backward(dyb, xb, gb, mean, rstd, method="fast", dgamma_out=cp.zeros(8, cp.float16))
    with pytest.raises(TypeError, match="dtypes must match"):
        layernorm_backward(dyb, xb, gb, mean, rstd, method="fast", dresidual=dyd)
    with pytest.raises(TypeError, match="b=numpy|b=ndarray"):
        add_layernorm_forward(xd, dy, gd, bd)
    with pytest.raises(TypeError, match="float64"):
        add_layernorm_forward(xd.astype(cp.float64), dyd.astype(cp.float64), gd.astype(cp.float64),
                              bd.astype(cp.float64))
    with pytest.raises(ValueError, match="a must be C-contiguous"):
        add_layernorm_forward(cp.asfortranarray(xd), dyd, gd, bd)
    with pytest.raises(ValueError, match="b must have shape"):
        add_layernorm_forward(xd, dyd[:, :7].copy(), gd, bd)
    with pytest.raises(ValueError, match="out overlaps b"):
        add_layernorm_forward(xd, dyd, gd, bd, out=dyd)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("c", [64, 520, 768, 1024, 1280, 1600])
def test_gpu_fast_backward_both_accumulator_variants(cp, rng, dtype, c):
    """The 16-bit fast backward with dgamma/dbeta accumulated in shared memory (default) and in
    registers (C <= 1024; longer rows run the shared-memory variant either way): both match the
    reference, with and without dresidual, over many rows per warp."""
    n = 3000
    x, gamma, beta, dy = _inputs(rng, n, c, dtype)
    dres = random_array(rng, (n, c), dtype)
    _, ref_m, ref_r = layernorm_forward(x, gamma, beta)
    xd, gd, bd, dyd, dresd = _to(cp, x, gamma, beta, dy, dres)
    _, mean, rstd = layernorm_forward(xd, gd, bd)
    for acc in ("shared", "registers"):
        for r, rd in ((None, None), (dres, dresd)):
            ref = layernorm_backward(dy, x, gamma, ref_m, ref_r, dresidual=r)
            got = layernorm_backward(dyd, xd, gd, mean, rstd, method="fast", dresidual=rd,
                                     dx_out=poisoned((n, c), dtype, cp), accumulators=acc)
            for g, e, name in zip(got, ref, ("dx", "dgamma", "dbeta")):
                assert_close(g, e, dtype, name=f"{name} (accumulators={acc}, dresidual={r is not None})")


@pytest.mark.gpu
def test_gpu_accumulators_pick_the_kernel_variant(cp, rng, monkeypatch):
    """accumulators="shared" takes the optimized backward's shared-memory instantiation (packs 0) and
    "registers" the 16-bit fast backward's register one (SACC 0, 8-warp blocks)."""
    n, c = 512, 768
    x, gamma, beta, dy = _to(cp, *_inputs(rng, n, c, "bf16"))
    _, mean, rstd = layernorm_forward(x, gamma, beta)
    picked = []
    real = ln.get_kernel
    monkeypatch.setattr(ln, "get_kernel", lambda *a: picked.append(a) or real(*a))
    layernorm_backward(dy, x, gamma, mean, rstd, method="optimized")
    layernorm_backward(dy, x, gamma, mean, rstd, method="optimized", accumulators="shared")
    warp = [a[-1] for a in picked if a[1] == "layernorm_backward_warp"]
    assert warp[0] > 0 and warp[1] == 0  # packs per lane: registers by default, 0 = shared memory
    assert ln.backward_fast_plan(n, c, "bf16", xp=cp)[2] == 32 * ln._FAST_SACC_WARPS  # default: shared
    assert ln._fast_backward_plan(n, c, "bf16", False, "registers", cp)[2] == 32 * ln._FAST_WARPS
    # rows above 1024 have the shared-memory variant only (its shared memory opted in above 48 KB)
    for long_c in (1280, 1600, 2048):
        kern, _, threads, smem = ln._fast_backward_plan(n, long_c, "bf16", True, "registers", cp)
        assert threads == 32 * ln._FAST_SACC_WARPS and smem == 16 * 32 * (long_c // 256 + (long_c % 256 > 0)) * 2 * 9
