"""Fused softmax + cross-entropy (chapter 3): reference vs float64 math and finite differences
(with ignored rows), CUDA kernels vs the reference, bad targets, argument checks."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.cross_entropy import (
    FUSED_METHODS,
    METHODS,
    CrossEntropyCache,
    cross_entropy_backward,
    cross_entropy_forward,
)
from llmgpu.ops.softmax import softmax_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array, rel_error

pytestmark = pytest.mark.ch3


def _loss64(logits, targets, ignore_index=-100):
    x = np.asarray(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    t = np.asarray(targets).reshape(-1)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    valid = t != ignore_index
    if not valid.any():
        return 0.0
    return float((lse[valid] - x[valid, t[valid]]).mean())


def _targets(rng, n, v, dtype=np.int64, ignore_every=3):
    t = rng.integers(0, v, n).astype(dtype)
    if ignore_every:
        t[::ignore_every] = -100
    return t


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_float64_formula(rng):
    logits = random_array(rng, (11, 37), "fp32", scale=4.0)
    t = _targets(rng, 11, 37)
    loss, cache = cross_entropy_forward(logits, t)
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == np.float32
    assert isinstance(cache, CrossEntropyCache) and int(cache.n_valid) == int((t != -100).sum())
    assert abs(float(loss) - _loss64(logits, t)) <= 1e-5 * abs(_loss64(logits, t))


def test_large_logits_stay_finite():
    """lse - x_t never takes the log of an underflowed probability."""
    logits = np.array([[0.0, 1000.0, -1000.0]], dtype=np.float32)
    loss, _ = cross_entropy_forward(logits, np.array([2], np.int32))
    assert np.isfinite(loss) and abs(float(loss) - 2000.0) < 1e-2


@pytest.mark.parametrize("shape", [(6, 9), (2, 3, 5)])
def test_backward_matches_finite_differences(rng, shape):
    logits = rng.standard_normal(shape) * 3.0
    t = _targets(rng, int(np.prod(shape[:-1])), shape[-1], ignore_every=2).reshape(shape[:-1])
    loss, cache = cross_entropy_forward(logits, t)
    dlogits = cross_entropy_backward(cache)
    assert dlogits.shape == logits.shape
    check_gradient(lambda: float(cross_entropy_forward(logits, t)[0]), logits, dlogits, name="dlogits")
    np.testing.assert_array_equal(dlogits.reshape(-1, shape[-1])[t.reshape(-1) == -100], 0.0)


def test_dloss_scales_and_in_place(rng):
    logits = random_array(rng, (5, 7), "fp32")
    t = _targets(rng, 5, 7, np.int32)
    _, cache = cross_entropy_forward(logits, t)
    g1 = cross_entropy_backward(cache)
    g3 = cross_entropy_backward(cache, np.asarray(3.0, np.float32))
    np.testing.assert_allclose(g3, 3.0 * g1, rtol=1e-6)
    work = logits.copy()
    _, c2 = cross_entropy_forward(work, t)
    assert cross_entropy_backward(c2, out=work) is work
    np.testing.assert_allclose(work, g1, rtol=1e-6)
    # [B, T, V] logits: out may be the cache's [N, V] view of them
    work3 = logits.reshape(1, 5, 7).copy()
    _, c3 = cross_entropy_forward(work3, t.reshape(1, 5))
    assert cross_entropy_backward(c3, out=c3.logits) is c3.logits
    np.testing.assert_allclose(work3.reshape(5, 7), g1, rtol=1e-6)
    with pytest.raises(ValueError, match="out must have shape"):
        cross_entropy_backward(c3, out=np.empty((5, 8), np.float32))


def test_all_rows_ignored_gives_zero(rng):
    logits = random_array(rng, (4, 6), "fp32")
    t = np.full(4, -100, dtype=np.int64)
    loss, cache = cross_entropy_forward(logits, t)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(cross_entropy_backward(cache), 0.0)


def test_custom_ignore_index(rng):
    logits = random_array(rng, (6, 5), "fp32")
    t = np.array([0, 1, 2, 3, 4, 0], dtype=np.int64)
    loss, _ = cross_entropy_forward(logits, t, ignore_index=0)
    assert abs(float(loss) - _loss64(logits, t, ignore_index=0)) < 1e-5


def test_bad_inputs(rng):
    logits = random_array(rng, (4, 6), "fp32")
    t = _targets(rng, 4, 6)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 6\)"):
        cross_entropy_forward(logits, np.array([0, 6, 1, 2]))
    with pytest.raises(ValueError, match="targets must lie"):
        cross_entropy_forward(logits, np.array([0, -1, 1, 2]))
    with pytest.raises(TypeError, match="targets has dtype float32"):
        cross_entropy_forward(logits, t.astype(np.float32))
    with pytest.raises(ValueError, match="targets must have shape"):
        cross_entropy_forward(logits, t[:3].copy())
    with pytest.raises(ValueError, match="targets must have shape"):
        cross_entropy_forward(logits, t.reshape(2, 2))
    with pytest.raises(ValueError, match="C-contiguous"):
        cross_entropy_forward(np.asfortranarray(logits), t)
    with pytest.raises(ValueError, match="C-contiguous"):
        cross_entropy_forward(logits, np.arange(8)[::2].copy()[::-1])
    with pytest.raises(ValueError, match="logits must be at least 2-D"):
        cross_entropy_forward(logits[0], t[:1].reshape(()))
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy_forward(logits, t, ignore_index=-100.0)
    with pytest.raises(TypeError, match="cache"):
        cross_entropy_backward((logits, t))
    with pytest.raises(TypeError):
        cross_entropy_forward(logits, list(t))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("v", [7, 1000, 50257, 50304])
def test_gpu_matches_reference(cp, rng, dtype, method, n, v):
    logits = random_array(rng, (n, v), dtype, scale=2.0)
    t = _targets(rng, n, v, ignore_every=3 if n > 1 else 0)
    ref_loss, ref_cache = cross_entropy_forward(logits, t)
    ref_g = cross_entropy_backward(ref_cache)
    ld, td = cp.asarray(logits), cp.asarray(t)
    loss, cache = cross_entropy_forward(ld, td, method=method)
    assert backend.is_gpu_array(loss) and loss.shape == () and loss.dtype == np.float32
    assert int(cache.n_valid) == int(ref_cache.n_valid)
    # the fused path keeps lse in fp32; the naive one takes -log of a stored (bf16) probability
    loss_tol = 2e-2 if (method == "naive" and dtype != "fp32") else 1e-5
    assert_close(loss, ref_loss, rtol=loss_tol, name="loss")
    g = cross_entropy_backward(cache, out=poisoned((n, v), dtype, cp))
    assert_close(g, ref_g, dtype, name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
@pytest.mark.parametrize("tdtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_gpu_target_dtypes_leading_axes_in_place(cp, rng, tdtype, dtype, method):
    b, t_len, v = 2, 5, 50257
    logits = random_array(rng, (b, t_len, v), dtype)
    t = _targets(rng, b * t_len, v, tdtype).reshape(b, t_len)
    ref_loss, ref_cache = cross_entropy_forward(logits, t)
    ref_g = cross_entropy_backward(ref_cache, 0.5)
    ld = cp.asarray(logits)
    loss, cache = cross_entropy_forward(ld, cp.asarray(t), method=method)
    assert cache.method == method
    assert_close(loss, ref_loss, rtol=1e-5)
    g = cross_entropy_backward(cache, cp.asarray(0.5, dtype=cp.float32), out=ld)  # device dloss, in place
    assert g is ld
    assert_close(g, ref_g, dtype)
    ld2 = cp.asarray(logits)
    _, cache2 = cross_entropy_forward(ld2, cp.asarray(t), method=method)
    g2 = cross_entropy_backward(cache2, 0.5, out=cache2.logits)  # the [N, V] view, as the model does
    assert g2 is cache2.logits
    assert_close(ld2, ref_g, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
def test_gpu_misaligned_output(cp, rng, method):
    """dlogits whose 16-byte phase differs from the logits' takes the scalar backward."""
    n, v = 9, 1003
    logits = random_array(rng, (n, v), "bf16")
    t = _targets(rng, n, v)
    _, ref_cache = cross_entropy_forward(logits, t)
    ref_g = cross_entropy_backward(ref_cache)
    _, cache = cross_entropy_forward(cp.asarray(logits), cp.asarray(t), method=method)
    buf = cp.full(n * v + 1, np.nan, dtype=backend.bfloat16)
    out = buf[1:].reshape(n, v)
    assert_close(cross_entropy_backward(cache, out=out), ref_g, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
def test_gpu_bad_targets_are_loud_and_all_ignored_is_zero(cp, rng, method):
    n, v = 6, 1000
    logits = cp.asarray(random_array(rng, (n, v), "fp32"))
    t = cp.asarray(np.array([1, 2, v, 3, -7, 4], dtype=np.int64))  # rows 2 and 4 out of range
    loss, cache = cross_entropy_forward(logits, t, method=method)
    assert np.isnan(float(loss))
    assert int(cache.n_valid) == n
    g = backend.to_numpy(cross_entropy_backward(cache))
    assert np.isnan(g[[2, 4]]).all() and np.isfinite(g[[0, 1, 3, 5]]).all()

    t_ign = cp.full(n, -100, dtype=cp.int32)
    for m in METHODS:
        loss, cache = cross_entropy_forward(logits, t_ign, method=m)
        assert float(loss) == 0.0 and int(cache.n_valid) == 0
        assert not cp.any(cross_entropy_backward(cache, out=poisoned((n, v), "fp32", cp)))


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
def test_gpu_deterministic(cp, rng, method):
    logits = cp.asarray(random_array(rng, (1000, 50257), "bf16"))
    t = cp.asarray(_targets(rng, 1000, 50257))
    a = [backend.to_numpy(cross_entropy_forward(logits, t, method=method)[0]).tobytes() for _ in range(3)]
    assert a[0] == a[1] == a[2]


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_masked_logits(cp, rng, method, dtype):
    """-inf logits (a padded or masked vocabulary) add nothing, wherever they sit in the row: at the
    end, over the first half (a thread's running max stays -inf for several groups), everywhere but
    one element (lse = that logit, loss 0); NaN anywhere makes the row's loss NaN."""
    n, v = 5, 50301  # odd: rows start off the 16-byte grid, so head and tail elements are in play
    logits = random_array(rng, (n, v), dtype, scale=2.0)
    neg = -np.inf
    logits[0, 50257:] = neg
    logits[1, : v // 2] = neg
    logits[2, :] = neg
    logits[2, 777] = 3.0
    logits[3, 1:] = neg  # only the first element, a head element (row 3 starts 14 or 12 bytes off)
    t = np.array([5, v - 3, 777, 0, 9], dtype=np.int64)
    ref_loss, ref_cache = cross_entropy_forward(logits, t)
    ref_g = cross_entropy_backward(ref_cache)
    loss, cache = cross_entropy_forward(cp.asarray(logits), cp.asarray(t), method=method)
    assert np.isfinite(backend.to_numpy(cache.lse)).all()
    assert_close(cache.lse, ref_cache.lse, rtol=1e-5, name="lse")
    assert_close(loss, ref_loss, rtol=1e-5, name="loss")
    assert_close(cross_entropy_backward(cache, out=poisoned((n, v), dtype, cp)), ref_g, dtype, name="dlogits")
    bad = logits.copy()
    bad[4, 12345] = np.nan
    loss_nan, cache_nan = cross_entropy_forward(cp.asarray(bad), cp.asarray(t), method=method)
    lse = backend.to_numpy(cache_nan.lse)
    assert np.isnan(float(loss_nan)) and np.isnan(lse[4]) and np.isfinite(lse[:4]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", FUSED_METHODS)
def test_gpu_bad_inputs(cp, rng, method):
    logits = random_array(rng, (4, 6), "fp32")
    t = _targets(rng, 4, 6)
    with pytest.raises(TypeError, match="targets=ndarray|targets=numpy"):
        cross_entropy_forward(cp.asarray(logits), t, method=method)
    with pytest.raises(TypeError, match="targets has dtype float32"):
        cross_entropy_forward(cp.asarray(logits), cp.asarray(t, dtype=cp.float32), method=method)
    with pytest.raises(ValueError, match="targets must have shape"):
        cross_entropy_forward(cp.asarray(logits), cp.asarray(t[:2]), method=method)
    with pytest.raises(TypeError, match="float64"):
        cross_entropy_forward(cp.asarray(logits, dtype=cp.float64), cp.asarray(t), method=method)
    _, cache = cross_entropy_forward(cp.asarray(logits), cp.asarray(t), method=method)
    with pytest.raises(ValueError, match="out"):
        cross_entropy_backward(cache, out=cp.empty((4, 7), cp.float32))
    assert rel_error(cross_entropy_backward(cache, np.float32(2.0)), 2 * cross_entropy_backward(cache)) < 1e-6


def test_naive_refuses_fp16_whose_stored_probabilities_underflow(rng):
    """What the naive path would store in fp16 at GPT-2's vocabulary: the target probabilities of
    unlikely tokens flush to 0 (-log 0 = inf); the fused path's lse - x_t stays finite. So the naive
    path refuses fp16, on NumPy as on the GPU."""
    n, v = 64, 50257
    logits = random_array(rng, (n, v), "fp32", scale=2.0)
    t = logits.argmin(axis=1).astype(np.int64)  # an unlikely token per row: p_t ~ 1e-9
    p_t = softmax_forward(logits)[np.arange(n), t]
    assert np.all(p_t > 0) and np.all(p_t.astype(np.float16) == 0)
    l16 = logits.astype(np.float16)
    loss, _ = cross_entropy_forward(l16, t, method="fast")
    assert np.isfinite(float(loss))
    with pytest.raises(TypeError, match="method='naive'.*fp16"):
        cross_entropy_forward(l16, t, method="naive")


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_fp16_realistic_size(cp, rng, method):
    """fp16 logits at 1000 x 50257: the fused methods give the reference's finite loss; naive refuses."""
    n, v = 1000, 50257
    logits = random_array(rng, (n, v), "fp16", scale=2.0)
    t = _targets(rng, n, v)
    if method == "naive":
        with pytest.raises(TypeError, match="fp16"):
            cross_entropy_forward(cp.asarray(logits), cp.asarray(t), method=method)
        return
    ref_loss, _ = cross_entropy_forward(logits, t)
    loss, cache = cross_entropy_forward(cp.asarray(logits), cp.asarray(t), method=method)
    assert np.isfinite(float(loss))
    assert_close(loss, ref_loss, rtol=1e-5)
    assert np.isfinite(backend.to_numpy(cross_entropy_backward(cache)).astype(np.float32)).all()
