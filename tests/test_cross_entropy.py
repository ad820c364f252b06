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
    cross_entropy_forward_backward,
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


# --------------------------------------------------------------------------- fused forward + backward
# cross_entropy_forward_backward: the loss as a sum over the counted rows (added into loss_sum= when
# given), the gradient divided by n_total (the whole batch's count when the rows are one chunk of it).


def _separate(logits, t, dloss, n_total=None, ignore_index=-100):
    """What the fused op must give, from the separate forward and backward: (loss sum, dlogits)."""
    loss, cache = cross_entropy_forward(logits, t, ignore_index=ignore_index)
    n = int(cache.n_valid)
    if n_total is not None:
        cache.n_valid = np.asarray(n_total, dtype=np.int32)
    return float(loss) * n, cross_entropy_backward(cache, dloss)


@pytest.mark.parametrize("shape", [(6, 9), (2, 3, 5)])
def test_forward_backward_matches_finite_differences_and_the_separate_ops(rng, shape):
    logits = rng.standard_normal(shape) * 3.0
    t = _targets(rng, int(np.prod(shape[:-1])), shape[-1], ignore_every=2).reshape(shape[:-1])
    n_valid = int((t != -100).sum())
    for n_total in (None, n_valid + 4, np.asarray(n_valid + 4, np.int64)):
        count = n_valid if n_total is None else int(n_total)
        loss_sum, g = cross_entropy_forward_backward(logits, t, 0.7, n_total)
        assert loss_sum.shape == () and loss_sum.dtype == np.float64 and g.shape == logits.shape
        want_sum, want_g = _separate(logits, t, 0.7, count)
        assert abs(float(loss_sum) - want_sum) <= 1e-12 * abs(want_sum)
        np.testing.assert_array_equal(g, want_g)  # the same reference backward, the same bits
        # the gradient of dloss * loss_sum / n_total, in float64 finite differences
        check_gradient(lambda: 0.7 * float(cross_entropy_forward_backward(logits, t, 1.0, n_total)[0]) / count,
                       logits, g, name="dlogits")
        np.testing.assert_array_equal(g.reshape(-1, shape[-1])[t.reshape(-1) == -100], 0.0)


def test_forward_backward_accumulates_chunks_and_writes_in_place(rng):
    n, v = 13, 11
    logits = random_array(rng, (n, v), "fp32", scale=3.0)
    t = _targets(rng, n, v, np.int32)
    n_total = int((t != -100).sum())
    whole, g_whole = cross_entropy_forward_backward(logits, t, 2.0)
    work = logits.copy()
    acc = None
    for r0 in range(0, n, 5):  # chunks of 5, 5, 3 rows, the gradient over the whole batch's count
        part = work[r0:r0 + 5]
        res, g = cross_entropy_forward_backward(part, t[r0:r0 + 5], 2.0, n_total, out=part, loss_sum=acc)
        assert g is part and (acc is None or res is acc)
        acc = res
    assert abs(float(acc) - float(whole)) <= 1e-6 * abs(float(whole))
    np.testing.assert_array_equal(work, g_whole)  # each row's gradient is its own: bit for bit
    # all rows ignored: loss 0, zero gradient (n_total 0 divides by 1)
    ls, g0 = cross_entropy_forward_backward(logits, np.full(n, -100), 1.0, 0)
    assert float(ls) == 0.0 and not g0.any()
    ls, _ = cross_entropy_forward_backward(logits, np.arange(n) % v, 1.0, ignore_index=3)
    assert abs(float(ls) / int((np.arange(n) % v != 3).sum()) - _loss64(logits, np.arange(n) % v, 3)) < 1e-5


def test_forward_backward_bad_inputs(rng):
    logits = random_array(rng, (4, 6), "fp32")
    t = _targets(rng, 4, 6)
    with pytest.raises(ValueError, match="targets must lie"):
        cross_entropy_forward_backward(logits, np.array([0, 6, 1, 2]))
    with pytest.raises(TypeError, match="n_total"):
        cross_entropy_forward_backward(logits, t, 1.0, 3.0)
    with pytest.raises(TypeError, match="n_total"):
        cross_entropy_forward_backward(logits, t, 1.0, np.asarray(3.0))
    with pytest.raises(ValueError, match="dloss"):
        cross_entropy_forward_backward(logits, t, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        cross_entropy_forward_backward(logits, t, out=np.empty((4, 7), np.float32))
    with pytest.raises(TypeError, match="loss_sum"):
        cross_entropy_forward_backward(logits, t, loss_sum=np.zeros((), np.float64))


def _fb_gpu(cp, logits, t, dloss=0.5, n_total=None, **kw):
    return cross_entropy_forward_backward(cp.asarray(logits), cp.asarray(t), dloss, n_total, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("v", [7, 1003, 50257, 50304])
def test_gpu_forward_backward_matches_reference(cp, rng, dtype, n, v):
    """Odd V (rows start anywhere: head and tail elements), GPT-2's V padded and not, fp32 (whose long rows
    are not staged in shared memory) and the 16-bit types (staged), ignored rows, poisoned outputs, the
    count and dloss as device scalars."""
    logits = random_array(rng, (n, v), dtype, scale=2.0)
    t = _targets(rng, n, v, ignore_every=3 if n > 1 else 0)
    n_total = int((t != -100).sum()) + 5  # as for one chunk of a larger batch
    want_sum, want_g = _separate(logits, t, 0.5, n_total)
    loss_sum, g = _fb_gpu(cp, logits, t, cp.asarray(0.5, cp.float32), cp.asarray(n_total, cp.int32),
                          out=poisoned((n, v), dtype, cp))
    assert backend.is_gpu_array(loss_sum) and loss_sum.shape == () and loss_sum.dtype == np.float32
    assert abs(float(loss_sum) - want_sum) <= 1e-5 * max(abs(want_sum), 1.0)
    assert_close(g, want_g, dtype, name="dlogits")
    ld = cp.asarray(logits)
    ls2, g2 = cross_entropy_forward_backward(ld, cp.asarray(t), 0.5, n_total, out=ld)  # in place, host scalars
    assert g2 is ld and float(ls2) == float(loss_sum)
    np.testing.assert_array_equal(backend.to_numpy(g2).view(np.uint8), backend.to_numpy(g).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tdtype", [np.int32, np.int64])
def test_gpu_forward_backward_leading_axes_misaligned_out_and_unstaged(cp, rng, monkeypatch, dtype, tdtype):
    """[B, T, V] logits; an out whose 16-byte phase differs from the logits' (the scalar kernel); and the
    kernel that reads each row twice from global memory instead of staging it (forced): the same bits."""
    from llmgpu.kernels.launch import SMLimits
    from llmgpu.ops import cross_entropy as ce

    b, t_len, v = 2, 5, 50257
    logits = random_array(rng, (b, t_len, v), dtype)
    t = _targets(rng, b * t_len, v, tdtype).reshape(b, t_len)
    _, want_g = _separate(logits, t, 1.0)
    ls, g = _fb_gpu(cp, logits, t, 1.0)
    assert g.shape == (b, t_len, v)
    assert_close(g, want_g.reshape(b, t_len, v), dtype)
    buf = cp.full(logits.size + 1, np.nan, dtype=g.dtype)
    out = buf[1:].reshape(b, t_len, v)
    ls_s, g_s = _fb_gpu(cp, logits, t, 1.0, out=out)
    assert g_s is out and abs(float(ls_s) - float(ls)) <= 1e-6 * abs(float(ls))
    assert_close(g_s, want_g.reshape(b, t_len, v), dtype)
    monkeypatch.setattr(ce, "device_limits", lambda xp=None: SMLimits(smem_per_sm=1024))  # nothing fits
    ls_u, g_u = _fb_gpu(cp, logits, t, 1.0)
    assert float(ls_u) == float(ls)
    np.testing.assert_array_equal(backend.to_numpy(g_u).view(np.uint8), backend.to_numpy(g).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_forward_backward_bad_targets_ignored_chunks_and_nonfinite_logits(cp, rng, dtype):
    """Out-of-range targets: NaN loss and NaN gradient row (no out-of-bounds read); an all-ignored chunk:
    loss 0, zero gradient; NaN or +inf in a counted row: that row's loss and gradient NaN, the others
    finite; -inf and padded (-1e4) logits: gradient exactly 0 there."""
    n, v = 6, 50304
    logits = random_array(rng, (n, v), dtype, scale=2.0)
    t = np.array([1, 2, v, 3, -7, 4], dtype=np.int64)
    ls, g = _fb_gpu(cp, logits, t, 1.0, out=poisoned((n, v), dtype, cp))
    g = backend.to_numpy(g).astype(np.float32)
    assert np.isnan(float(ls)) and np.isnan(g[[2, 4]]).all() and np.isfinite(g[[0, 1, 3, 5]]).all()
    ls, g = _fb_gpu(cp, logits, np.full(n, -100), 1.0, cp.asarray(17, cp.int32), out=poisoned((n, v), dtype, cp))
    assert float(ls) == 0.0 and not cp.any(g)
    ls, g = _fb_gpu(cp, logits, np.full(n, -100), 1.0, 0)
    assert float(ls) == 0.0 and not cp.any(g)
    bad = logits.copy()
    bad[1, 777] = np.nan
    bad[3, 5] = np.inf
    bad[4, 50257:] = -1e4  # FastGPT's PAD_LOGIT
    bad[5, :100] = -np.inf
    t = np.array([0, 1, 2, 3, 4, 200], dtype=np.int64)
    ls, g = _fb_gpu(cp, bad, t, 1.0)
    g = backend.to_numpy(g).astype(np.float32)
    assert np.isnan(float(ls))
    assert np.isnan(g[1]).all() and np.isnan(g[3]).all() and np.isfinite(g[[0, 2, 4, 5]]).all()
    assert (g[4, 50257:] == 0).all() and (g[5, :100] == 0).all()
    keep = [0, 2, 4, 5]
    want_sum, want_g = _separate(bad[keep], t[keep], 1.0, n)
    ls_k, g_k = _fb_gpu(cp, bad[keep], t[keep], 1.0, n)
    assert abs(float(ls_k) - want_sum) <= 1e-5 * abs(want_sum)
    assert_close(g_k, want_g, dtype)
    np.testing.assert_array_equal(g[keep], backend.to_numpy(g_k).astype(np.float32))  # rows are independent


@pytest.mark.gpu
def test_gpu_forward_backward_chunks_accumulate_deterministic_and_capturable(cp, rng):
    """Chunks of one batch: the loss sums add up to the whole batch's (device scalar), every gradient row
    bit for bit the unchunked one; three runs give the same bits; one CUDA graph of the chunked head
    replays with new logits and targets."""
    from llmgpu.perf.graphs import capture

    n, v, r = 1000, 50304, 384
    logits = random_array(rng, (n, v), "bf16", scale=2.0)
    t = _targets(rng, n, v)
    whole, g_whole = _fb_gpu(cp, logits, t, 1.0)
    g_whole = backend.to_numpy(g_whole)
    runs = []
    for _ in range(3):
        ld, td = cp.asarray(logits), cp.asarray(t)
        n_total = (td != -100).sum(dtype=np.int32)
        acc = None
        for r0 in range(0, n, r):
            acc, _ = cross_entropy_forward_backward(ld[r0:r0 + r], td[r0:r0 + r], 1.0, n_total,
                                                    out=ld[r0:r0 + r], loss_sum=acc)
        runs.append((backend.to_numpy(acc).tobytes(), backend.to_numpy(ld).tobytes()))
    assert runs[0] == runs[1] == runs[2]
    assert abs(float(np.frombuffer(runs[0][0], np.float32)[0]) - float(whole)) <= 1e-5 * abs(float(whole))
    assert runs[0][1] == g_whole.tobytes()

    ld, td = cp.asarray(logits), cp.asarray(t)
    dloss = cp.asarray(0.25, cp.float32)

    def head():
        n_total = (td != -100).sum(dtype=np.int32)
        acc = None
        for r0 in range(0, n, r):
            acc, _ = cross_entropy_forward_backward(ld[r0:r0 + r], td[r0:r0 + r], dloss, n_total,
                                                    out=ld[r0:r0 + r], loss_sum=acc)
        return acc

    g = capture(head)
    for k in range(2):
        x = random_array(rng, (n, v), "bf16", scale=2.0)
        tt = _targets(rng, n, v, ignore_every=3 + k)
        ld[...] = cp.asarray(x)
        td[...] = cp.asarray(tt)
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        want_sum, want_g = _separate(x, tt, 0.25)
        assert abs(float(g.outputs) - want_sum) <= 1e-5 * abs(want_sum)
        assert_close(ld, want_g, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_forward_backward_matches_the_fast_forward_and_backward(cp, rng, dtype):
    """Against the kernels it replaces (method "fast" forward, fused backward) at GPT-2's chunk shape."""
    n, v = 2048, 50304
    logits = random_array(rng, (n, v), dtype, scale=2.0)
    t = _targets(rng, n, v, ignore_every=7)
    ld = cp.asarray(logits)
    loss, cache = cross_entropy_forward(ld, cp.asarray(t), method="fast")
    g_old = cross_entropy_backward(cache, 1.0)
    ls, g_new = _fb_gpu(cp, logits, t, 1.0)
    assert abs(float(ls) / int(cache.n_valid) - float(loss)) <= 1e-5 * float(loss)
    assert_close(g_new, g_old, dtype)
