"""SwiGLU forward/backward (Llama's MLP activation): reference vs an independent float64 formula and finite
differences, the non-finite rule, in place, argument checks; CUDA kernels vs the reference."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.swiglu import swiglu_backward, swiglu_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3
GPU_DTYPES = ["fp32", "bf16", "fp16"]


def _sigmoid64(a):
    """sigmoid in float64, written apart from the module's ``1 / (1 + exp(-a))``: ``exp(a) / (1 + exp(a))`` for
    a < 0 (no overflow, no cancellation; the tanh form ``(1 + tanh(a / 2)) / 2`` cancels there)."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _silu64(a):
    return np.asarray(a, dtype=np.float64) * _sigmoid64(a)


def _inputs(rng, shape, dtype="fp32"):
    return (random_array(rng, shape, dtype, scale=3.0), random_array(rng, shape, dtype),
            random_array(rng, shape, dtype))


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_float64_formula(rng):
    gate, up, _ = _inputs(rng, (13, 29))
    h = swiglu_forward(gate, up)
    assert h.dtype == np.float32 and h.shape == gate.shape
    assert_close(h, _silu64(gate) * up.astype(np.float64), "fp32")


def test_backward_matches_closed_form(rng):
    gate, up, dh = (a.astype(np.float64) for a in _inputs(rng, (5, 7)))
    s = _sigmoid64(gate)
    dgate, dup = swiglu_backward(dh, gate, up)
    np.testing.assert_allclose(dgate, dh * up * (s + gate * s * (1.0 - s)), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(dup, dh * _silu64(gate), rtol=1e-12, atol=1e-15)


def test_known_values():
    gate = np.array([0.0, 1e4, -1e4, 30.0, -30.0], dtype=np.float32)
    h = swiglu_forward(gate, np.ones_like(gate))
    assert h[0] == 0.0 and h[1] == np.float32(1e4) and h[2] == 0.0 and np.signbit(h[2])
    np.testing.assert_allclose(h[3:], _silu64(gate[3:]), rtol=1e-6)
    dgate, _ = swiglu_backward(np.ones_like(gate), gate, np.ones_like(gate))
    np.testing.assert_array_equal(dgate[:3], [0.5, 1.0, 0.0])  # silu'(0) = 1/2; saturated ends 1 and 0


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 3)])
def test_backward_matches_finite_differences(rng, shape):
    gate = rng.standard_normal(shape) * 3.0
    up = rng.standard_normal(shape)
    r = rng.standard_normal(shape)  # loss = sum(h * r), so dh = r
    dgate, dup = swiglu_backward(r, gate, up)

    def loss():
        return float((swiglu_forward(gate, up) * r).sum())

    check_gradient(loss, gate, dgate, name="dgate")
    check_gradient(loss, up, dup, name="dup")


def _nonfinite_case(dtype, xp=np):
    """gate, up, dh with NaN/inf at known places, and what h, dgate, dup must be (NaN where the expected
    value is NaN, the value itself elsewhere: module docstring)."""
    nan, inf = np.nan, np.inf
    s2 = 1.0 / (1.0 + np.exp(-2.0))
    gate = [nan, 1.0, inf, inf, -inf, -1e4, 1e4, 0.0, 2.0, 2.0]
    up = [1.0, nan, 2.0, 0.0, 1.0, 3.0, 1.0, inf, 1.0, 1.0]
    dh = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, nan]
    h = [nan, nan, inf, nan, nan, 0.0, 1e4, nan, 2.0 * s2, 2.0 * s2]
    dgate = [nan, nan, nan, nan, nan, 0.0, 1.0, inf, s2 * (1.0 + 2.0 * (1.0 - s2)), nan]
    dup = [nan, 1.0 / (1.0 + np.exp(-1.0)), inf, inf, nan, 0.0, 1e4, 0.0, 2.0 * s2, nan]
    dt = backend.resolve_dtype(dtype)
    arrays = [backend.to_device(np.array(v, dtype=dt), xp) for v in (gate, up, dh)]
    return arrays, [np.array(v) for v in (h, dgate, dup)]


def _assert_rule(got, want, dtype, name):
    got = backend.to_numpy(got).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name}: NaN positions")
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=10 * np.finfo(np.float16).eps if dtype != "fp32" else 4e-6,
                               err_msg=name)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_rule_reference(dtype):
    (gate, up, dh), (h, dgate, dup) = _nonfinite_case(dtype)
    _assert_rule(swiglu_forward(gate, up), h, dtype, "h")
    got_dgate, got_dup = swiglu_backward(dh, gate, up)
    _assert_rule(got_dgate, dgate, dtype, "dgate")
    _assert_rule(got_dup, dup, dtype, "dup")


def test_bf16_reference_and_out(rng):
    gate, up, dh = _inputs(rng, (4, 9), "bf16")
    out = poisoned((4, 9), "bf16", np)
    h = swiglu_forward(gate, up, out=out)
    assert h is out and h.dtype == backend.bfloat16
    assert_close(h, _silu64(gate.astype(np.float32)) * up.astype(np.float64), "bf16")
    bufs = poisoned((4, 9), "bf16", np), poisoned((4, 9), "bf16", np)
    dgate, dup = swiglu_backward(dh, gate, up, dgate=bufs[0], dup=bufs[1])
    assert dgate is bufs[0] and dup is bufs[1]
    assert np.all(np.isfinite(dgate.astype(np.float32))) and np.all(np.isfinite(dup.astype(np.float32)))


def test_in_place(rng):
    gate, up, dh = _inputs(rng, (3, 8))
    h_ref = swiglu_forward(gate, up)
    g_ref = swiglu_backward(dh, gate, up)
    for target in ("gate", "up"):
        g2, u2 = gate.copy(), up.copy()
        h = swiglu_forward(g2, u2, out=g2 if target == "gate" else u2)
        np.testing.assert_array_equal(h, h_ref)
    g2, u2 = gate.copy(), up.copy()
    dgate, dup = swiglu_backward(dh, g2, u2, dgate=g2, dup=u2)
    assert dgate is g2 and dup is u2
    np.testing.assert_array_equal(dgate, g_ref[0])
    np.testing.assert_array_equal(dup, g_ref[1])


def test_bad_inputs(rng):
    gate, up, dh = _inputs(rng, (4, 8))
    with pytest.raises(ValueError, match="up must have shape"):
        swiglu_forward(gate, up[:3].copy())
    with pytest.raises(ValueError, match="dh must have shape"):
        swiglu_backward(dh[:, :7].copy(), gate, up)
    with pytest.raises(TypeError, match="dtypes must match"):
        swiglu_forward(gate, up.astype(np.float16))
    with pytest.raises(TypeError, match="dtypes must match"):
        swiglu_backward(dh.astype(np.float64), gate, up)
    with pytest.raises(TypeError, match="gate has dtype"):
        swiglu_forward(gate.astype(np.int32), up.astype(np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        swiglu_forward(gate.T, up.T)
    with pytest.raises(ValueError, match="out must have shape"):
        swiglu_forward(gate, up, out=np.empty((4, 9), np.float32))
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array"):
        swiglu_forward(gate.tolist(), up)
    buf = np.zeros(33, np.float32)
    g2 = buf[:32].reshape(4, 8)
    g2[...] = gate
    with pytest.raises(ValueError, match="out overlaps gate without being the same buffer"):
        swiglu_forward(g2, up, out=buf[1:].reshape(4, 8))
    with pytest.raises(ValueError, match="separate buffers"):
        swiglu_backward(dh, gate, up, dgate=buf[:32].reshape(4, 8), dup=buf[:32].reshape(4, 8))


# --------------------------------------------------------------------------- row views (NumPy)


def _gu(rng, n, f, pad, dtype="fp32", xp=np):
    """gu [n, 2f + pad] (a fused gate|up GEMM's output, pad extra columns: an odd row stride), its gate and up
    views, and dh [n, f] contiguous."""
    gu = random_array(rng, (n, 2 * f + pad), dtype, xp=xp, scale=3.0)
    return gu, gu[:, :f], gu[:, f:2 * f], random_array(rng, (n, f), dtype, xp=xp)


@pytest.mark.parametrize("n, f, pad", [(5, 8, 0), (3, 7, 1), (1, 5, 3)])
def test_row_views_match_contiguous_copies(rng, n, f, pad):
    gu, gate, up, dh = _gu(rng, n, f, pad)
    want_h = swiglu_forward(gate.copy(), up.copy())
    want = swiglu_backward(dh, gate.copy(), up.copy())
    h = swiglu_forward(gate, up)
    assert h.flags.c_contiguous
    np.testing.assert_array_equal(h, want_h)
    got = swiglu_backward(dh, gate, up)
    assert all(g.flags.c_contiguous for g in got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    out = poisoned((n, 2 * f + 1), "fp32", np)  # a row-view output of its own stride, poisoned around it
    assert swiglu_forward(gate, up, out=out[:, 1:f + 1]).base is out
    np.testing.assert_array_equal(out[:, 1:f + 1], want_h)
    assert np.isnan(out[:, 0]).all() and np.isnan(out[:, f + 1:]).all()


def test_backward_in_place_over_gu(rng):
    """dgate=gate, dup=up: the gradients land in gu's two halves; the pad columns and dh are untouched."""
    gu, gate, up, dh = _gu(rng, 6, 5, 3)
    before, dh_before = gu.copy(), dh.copy()
    want = swiglu_backward(dh, gate.copy(), up.copy())
    dgate, dup = swiglu_backward(dh, gate, up, dgate=gate, dup=up)
    assert dgate is gate and dup is up
    np.testing.assert_array_equal(gu[:, :5], want[0])
    np.testing.assert_array_equal(gu[:, 5:10], want[1])
    np.testing.assert_array_equal(gu[:, 10:], before[:, 10:])
    np.testing.assert_array_equal(dh, dh_before)
    gu, gate, up, _ = _gu(rng, 4, 6, 0)
    want_h = swiglu_forward(gate.copy(), up.copy())
    up_before = up.copy()
    assert swiglu_forward(gate, up, out=gate) is gate  # h over gate, up kept
    np.testing.assert_array_equal(gate, want_h)
    np.testing.assert_array_equal(up, up_before)


def test_row_views_nonfinite_rule():
    """The module docstring's NaN/inf rule through row views: the ten cases as the columns of gu's halves."""
    (gate, up, dh), want = _nonfinite_case("fp32")
    gu = np.zeros((3, 2 * gate.size + 1), np.float32)
    gu[:, :gate.size], gu[:, gate.size:-1] = gate, up
    g, u = gu[:, :gate.size], gu[:, gate.size:-1]
    _assert_rule(swiglu_forward(g, u)[1], want[0], "fp32", "h")
    dgate, dup = swiglu_backward(np.tile(dh, (3, 1)), g, u, dgate=g, dup=u)
    _assert_rule(dgate[2], want[1], "fp32", "dgate")
    _assert_rule(dup[0], want[2], "fp32", "dup")


def test_bad_layouts_and_overlapping_views(rng):
    gu, gate, up, dh = _gu(rng, 4, 6, 0)
    layout = r"must be C-contiguous, or a 2-D row view \(unit column stride, row stride >= its columns"
    cube = np.zeros((2, 4, 12), np.float32)
    for g, u, name in ((gu[:, ::2], up, "gate"), (gate, gu[:, ::-1][:, :6], "up"), (gate[::-1], up, "gate"),
                       (cube[:, :, :6], cube[:, :, 6:], "gate"), (gate.T, up.T, "gate")):
        with pytest.raises(ValueError, match=f"^{name} {layout}"):
            swiglu_forward(g, u)
    with pytest.raises(ValueError, match=f"^dh {layout}"):
        swiglu_backward(np.zeros((4, 12), np.float32)[:, ::2], gate, up)
    with pytest.raises(ValueError, match=f"^out {layout}"):
        swiglu_forward(gate, up, out=np.zeros((6, 4), np.float32).T)
    with pytest.raises(ValueError, match="out overlaps gate without being the same buffer"):
        swiglu_forward(gate, up, out=gu[:, 1:7])
    with pytest.raises(ValueError, match="dup overlaps gate without being the same buffer"):
        swiglu_backward(dh, gate, up, dup=gu[:, 5:11])  # one column of gate, five of up
    wide = np.zeros((4, 13), np.float32)
    with pytest.raises(ValueError, match="dgate and dup must be separate buffers"):
        swiglu_backward(dh, gate.copy(), up.copy(), dgate=wide[:, :6], dup=wide[:, 5:11])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (33,), (1000,), (7, 33), (3, 4 * 688 + 5), (64, 11008)])
def test_gpu_matches_reference(cp, rng, dtype, shape):
    """Kernel vs reference on fresh inputs, outputs poisoned; tolerance: the dtype's (testing.TOLERANCE:
    1e-5 fp32, 5e-3 fp16, 2e-2 bf16, relative norm). Shapes: tails past the last 16-byte pack, Llama's 11008."""
    gate, up, dh = _inputs(rng, shape, dtype)
    gd, ud, dhd = cp.asarray(gate), cp.asarray(up), cp.asarray(dh)
    h = swiglu_forward(gd, ud, out=poisoned(shape, dtype, cp))
    assert_close(h, swiglu_forward(gate, up), dtype, name="h")
    dgate, dup = swiglu_backward(dhd, gd, ud, dgate=poisoned(shape, dtype, cp), dup=poisoned(shape, dtype, cp))
    want = swiglu_backward(dh, gate, up)
    assert_close(dgate, want[0], dtype, name="dgate")
    assert_close(dup, want[1], dtype, name="dup")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_misaligned_views_and_in_place(cp, rng, dtype):
    """The scalar fallback (views one element off 16 bytes) and in place (out=gate, dgate=gate, dup=up)."""
    n = 1001
    dt = backend.resolve_dtype(dtype)
    gate, up, dh = _inputs(rng, (n,), dtype)
    bufs = [cp.empty(n + 1, dtype=dt) for _ in range(3)]
    for b, a in zip(bufs, (gate, up, dh)):
        b[1:] = cp.asarray(a)
    gd, ud, dhd = (b[1:] for b in bufs)
    assert gd.data.ptr % 16 != 0
    assert_close(swiglu_forward(gd, ud), swiglu_forward(gate, up), dtype, name="h (unaligned)")
    want = swiglu_backward(dh, gate, up)
    for got, w, name in zip(swiglu_backward(dhd, gd, ud), want, ("dgate", "dup")):
        assert_close(got, w, dtype, name=f"{name} (unaligned)")
    g2, u2 = cp.asarray(gate), cp.asarray(up)
    h = swiglu_forward(g2, u2, out=g2)
    assert h is g2
    assert_close(h, swiglu_forward(gate, up), dtype, name="h (in place)")
    g2, u2 = cp.asarray(gate), cp.asarray(up)
    dgate, dup = swiglu_backward(cp.asarray(dh), g2, u2, dgate=g2, dup=u2)
    assert dgate is g2 and dup is u2
    assert_close(dgate, want[0], dtype, name="dgate (in place)")
    assert_close(dup, want[1], dtype, name="dup (in place)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_gpu_nonfinite_rule(cp, dtype, aligned):
    """The module docstring's NaN/inf rule on the kernel: packed (the ten cases repeated to fill packs) and
    scalar (an unaligned view)."""
    (gate, up, dh), want = _nonfinite_case(dtype)
    reps = 4
    gate, up, dh = (np.tile(a, reps) for a in (gate, up, dh))
    want = [np.tile(w, reps) for w in want]
    dev = []
    for a in (gate, up, dh):
        b = cp.empty(a.size + (0 if aligned else 1), dtype=a.dtype)
        b[b.size - a.size:] = cp.asarray(a)
        dev.append(b[b.size - a.size:])
    _assert_rule(swiglu_forward(dev[0], dev[1]), want[0], dtype, "h")
    dgate, dup = swiglu_backward(dev[2], dev[0], dev[1])
    _assert_rule(dgate, want[1], dtype, "dgate")
    _assert_rule(dup, want[2], dtype, "dup")


@pytest.mark.gpu
def test_gpu_fp32_accuracy_wide_range(cp):
    """fp32 storage, elementwise against float64: silu and its derivative within 2e-6 of the scale of their
    terms on [-80, 80] (expf and an IEEE division: a few ulp); exact at the saturated ends."""
    a = np.concatenate([np.linspace(-80.0, 80.0, 200_001), [100.0, 1e4, 3e38, -100.0, -1e4, -3e38]])
    a = a.astype(np.float32)
    ones = cp.ones(a.size, dtype=cp.float32)
    h = backend.to_numpy(swiglu_forward(cp.asarray(a), ones)).astype(np.float64)
    dgate, _ = swiglu_backward(ones, cp.asarray(a), ones)
    g = backend.to_numpy(dgate).astype(np.float64)
    a64 = a.astype(np.float64)
    s = _sigmoid64(a64)
    assert np.isfinite(h).all() and np.isfinite(g).all()
    np.testing.assert_allclose(h, a64 * s, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(g, s + a64 * s * (1.0 - s), rtol=0, atol=2e-6 * (s + np.abs(a64 * s * (1.0 - s))).max())
    big = a >= 100.0
    np.testing.assert_array_equal(h[big], a64[big])
    np.testing.assert_array_equal(g[big], 1.0)
    np.testing.assert_array_equal(h[a <= -100.0], 0.0)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    gate, up, _ = _inputs(rng, (4, 8))
    with pytest.raises(TypeError, match="up=ndarray|up=numpy"):
        swiglu_forward(cp.asarray(gate), up)
    with pytest.raises(TypeError, match="float64"):
        swiglu_forward(cp.asarray(gate, dtype=cp.float64), cp.asarray(up, dtype=cp.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        swiglu_forward(cp.asarray(gate).T, cp.asarray(up).T)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n, f, pad", [(7, 64, 0), (3, 4 * 688 + 8, 8), (5, 40, 1), (4, 33, 0), (9, 13, 3)])
def test_gpu_row_views_bitwise_and_in_place(cp, rng, dtype, n, f, pad):
    """gate = gu[:, :F], up = gu[:, F:2F] against the contiguous kernel on copies, bitwise: forward into a new and
    into a poisoned row-view out, backward into new buffers and in place over gu (pad columns and dh untouched).
    (7, 64, 0), (3, 2760, 8): 16-byte packs; pad 1, odd F: the scalar path."""
    gu, gate, up, dh = _gu(rng, n, f, pad, dtype, xp=cp)
    gc, uc = gate.copy(), up.copy()
    want_h = swiglu_forward(gc, uc)
    want = swiglu_backward(dh, gc, uc)
    bits = np.uint32 if dtype == "fp32" else np.uint16

    def same(got, w, name):
        np.testing.assert_array_equal(backend.to_numpy(got).view(bits), backend.to_numpy(w).view(bits), err_msg=name)

    same(swiglu_forward(gate, up), want_h, "h")
    out = poisoned((n, f + 3), dtype, cp)
    swiglu_forward(gate, up, out=out[:, 2:f + 2])
    same(out[:, 2:f + 2], want_h, "h (row-view out)")
    around = backend.to_numpy(out).astype(np.float32)
    assert np.isnan(around[:, :2]).all() and np.isnan(around[:, f + 2:]).all()
    for g, w, name in zip(swiglu_backward(dh, gate, up), want, ("dgate", "dup")):
        same(g, w, name)
    before, dh_before = gu.copy(), dh.copy()
    dgate, dup = swiglu_backward(dh, gate, up, dgate=gate, dup=up)
    assert dgate is gate and dup is up
    same(gu[:, :f], want[0], "dgate (in place)")
    same(gu[:, f:2 * f], want[1], "dup (in place)")
    same(gu[:, 2 * f:], before[:, 2 * f:], "pad columns")
    same(dh, dh_before, "dh")
    assert_close(want_h, swiglu_forward(backend.to_numpy(gc), backend.to_numpy(uc)), dtype, name="h vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("f, pad", [(16, 0), (10, 1)])
def test_gpu_row_views_nonfinite_rule(cp, dtype, f, pad):
    """The NaN/inf rule through row views, packed (F = 16) and scalar (F = 10, odd row stride)."""
    (gate, up, dh), want = _nonfinite_case(dtype)
    reps = -(-f // gate.size) + 1
    gate, up, dh = (np.tile(a, reps)[:f] for a in (gate, up, dh))
    want = [np.tile(w, reps)[:f] for w in want]
    gu = cp.zeros((4, 2 * f + pad), dtype=gate.dtype)
    gu[:, :f], gu[:, f:2 * f] = cp.asarray(gate), cp.asarray(up)
    g, u = gu[:, :f], gu[:, f:2 * f]
    h = backend.to_numpy(swiglu_forward(g, u))
    dgate, dup = (backend.to_numpy(a) for a in swiglu_backward(cp.asarray(np.tile(dh, (4, 1))), g, u, dgate=g, dup=u))
    for r in range(4):
        _assert_rule(h[r], want[0], dtype, "h")
        _assert_rule(dgate[r], want[1], dtype, "dgate")
        _assert_rule(dup[r], want[2], dtype, "dup")


@pytest.mark.gpu
def test_gpu_row_views_unaligned_and_bad_layouts(cp, rng):
    """A row view one element off 16 bytes (the scalar path) against the reference; bad layouts and overlapping
    views refused as on NumPy."""
    buf = random_array(rng, (6, 2 * 32 + 1), "bf16", xp=cp)
    gate, up = buf[:, 1:33], buf[:, 33:65]
    assert gate.data.ptr % 16 != 0
    dh = random_array(rng, (6, 32), "bf16", xp=cp)
    g, u, d = (backend.to_numpy(a) for a in (gate, up, dh))
    assert_close(swiglu_forward(gate, up), swiglu_forward(g, u), "bf16", name="h (unaligned rows)")
    for got, w, name in zip(swiglu_backward(dh, gate, up), swiglu_backward(d, g, u), ("dgate", "dup")):
        assert_close(got, w, "bf16", name=f"{name} (unaligned rows)")
    with pytest.raises(ValueError, match=r"^gate must be C-contiguous, or a 2-D row view"):
        swiglu_forward(buf[:, ::2][:, :32], up)
    with pytest.raises(ValueError, match="out overlaps gate without being the same buffer"):
        swiglu_forward(gate, up, out=buf[:, 32:64])  # gate's last column and up's first 31: gate is checked first
