"""NaN and ±inf through every op and method: nothing silently finite (issue 13).

Each ``_case_*`` builds inputs with NaN/±inf at known places, runs the op on ``xp`` (NumPy: the
reference; CuPy: the kernel of ``method``) and asserts what each output element must be:

* softmax fwd: NaN or +inf among a row's visible entries -> the whole row NaN (inf - inf, as
  PyTorch); -inf entries -> p exactly 0, the row finite; a row of only -inf -> NaN; causal masked
  entries are never read: a NaN there changes nothing, and they stay exactly 0 in a NaN row.
  bwd: a NaN in a row's visible p or dp -> that row of dx NaN (through sum p*dp); +inf in dp -> every
  entry of the row non-finite (NaN at the +inf, -inf or NaN elsewhere); masked dx exactly 0.
* layernorm fwd: NaN or ±inf in a row -> y, mean/rstd of that row NaN (x - mean = inf - inf).
  bwd: NaN in dy[r, c] -> dx row r, dgamma[c], dbeta[c] NaN, the rest finite.
* gelu (elementwise): fwd NaN -> NaN, +inf -> +inf, -inf -> NaN, huge finite -> finite; bwd NaN in x
  or dy -> NaN, x = ±inf -> NaN, huge finite x -> finite (the module docstring).
* cross_entropy: NaN or +inf in a counted row -> loss NaN, that row's gradient NaN, other rows
  finite; -inf off the target -> finite, as the reference; -inf at a target -> loss +inf, gradient
  finite; an ignored row holding NaN -> loss finite, its gradient row exactly 0.
* attention (causal, math path): a NaN row q_i -> o_i NaN, other rows finite; dq_i NaN, other dq rows
  finite; dv_j NaN for j <= i, finite after; dk all NaN (the dK GEMM multiplies the masked zeros of
  dS by q_i). A NaN row k_j -> o_i NaN for i >= j, finite for i < j (column j masked there).
* linear: NaN in x row r -> y row r NaN; in w row o -> y column o NaN; in b[o] -> y column o NaN.
  bwd: NaN in dy[r, o] -> dx row r, dw row o, db[o] NaN, the rest finite.
* embedding backward: NaN in dx[b, t, c] -> dwte[idx[b, t], c] and dwpe[t, c] NaN; +inf likewise
  gives +inf; everything else finite.

The NumPy runs check the references; the GPU runs (marked ``gpu``) every method and dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import attention as att
from llmgpu.ops import cross_entropy as ce
from llmgpu.ops import embedding as em
from llmgpu.ops import gelu as ge
from llmgpu.ops import layernorm as ln
from llmgpu.ops import linear as li
from llmgpu.ops import softmax as sm
from llmgpu.testing import assert_close, random_array

NAN, INF = np.nan, np.inf
GPU_DTYPES = ["fp32", "bf16", "fp16"]


def _host(a):
    return backend.to_numpy(a).astype(np.float64)


def _dev(a, xp):
    return backend.to_device(np.ascontiguousarray(a), xp)


def _all_nan(a):
    return bool(np.all(np.isnan(a)))


def _all_finite(a):
    return bool(np.all(np.isfinite(a)))


# --------------------------------------------------------------------------- softmax


def _case_softmax_forward(xp, rng, dtype, method, cols):
    x = random_array(rng, (10, cols), dtype, scale=2.0)
    w = min(8, cols)  # one 16-byte vector of the block kernel (8 16-bit or 2 fp32 vectors)
    x[1, cols // 2] = NAN
    x[2, cols - 1] = INF
    x[3, ::2] = -INF  # column 1 stays finite
    x[4, :] = -INF
    x[5, :w] = NAN  # a whole vector of NaN (the block kernel's max must not skip it)
    x[6, :] = -INF
    x[6, cols - 1] = NAN  # only -inf and one NaN, in a later lane / thread than the first
    x[7, :] = NAN
    x[8, 0] = NAN  # the first element
    p = _host(sm.softmax_forward(_dev(x, xp), method=method))
    for r in (1, 2, 4, 5, 6, 7, 8):
        assert _all_nan(p[r]), f"row {r}: {p[r][:8]}"
    good = [0, 3, 9]
    assert _all_finite(p[good])
    assert np.all(p[3, ::2] == 0.0)
    ref = sm.softmax_forward(np.ascontiguousarray(x[good]).astype(np.float32))
    assert_close(p[good], ref, dtype)


def _case_softmax_causal(xp, rng, dtype, method, t):
    x = random_array(rng, (2, t, t), dtype)
    x[0, 3, t - 1] = NAN  # masked (key after the query): never read
    x[1, 5, 2] = NAN  # visible
    x[1, 6, t - 1] = INF  # masked
    p = _host(sm.softmax_forward(_dev(x, xp), method=method, causal=True))
    assert _all_nan(p[1, 5, :6]) and np.all(p[1, 5, 6:] == 0.0)
    rest = np.ones((2, t), bool)
    rest[1, 5] = False
    assert _all_finite(p[rest])
    clean = x.astype(np.float32)
    clean[0, 3, t - 1] = clean[1, 6, t - 1] = 0.0
    ref = sm.softmax_forward(clean, causal=True)
    assert_close(p[0], ref[0], dtype)
    assert_close(p[1, 6], ref[1, 6], dtype)


def _case_softmax_backward(xp, rng, dtype, method, cols):
    p = sm.softmax_forward(random_array(rng, (6, cols), "fp32")).astype(backend.resolve_dtype(dtype))
    dp = random_array(rng, (6, cols), dtype)
    j = cols // 3
    dp[1, j] = NAN
    p[2, j] = NAN
    dp[3, j] = INF
    dx = _host(sm.softmax_backward(_dev(dp, xp), _dev(p, xp), method=method))
    assert _all_nan(dx[1]) and _all_nan(dx[2])
    assert np.isnan(dx[3, j]) and not np.any(np.isfinite(dx[3]))
    good = [0, 4, 5]
    assert _all_finite(dx[good])
    ref = sm.softmax_backward(np.ascontiguousarray(dp[good]), np.ascontiguousarray(p[good]))
    assert_close(dx[good], ref, dtype, scale=np.abs(_host(ref)).sum() + 1.0)


def _case_softmax_backward_causal(xp, rng, dtype, method, t):
    p = sm.softmax_forward(random_array(rng, (2, t, t), "fp32"), causal=True).astype(backend.resolve_dtype(dtype))
    dp = random_array(rng, (2, t, t), dtype)
    dp[0, 2, t - 1] = NAN  # masked
    dp[1, 4, 1] = NAN  # visible
    dx = _host(sm.softmax_backward(_dev(dp, xp), _dev(p, xp), method=method, causal=True))
    assert _all_nan(dx[1, 4, :5]) and np.all(dx[1, 4, 5:] == 0.0)
    assert _all_finite(dx[0]) and np.all(dx[0, 2, 3:] == 0.0)


# --------------------------------------------------------------------------- layernorm


def _case_layernorm(xp, rng, dtype, method, c):
    x = random_array(rng, (6, c), dtype)
    g = random_array(rng, (c,), dtype)
    b = random_array(rng, (c,), dtype)
    x[1, c // 2] = NAN
    x[2, 0] = INF
    x[3, c - 1] = -INF
    y, mean, rstd = ln.layernorm_forward(_dev(x, xp), _dev(g, xp), _dev(b, xp), method=method)
    yh, mh, rh = _host(y), _host(mean), _host(rstd)
    for r in (1, 2, 3):
        assert _all_nan(yh[r]) and np.isnan(rh[r]), f"row {r}"
    assert np.isnan(mh[1])
    good = [0, 4, 5]
    assert _all_finite(yh[good]) and _all_finite(mh[good]) and _all_finite(rh[good])

    xf = x.copy()
    xf[1:4] = random_array(rng, (3, c), dtype)  # finite x: the backward case is dy's
    y, mean, rstd = ln.layernorm_forward(_dev(xf, xp), _dev(g, xp), _dev(b, xp), method=method)
    dy = random_array(rng, (6, c), dtype)
    dy[2, c // 3] = NAN
    dx, dg, db = ln.layernorm_backward(_dev(dy, xp), _dev(xf, xp), _dev(g, xp), mean, rstd, method=method)
    dx, dg, db = _host(dx), _host(dg), _host(db)
    assert _all_nan(dx[2]) and np.isnan(dg[c // 3]) and np.isnan(db[c // 3])
    others = np.arange(c) != c // 3
    assert _all_finite(np.delete(dx, 2, axis=0)) and _all_finite(dg[others]) and _all_finite(db[others])


# --------------------------------------------------------------------------- gelu


def _gelu_positions(n):
    return [1, 9, 17, 500, 501, 600, n - 1] if n > 700 else list(range(7))


def _case_gelu(xp, rng, dtype, method, n, aligned=True):
    i_nan, i_pinf, i_ninf, i_big, i_nbig, i_dynan, i_tail = _gelu_positions(n)
    big = 6e4 if dtype == "fp16" else 1e20  # huge but finite in the dtype
    x = random_array(rng, (n,), dtype, scale=3.0)
    x[i_nan], x[i_pinf], x[i_ninf], x[i_big], x[i_nbig], x[i_tail] = NAN, INF, -INF, big, -big, NAN
    dy = random_array(rng, (n,), dtype)
    dy[i_dynan] = NAN

    def put(a):  # aligned=False: one element into a buffer, so the kernels take their scalar path
        if aligned:
            return _dev(a, xp)
        buf = xp.zeros(n + 1, dtype=a.dtype)
        buf[1:] = _dev(a, xp)
        return buf[1:]

    y = _host(ge.gelu_forward(put(x), method=method))
    assert np.isnan(y[[i_nan, i_ninf, i_tail]]).all()
    assert y[i_pinf] == INF and y[i_big] == np.float64(x[i_big].astype(np.float64)) and y[i_nbig] == 0.0
    rest = np.ones(n, bool)
    rest[[i_nan, i_pinf, i_ninf, i_tail]] = False
    assert _all_finite(y[rest])
    dx = _host(ge.gelu_backward(put(dy), put(x), method=method))
    assert np.isnan(dx[[i_nan, i_pinf, i_ninf, i_tail, i_dynan]]).all()
    assert dx[i_big] == np.float64(dy[i_big].astype(np.float64)) and dx[i_nbig] == 0.0
    rest[i_pinf] = rest[i_dynan] = False
    assert _all_finite(dx[rest])


# --------------------------------------------------------------------------- cross-entropy


def _ce(xp, logits, t, method):
    kw = {} if xp is np else {"method": method}
    loss, cache = ce.cross_entropy_forward(_dev(logits, xp), _dev(t, xp), **kw)
    g = ce.cross_entropy_backward(cache)
    return float(_host(loss)), (None if cache.lse is None else _host(cache.lse)), _host(g)


def _case_cross_entropy(xp, rng, dtype, method, v):
    n = 6
    base = random_array(rng, (n, v), dtype, scale=2.0)
    t = rng.integers(0, v, n).astype(np.int64)
    t[5] = -100  # ignored
    off = [(int(t[r]) + 1) % v for r in range(n)]  # a column that is not the target

    x = base.copy()
    x[1, off[1]] = NAN
    x[2, off[2]] = INF
    x[5, 0] = NAN
    loss, lse, g = _ce(xp, x, t, method)
    assert np.isnan(loss)
    if lse is not None:
        assert np.isnan(lse[[1, 2]]).all() and _all_finite(lse[[0, 3, 4]])
    assert _all_nan(g[1]) and _all_nan(g[2]) and _all_finite(g[[0, 3, 4]]) and np.all(g[5] == 0.0)

    x = base.copy()
    x[1, :] = -INF
    x[1, t[1]] = 1.0
    x[3, off[3]] = -INF
    x[5, :] = NAN  # ignored: never part of the loss
    loss, lse, g = _ce(xp, x, t, method)
    ref_loss, ref_cache = ce.cross_entropy_forward(x, t)
    assert np.isfinite(loss) and np.all(g[5] == 0.0) and _all_finite(g)
    assert_close(np.float32(loss), ref_loss, rtol=2e-2 if method == "naive" and dtype != "fp32" else 1e-5)
    assert_close(g, ce.cross_entropy_backward(ref_cache), dtype)

    x = base.copy()
    x[4, t[4]] = -INF
    loss, lse, g = _ce(xp, x, t, method)
    assert loss == INF and _all_finite(g)


# --------------------------------------------------------------------------- attention


def _case_attention(xp, rng, dtype, method, t):
    shape = (1, 2, t, 16)
    q, k, v, do = (random_array(rng, shape, dtype) for _ in range(4))
    i = t // 2
    qn = q.copy()
    qn[0, 0, i, :] = NAN
    arrs = [_dev(a, xp) for a in (qn, k, v, do)]
    o, stats = att.attention_forward(*arrs[:3], causal=True, method=method)
    dq, dk, dv = (_host(a) for a in att.attention_backward(arrs[3], *arrs[:3], o, stats, causal=True, method=method))
    o = _host(o)
    assert _all_nan(o[0, 0, i]) and _all_finite(np.delete(o[0, 0], i, axis=0)) and _all_finite(o[0, 1])
    assert _all_nan(dq[0, 0, i]) and _all_finite(np.delete(dq[0, 0], i, axis=0))
    assert _all_nan(dv[0, 0, : i + 1]) and _all_finite(dv[0, 0, i + 1 :])
    assert _all_nan(dk[0, 0])
    assert all(_all_finite(a[0, 1]) for a in (dq, dk, dv))  # the other head

    kn = k.copy()
    kn[0, 1, i, 3] = NAN
    o, _ = att.attention_forward(_dev(q, xp), _dev(kn, xp), _dev(v, xp), causal=True, method=method)
    o = _host(o)
    assert _all_nan(o[0, 1, i:]) and _all_finite(o[0, 1, :i]) and _all_finite(o[0, 0])


# --------------------------------------------------------------------------- linear


def _case_linear(xp, rng, dtype):
    x = random_array(rng, (5, 8), dtype)
    w = random_array(rng, (6, 8), dtype)
    b = random_array(rng, (6,), dtype)
    x[1, 2] = NAN
    w[3, 5] = NAN
    b[4] = NAN
    y = _host(li.linear_forward(_dev(x, xp), _dev(w, xp), _dev(b, xp)))
    assert _all_nan(y[1]) and _all_nan(y[:, 3]) and _all_nan(y[:, 4])
    keep = np.ix_([0, 2, 3, 4], [0, 1, 2, 5])
    assert _all_finite(y[keep])

    xf = random_array(rng, (5, 8), dtype)
    wf = random_array(rng, (6, 8), dtype)
    dy = random_array(rng, (5, 6), dtype)
    dy[2, 4] = NAN
    dx, dw, db = (_host(a) for a in li.linear_backward(_dev(dy, xp), _dev(xf, xp), _dev(wf, xp)))
    assert _all_nan(dx[2]) and _all_nan(dw[4]) and np.isnan(db[4])
    assert _all_finite(np.delete(dx, 2, axis=0)) and _all_finite(np.delete(dw, 4, axis=0))
    assert _all_finite(np.delete(db, 4))


# --------------------------------------------------------------------------- embedding backward


def _case_embedding_backward(xp, rng, dtype, method, c):
    b, t, vocab, max_t = 2, 5, 11, 8
    idx = rng.integers(0, vocab, (b, t)).astype(np.int64)
    idx[1, 3] = idx[0, 1]  # the NaN's token appears twice
    idx[1, 4] = idx[0, 0] = 10
    idx[idx == 9] = 8  # token 9 unused
    dx = random_array(rng, (b, t, c), dtype)
    dx[0, 1, 2] = NAN
    dx[0, 0, c - 1] = INF
    kw = {} if xp is np else {"method": method}
    dwte, dwpe = (_host(a) for a in em.embedding_backward(_dev(dx, xp), _dev(idx, xp), vocab, max_t, **kw))
    tok = int(idx[0, 1])
    assert np.isnan(dwte[tok, 2]) and np.isnan(dwpe[1, 2])
    assert dwte[10, c - 1] == INF and dwpe[0, c - 1] == INF
    nan_or_inf = np.zeros_like(dwte, bool)
    nan_or_inf[tok, 2] = nan_or_inf[10, c - 1] = True
    assert _all_finite(dwte[~nan_or_inf])
    pe = np.zeros_like(dwpe, bool)
    pe[1, 2] = pe[0, c - 1] = True
    assert _all_finite(dwpe[~pe]) and np.all(dwpe[t:] == 0.0) and np.all(dwte[9] == 0.0)


# --------------------------------------------------------------------------- NumPy (the references)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cols", [7, 129, 1001])
def test_softmax_reference(rng, dtype, cols):
    _case_softmax_forward(np, rng, dtype, "auto", cols)
    _case_softmax_backward(np, rng, dtype, "auto", cols)


def test_softmax_reference_causal(rng):
    _case_softmax_causal(np, rng, "fp32", "auto", 9)
    _case_softmax_backward_causal(np, rng, "fp32", "auto", 9)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_layernorm_reference(rng, dtype):
    _case_layernorm(np, rng, dtype, "optimized", 40)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [7, 1005])
def test_gelu_reference(rng, dtype, n):
    _case_gelu(np, rng, dtype, "fast", n)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("v", [7, 1003])
def test_cross_entropy_reference(rng, dtype, v):
    _case_cross_entropy(np, rng, dtype, "fast", v)


def test_attention_reference(rng):
    _case_attention(np, rng, "fp32", "auto", 16)


def test_linear_reference(rng):
    _case_linear(np, rng, "fp32")


def test_embedding_backward_reference(rng):
    _case_embedding_backward(np, rng, "fp32", "optimized", 8)


# --------------------------------------------------------------------------- GPU (every method)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", sm.METHODS)
@pytest.mark.parametrize("cols", [7, 8, 129, 1001, 1024, 50257])
def test_gpu_softmax(cp, rng, dtype, method, cols):
    """cols 8 and 1024 take the block kernel's vector path, the others its scalar one."""
    _case_softmax_forward(cp, rng, dtype, method, cols)
    _case_softmax_backward(cp, rng, dtype, method, cols)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", sm.METHODS)
@pytest.mark.parametrize("t", [9, 64])
def test_gpu_softmax_causal(cp, rng, dtype, method, t):
    _case_softmax_causal(cp, rng, dtype, method, t)
    _case_softmax_backward_causal(cp, rng, dtype, method, t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", ln.METHODS)
@pytest.mark.parametrize("c", [40, 768, 1001])
def test_gpu_layernorm(cp, rng, dtype, method, c):
    _case_layernorm(cp, rng, dtype, method, c)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", ge.METHODS)
@pytest.mark.parametrize("n", [7, 1005, 4096 + 3])
@pytest.mark.parametrize("aligned", [True, False])
def test_gpu_gelu(cp, rng, dtype, method, n, aligned):
    _case_gelu(cp, rng, dtype, method, n, aligned)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", ce.METHODS)
@pytest.mark.parametrize("v", [7, 1003, 50257])
def test_gpu_cross_entropy(cp, rng, dtype, method, v):
    if method == "naive" and dtype == "fp16":
        with pytest.raises(TypeError, match="naive"):
            ce.cross_entropy_forward(cp.zeros((2, v), cp.float16), cp.zeros(2, cp.int64), method=method)
        return
    _case_cross_entropy(cp, rng, dtype, method, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", sm.METHODS)
@pytest.mark.parametrize("t", [16, 67])
def test_gpu_attention(cp, rng, dtype, method, t):
    _case_attention(cp, rng, dtype, method, t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_linear(cp, rng, dtype):
    _case_linear(cp, rng, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("method", em.METHODS)
@pytest.mark.parametrize("c", [8, 768])
def test_gpu_embedding_backward(cp, rng, dtype, method, c):
    _case_embedding_backward(cp, rng, dtype, method, c)
