"""Global gradient norm and clip factor: vs float64, determinism, inf/nan flag, bad inputs (chapter 4)."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.optim import GradClipper, clip_coefficient, clip_scale, global_grad_norm, grad_norm_fused
from llmgpu.optim.clip import CLIP_EPS

pytestmark = pytest.mark.ch4

SIZES = [1, 7, 1000, 10**6 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_norm_numpy(rng, n):
    g = rng.standard_normal(n).astype(np.float32)
    norm = global_grad_norm(g)
    assert norm.shape == () and norm.dtype == np.float32
    np.testing.assert_allclose(float(norm), np.linalg.norm(g.astype(np.float64)), rtol=1e-6)


def test_clip_factor_numpy(rng):
    g = rng.standard_normal(1000).astype(np.float32)
    true = np.linalg.norm(g.astype(np.float64))
    res = grad_norm_fused(g, max_norm=1.0)
    np.testing.assert_allclose(float(res.scale), 1.0 / (true + 1e-6), rtol=1e-6)
    assert float(res.found_inf) == 0.0
    res = grad_norm_fused(g, max_norm=1e6)
    assert float(res.scale) == 1.0
    pre = np.array(0.25, np.float32)  # unscale by 1/4: norm of g/4, scale folds the 1/4 in
    res = grad_norm_fused(g, max_norm=1.0, prescale=pre)
    np.testing.assert_allclose(float(res.norm), true / 4, rtol=1e-6)
    np.testing.assert_allclose(float(res.scale), 0.25 / (true / 4 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(float(clip_scale(np.array(true, np.float32), 1.0)), 1 / (true + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(float(clip_scale(np.array(0.5, np.float32), 1.0)), 1.0)


def test_clip_coefficient_is_the_kernels_formula(rng):
    """min(1, max_norm / (norm + eps)) in fp32 element by element, as grad_norm.cu's fminf: a nan norm gives 1."""
    norms = np.concatenate([rng.exponential(2.0, 50), [0.0, 1e-7, np.inf, np.nan]]).astype(np.float32)
    max_norm = float(rng.uniform(0.1, 3.0))
    got = clip_coefficient(norms, max_norm)
    assert got.dtype == np.float32 and got.shape == norms.shape
    want = [1.0 if np.isnan(n) else min(np.float32(1.0), np.float32(max_norm) / (n + np.float32(CLIP_EPS)))
            for n in norms]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert float(clip_coefficient(np.array(0.0, np.float32), max_norm)) == 1.0 and got[-2] == 0.0  # inf: all clipped
    one = clip_coefficient(np.array(2 * max_norm, np.float32), max_norm)  # a 0-d array stays 0-d (a device scalar)
    assert one.shape == () and float(one) == pytest.approx(0.5, rel=1e-6)
    assert float(grad_norm_fused(np.full(4, max_norm, np.float32), max_norm).scale) == clip_coefficient(
        np.float32(2 * max_norm), max_norm)  # the fused norm's NumPy path takes the same function


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_found_inf_numpy(rng, bad):
    g = rng.standard_normal(77).astype(np.float32)
    g[40] = bad
    assert float(grad_norm_fused(g).found_inf) == 1.0
    g[40] = 3e38  # large but finite: its square overflows, the flag must not fire
    assert float(grad_norm_fused(g).found_inf) == 0.0


def test_clipper_reuses_buffers(rng):
    c = GradClipper(1.0, xp=np)
    r1 = c(rng.standard_normal(10).astype(np.float32))
    r2 = c(np.full(4, 0.1, np.float32))
    assert r1 is r2 and c.last_norm() == pytest.approx(0.2, rel=1e-6)
    assert float(r2.scale) == 1.0


def test_bad_inputs_numpy():
    with pytest.raises(ValueError, match="grad"):
        global_grad_norm(np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="grad"):
        global_grad_norm(np.ones(10, np.float32)[::2])
    with pytest.raises(TypeError, match="grad"):
        global_grad_norm(np.ones(10, np.int32))
    with pytest.raises(TypeError, match="prescale"):
        global_grad_norm(np.ones(10, np.float32), prescale=np.array(1.0))
    with pytest.raises(ValueError, match="max_norm"):
        clip_scale(np.array(1.0, np.float32), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["fp32", "bf16", "fp16"])
def test_norm_gpu(cp, rng, n, dt):
    g = rng.standard_normal(n).astype(backend.resolve_dtype(dt))
    ref = np.linalg.norm(g.astype(np.float64))
    gd = cp.asarray(g)
    res = grad_norm_fused(gd, 1.0)
    np.testing.assert_allclose(float(res.norm), ref, rtol=1e-5)
    np.testing.assert_allclose(float(res.scale), min(1.0, 1.0 / (ref + 1e-6)), rtol=1e-5)
    assert float(res.found_inf) == 0.0
    # deterministic: bit-identical over repeated launches
    first = backend.to_numpy(res.norm).tobytes()
    for _ in range(5):
        assert backend.to_numpy(global_grad_norm(gd)).tobytes() == first
    # unaligned view (one element in): scalar path
    if n > 1:
        np.testing.assert_allclose(float(global_grad_norm(gd[1:])), np.linalg.norm(g[1:].astype(np.float64)),
                                   rtol=1e-5)


@pytest.mark.gpu
def test_found_inf_and_prescale_gpu(cp, rng):
    g = rng.standard_normal(10**5 + 1).astype(np.float32)
    c = GradClipper(1.0, xp=cp)
    pre = cp.asarray(np.float32(1 / 1024))
    r = c(cp.asarray(g * 1024), prescale=pre)
    ref = np.linalg.norm(g.astype(np.float64))
    np.testing.assert_allclose(c.last_norm(), ref, rtol=1e-5)
    np.testing.assert_allclose(float(r.scale), (1 / 1024) / (ref + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(float(clip_scale(r.norm, 0.5)), min(1, 0.5 / (ref + 1e-6)), rtol=1e-5)
    coef = clip_coefficient(r.norm, 0.5)  # on the device, 0-d, the kernel's bits
    assert isinstance(coef, cp.ndarray) and coef.shape == () and coef.dtype == np.float32
    assert float(coef) == float(clip_coefficient(np.float32(float(r.norm)), 0.5))
    assert float(GradClipper(0.5, xp=cp)(cp.asarray(g)).scale) == float(clip_coefficient(c(cp.asarray(g)).norm, 0.5))
    for pos, bad in ((0, np.nan), (12345, np.inf), (10**5, -np.inf)):  # first, middle, scalar tail
        h = g.copy()
        h[pos] = bad
        assert float(c(cp.asarray(h)).found_inf) == 1.0
    assert float(c(cp.asarray(g)).found_inf) == 0.0  # the flag and counter reset between launches
    h = g.copy()
    h[5] = 3e38
    assert float(c(cp.asarray(h)).found_inf) == 0.0  # huge but finite: no overflow flag


@pytest.mark.gpu
def test_bad_inputs_gpu(cp):
    with pytest.raises(TypeError, match="prescale"):
        global_grad_norm(cp.ones(10, cp.float32), prescale=np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="grad"):
        global_grad_norm(cp.ones(10, cp.float32)[::2])
