"""RoPE (Hugging Face Llama's rotate_half layout): tables, the rotation against HF's formula, backward as the
transpose (and inverse), finite differences, the relative-position property, in place, argument checks;
CUDA kernel vs the reference."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.rope import rope_backward, rope_forward, rope_tables
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3
GPU_DTYPES = ["fp32", "bf16", "fp16"]


def _hf_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb, in float64: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),
    rotate_half(x) = cat(-x2, x1)."""
    x = x.astype(np.float64)
    t, half = x.shape[-2], x.shape[-1] // 2
    c = np.concatenate([cos[:t], cos[:t]], axis=-1).astype(np.float64)
    s = np.concatenate([sin[:t], sin[:t]], axis=-1).astype(np.float64)
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * c + rot * s


def _tables64(seq, d, theta=10000.0):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


# --------------------------------------------------------------------------- tables


def test_tables_formula_and_hf_fp32():
    cos, sin = rope_tables(2048, 128, xp=np)
    assert cos.shape == sin.shape == (2048, 64) and cos.dtype == sin.dtype == np.float32
    c64, s64 = _tables64(2048, 128)
    np.testing.assert_allclose(cos, c64, rtol=0, atol=6e-8)  # one fp32 rounding
    np.testing.assert_allclose(sin, s64, rtol=0, atol=6e-8)
    assert cos[0].tolist() == [1.0] * 64 and sin[0].tolist() == [0.0] * 64
    # transformers' LlamaRotaryEmbedding: inv_freq and t * inv_freq in fp32; agrees to t * 2^-24 rad
    inv32 = (1.0 / (np.float32(10000.0) ** (np.arange(0, 128, 2).astype(np.float32) / np.float32(128))))
    ang32 = np.arange(2048, dtype=np.float32)[:, None] * inv32.astype(np.float32)[None, :]
    np.testing.assert_allclose(cos, np.cos(ang32.astype(np.float64)), rtol=0, atol=2048 * 2.0**-23)
    c2, _ = rope_tables(16, 8, theta=500000.0, xp=np)  # Llama 3's theta
    np.testing.assert_allclose(c2, _tables64(16, 8, 500000.0)[0], rtol=0, atol=6e-8)


def test_tables_bad_arguments():
    with pytest.raises(ValueError, match="head_dim must be an even integer"):
        rope_tables(8, 7, xp=np)
    with pytest.raises(ValueError, match="seq must be a positive integer"):
        rope_tables(0, 8, xp=np)
    with pytest.raises(ValueError, match="theta must be finite and > 0"):
        rope_tables(8, 8, theta=-1.0, xp=np)


# --------------------------------------------------------------------------- the rotation (NumPy)


@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (1, 1, 1, 2), (2, 7, 6), (3, 4, 10)])
def test_forward_matches_hf_formula(rng, shape):
    x = random_array(rng, shape, "fp32")
    cos, sin = rope_tables(shape[-2] + 3, shape[-1], xp=np)  # tables longer than T: rows 0..T-1 used
    y = rope_forward(x, cos, sin)
    assert y.shape == x.shape and y.dtype == np.float32
    assert_close(y, _hf_rope(x, cos, sin), "fp32")


def test_backward_is_transpose_and_inverse(rng):
    shape = (2, 3, 9, 16)
    x, g = rng.standard_normal(shape), rng.standard_normal(shape)
    cos, sin = (t.astype(np.float64) for t in _tables64(9, 16))
    # <R x, g> = <x, R^T g>, on random inputs, float64
    lhs = float((rope_forward(x, cos, sin) * g).sum())
    rhs = float((x * rope_backward(g, cos, sin)).sum())
    assert lhs == pytest.approx(rhs, rel=1e-13, abs=1e-13)
    # R is orthogonal: R^T R x = x, and the norm of every (head, position) row is kept
    np.testing.assert_allclose(rope_backward(rope_forward(x, cos, sin), cos, sin), x, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np.linalg.norm(rope_forward(x, cos, sin), axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-13)


@pytest.mark.parametrize("shape", [(1, 2, 3, 4), (2, 5, 6)])
def test_backward_matches_finite_differences(rng, shape):
    x = rng.standard_normal(shape)
    r = rng.standard_normal(shape)
    cos, sin = _tables64(shape[-2], shape[-1])
    check_gradient(lambda: float((rope_forward(x, cos, sin) * r).sum()), x, rope_backward(r, cos, sin), name="dx")


def test_scores_depend_on_relative_position_only(rng):
    """q at every position p, k at every position s: scores[p, s] = <R(p) q, R(s) k> is constant along each
    diagonal s - p (a Toeplitz matrix), and differs between diagonals."""
    n_t, d = 12, 16
    q, k = rng.standard_normal(d), rng.standard_normal(d)
    cos, sin = _tables64(n_t, d)
    rq = rope_forward(np.tile(q, (n_t, 1)), cos, sin)
    rk = rope_forward(np.tile(k, (n_t, 1)), cos, sin)
    scores = rq @ rk.T
    for offset in range(-(n_t - 1), n_t):
        diag = np.diagonal(scores, offset)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-12, atol=1e-12)
    firsts = [np.diagonal(scores, o)[0] for o in range(n_t)]
    assert len(set(np.round(firsts, 9))) == n_t
    np.testing.assert_allclose(scores[0, 0], q @ k, rtol=1e-13)  # position 0: no rotation


def test_in_place_and_bf16(rng):
    x = random_array(rng, (2, 2, 5, 8), "bf16")
    cos, sin = rope_tables(5, 8, xp=np)
    want = rope_forward(x, cos, sin)
    assert want.dtype == backend.bfloat16
    assert_close(want, _hf_rope(x.astype(np.float32), cos, sin), "bf16")
    buf = x.copy()
    assert rope_forward(buf, cos, sin, out=buf) is buf
    np.testing.assert_array_equal(buf.view(np.uint16), want.view(np.uint16))
    out = poisoned(x.shape, "bf16", np)
    assert rope_backward(x, cos, sin, out=out) is out and np.all(np.isfinite(out.astype(np.float32)))


def test_nonfinite_rule_reference():
    """NaN at j: y[j] and y[j + half] NaN, the other pairs untouched. +inf at j + half: at position 1
    (sin > 0) y[j] = -inf, y[j + half] = +inf; at position 0 (sin = 0) y[j] = x cos - inf * 0 = NaN."""
    cos, sin = rope_tables(2, 4, xp=np)
    x = np.ones((2, 4), np.float32)
    x[0, 0] = np.nan
    x[1, 3] = np.inf
    y = rope_forward(x, cos, sin)
    np.testing.assert_array_equal(np.isnan(y), [[True, False, True, False], [False] * 4])
    assert y[1, 1] == -np.inf and y[1, 3] == np.inf and np.isfinite(y[1, ::2]).all() and np.isfinite(y[0, 1::2]).all()
    x2 = np.ones((2, 4), np.float32)
    x2[0, 2] = np.inf
    y2 = rope_forward(x2, cos, sin)
    assert np.isnan(y2[0, 0]) and y2[0, 2] == np.inf and np.isfinite(y2[1]).all() and np.isfinite(y2[0, 1::2]).all()


@pytest.mark.parametrize("shape, axis", [((2, 7, 3, 8), 1), ((2, 7, 3, 8), -3), ((7, 2, 6), 0), ((2, 5, 3, 1, 4), 1)])
def test_token_major_layout_rotates_by_the_named_axis(rng, shape, axis):
    """Positions along seq_axis ([B, T, H, D] with seq_axis=1, the fast model's layout) give the same rotation as
    the [..., T, D] layout after moving that axis; forward and backward, in place too."""
    x = random_array(rng, shape, "fp64")
    cos, sin = rope_tables(shape[axis] + 2, shape[-1], xp=np, dtype=np.float64)
    for fn in (rope_forward, rope_backward):
        want = np.moveaxis(fn(np.ascontiguousarray(np.moveaxis(x, axis, -2)), cos, sin), -2, axis)
        np.testing.assert_array_equal(fn(x, cos, sin, seq_axis=axis), want)
        y = x.copy()
        assert fn(y, cos, sin, out=y, seq_axis=axis) is y
        np.testing.assert_array_equal(y, want)


def test_seq_axis_bad_values(rng):
    x = random_array(rng, (2, 5, 3, 8), "fp32")
    cos, sin = rope_tables(5, 8, xp=np)
    for bad in (3, -1, 4, -5, 1.0, "1"):
        with pytest.raises(ValueError, match="seq_axis must name an axis of x before the last"):
            rope_forward(x, cos, sin, seq_axis=bad)
    with pytest.raises(ValueError, match=r"S >= T = 5"):  # T read from the named axis
        rope_forward(x, *rope_tables(3, 8, xp=np), seq_axis=1)


def test_bad_inputs(rng):
    x = random_array(rng, (2, 3, 5, 8), "fp32")
    cos, sin = rope_tables(5, 8, xp=np)
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        rope_forward(random_array(rng, (2, 5, 7), "fp32"), cos, sin)
    with pytest.raises(ValueError, match="at least 2-D"):
        rope_forward(x[0, 0, 0].copy(), cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must have shape \[S, 4\] with S >= T = 5"):
        rope_forward(x, cos[:4].copy(), sin[:4].copy())
    with pytest.raises(ValueError, match="must have shape"):
        rope_forward(x, *rope_tables(5, 16, xp=np))
    with pytest.raises(ValueError, match="sin must have shape"):
        rope_forward(x, cos, sin[:3].copy())
    with pytest.raises(TypeError, match="cos and sin must share one dtype"):
        rope_forward(x, cos, sin.astype(np.float64))
    with pytest.raises(TypeError, match="cos has dtype"):
        rope_forward(x, cos.astype(np.float16), sin.astype(np.float16))
    with pytest.raises(TypeError, match="out must be fp32"):
        rope_forward(x, cos, sin, out=np.empty(x.shape, np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        rope_forward(np.swapaxes(x, 1, 2), cos, sin)
    with pytest.raises(TypeError, match="must be a NumPy or CuPy array"):
        rope_forward(x.tolist(), cos, sin)
    buf = np.zeros(x.size + 8, np.float32)
    with pytest.raises(ValueError, match="out overlaps x without being the same buffer"):
        rope_forward(buf[:x.size].reshape(x.shape), cos, sin, out=buf[8:].reshape(x.shape))


# --------------------------------------------------------------------------- row views (NumPy)


def _qkv(rng, b, t, h, hk, d, pad=0, dtype="fp32", xp=np):
    """A fused q|k|v GEMM's output [B, T, (H + 2 Hk) D + pad] (pad: extra columns, an odd token stride) and the
    [B, T, H + Hk, D] view of q's and k's heads."""
    qkv = random_array(rng, (b, t, (h + 2 * hk) * d + pad), dtype, xp=xp)
    return qkv, qkv[:, :, :(h + hk) * d].reshape(b, t, h + hk, d)


@pytest.mark.parametrize("dims", [(2, 5, 4, 2, 8, 0), (1, 3, 3, 1, 6, 1), (2, 4, 2, 2, 2, 3)])
def test_qk_view_of_qkv_in_place(rng, dims):
    """q's and k's heads rotated in one call, in place inside qkv (seq_axis=1), forward then backward: the same
    values as on a contiguous copy; v's heads and the pad columns untouched."""
    b, t, h, hk, d, pad = dims
    qkv, x = _qkv(rng, b, t, h, hk, d, pad)
    assert np.shares_memory(x, qkv) and not x.flags.c_contiguous
    cos, sin = rope_tables(t + 2, d, xp=np)
    for fn in (rope_forward, rope_backward):
        want = fn(x.copy(), cos, sin, seq_axis=1)
        before = qkv.copy()
        assert fn(x, cos, sin, out=x, seq_axis=1) is x
        np.testing.assert_array_equal(x, want)
        np.testing.assert_array_equal(qkv[..., (h + hk) * d:], before[..., (h + hk) * d:])


def test_row_view_out_and_new_out(rng):
    qkv, x = _qkv(rng, 2, 3, 2, 1, 4, pad=1)
    cos, sin = rope_tables(3, 4, xp=np)
    want = rope_forward(x.copy(), cos, sin, seq_axis=1)
    y = rope_forward(x, cos, sin, seq_axis=1)
    assert y.flags.c_contiguous
    np.testing.assert_array_equal(y, want)
    buf = poisoned((2, 3, 5 * 4), "fp32", np)  # out of its own token stride, poisoned around it
    out = buf[:, :, 4:16].reshape(2, 3, 3, 4)
    assert np.shares_memory(out, buf)
    assert rope_backward(y, cos, sin, out=out, seq_axis=1) is out
    np.testing.assert_allclose(out, x, rtol=1e-6, atol=1e-6)  # R^T R x = x, through the view
    assert np.isnan(buf[:, :, :4]).all() and np.isnan(buf[:, :, 16:]).all()


def test_row_views_nonfinite_rule():
    """NaN at j of one head gives NaN at j and j + half of that head only, through the qkv view."""
    qkv = np.ones((1, 2, 4 * 4), np.float32)
    x = qkv[:, :, :12].reshape(1, 2, 3, 4)
    x[0, 1, 2, 0] = np.nan
    cos, sin = rope_tables(2, 4, xp=np)
    rope_forward(x, cos, sin, out=x, seq_axis=1)
    nan = np.isnan(qkv[0, 1])
    assert nan[8] and nan[10] and nan.sum() == 2 and not np.isnan(qkv[0, 0]).any()


def test_bad_layouts_and_overlapping_views(rng):
    qkv, x = _qkv(rng, 2, 5, 2, 1, 8)
    cos, sin = rope_tables(5, 8, xp=np)
    layout = r"must be C-contiguous, or a view whose last two axes \(heads, head_dim\) are contiguous"
    wide = np.zeros((2, 6, 3, 8), np.float32)
    for bad in (np.swapaxes(qkv.reshape(2, 5, 8, 4), 2, 3)[:, :, :3],  # head_dim not the unit-stride axis
                np.zeros((2, 5, 3, 16), np.float32)[..., ::2],  # head_dim with a step of 2
                wide[:, :5],  # B and T do not collapse into one token stride
                x[:, ::-1]):
        with pytest.raises(ValueError, match=f"^x {layout}"):
            rope_forward(bad, cos, sin, seq_axis=1)
    with pytest.raises(ValueError, match=f"^out {layout}"):
        rope_forward(x, cos, sin, out=wide[:, :5], seq_axis=1)
    with pytest.raises(ValueError, match=f"^dy {layout}"):
        rope_backward(wide[:, :5], cos, sin, seq_axis=1)
    with pytest.raises(ValueError, match="out overlaps x without being the same buffer"):
        rope_forward(x, cos, sin, out=qkv[:, :, 8:32].reshape(2, 5, 3, 8), seq_axis=1)  # shifted by one head


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 64), (1, 2, 7, 6), (2, 4, 33, 128), (1, 1, 1, 2), (3, 17, 10)])
def test_gpu_matches_reference(cp, rng, dtype, shape):
    """Kernel vs reference, forward and backward, outputs poisoned; tolerance: the dtype's (1e-5 fp32, 5e-3
    fp16, 2e-2 bf16, relative norm). (1, 2, 7, 6) and (1, 1, 1, 2): half not a multiple of the pack (scalar
    kernel); tables longer than T."""
    x = random_array(rng, shape, dtype)
    cos, sin = rope_tables(shape[-2] + 5, shape[-1], xp=np)
    xd, cd, sd = cp.asarray(x), cp.asarray(cos), cp.asarray(sin)
    y = rope_forward(xd, cd, sd, out=poisoned(shape, dtype, cp))
    assert_close(y, rope_forward(x, cos, sin), dtype, name="y")
    assert_close(y, _hf_rope(x.astype(np.float32), cos, sin), dtype, name="y vs HF formula")
    dx = rope_backward(xd, cd, sd, out=poisoned(shape, dtype, cp))
    assert_close(dx, rope_backward(x, cos, sin), dtype, name="dx")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_in_place_and_unaligned(cp, rng, dtype):
    shape = (2, 4, 9, 64)
    x = random_array(rng, shape, dtype)
    cos, sin = rope_tables(9, 64, xp=cp)
    want = rope_forward(x, backend.to_numpy(cos), backend.to_numpy(sin))
    xd = cp.asarray(x)
    assert rope_forward(xd, cos, sin, out=xd) is xd  # in place, as the model rotates Q and K
    assert_close(xd, want, dtype, name="y (in place)")
    assert_close(rope_backward(xd, cos, sin, out=xd), x, dtype, name="R^T R x = x (in place)")
    buf = cp.empty(x.size + 1, dtype=x.dtype)  # one element off 16 bytes: the scalar kernel
    buf[1:] = cp.asarray(x).ravel()
    xu = buf[1:].reshape(shape)
    assert xu.data.ptr % 16 != 0
    assert_close(rope_forward(xu, cos, sin), want, dtype, name="y (unaligned)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(2, 9, 3, 64), (1, 5, 9, 64), (2, 7, 4, 6)])
def test_gpu_token_major_layout(cp, rng, dtype, shape):
    """[B, T, H, D] with seq_axis=1 (the fast Llama's layout): the kernel against the reference, in place,
    forward and backward; (2, 7, 4, 6) runs the scalar kernel."""
    x = random_array(rng, shape, dtype)
    cos, sin = rope_tables(shape[1] + 3, shape[-1], xp=np)
    cd, sd = cp.asarray(cos), cp.asarray(sin)
    for fn in (rope_forward, rope_backward):
        xd = cp.asarray(x)
        assert fn(xd, cd, sd, out=xd, seq_axis=1) is xd
        assert_close(xd, fn(x, cos, sin, seq_axis=1), dtype, name=fn.__name__)


@pytest.mark.gpu
def test_gpu_nonfinite_like_reference(cp, rng):
    x = random_array(rng, (1, 2, 4, 16), "fp32")
    x[0, 0, 0, 1] = np.nan
    x[0, 1, 0, 9] = np.inf
    x[0, 1, 3, 2] = -np.inf
    cos, sin = rope_tables(4, 16, xp=np)
    want = rope_forward(x, cos, sin)
    got = backend.to_numpy(rope_forward(cp.asarray(x), cp.asarray(cos), cp.asarray(sin)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    x = random_array(rng, (2, 3, 5, 8), "fp32")
    cos, sin = rope_tables(5, 8, xp=np)
    with pytest.raises(TypeError, match="cos=ndarray|cos=numpy"):
        rope_forward(cp.asarray(x), cos, sin)
    with pytest.raises(TypeError, match="cos and sin must be fp32 on the GPU path"):
        rope_forward(cp.asarray(x), cp.asarray(cos, dtype=cp.float64), cp.asarray(sin, dtype=cp.float64))
    with pytest.raises(TypeError, match="float64"):
        rope_forward(cp.asarray(x, dtype=cp.float64), cp.asarray(cos), cp.asarray(sin))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("dims", [(2, 9, 4, 2, 64, 0), (1, 7, 3, 1, 128, 8), (2, 5, 2, 2, 64, 1), (2, 6, 3, 1, 6, 0)])
def test_gpu_qk_view_of_qkv_bitwise(cp, rng, dtype, dims):
    """q's and k's heads in place inside qkv (seq_axis=1), forward and backward, bitwise against the contiguous
    kernel on a copy; v's heads and the pad untouched; and a poisoned row-view out of another token stride.
    Pad 1 (odd token stride) and D = 6 run the scalar kernel."""
    b, t, h, hk, d, pad = dims
    qkv, x = _qkv(rng, b, t, h, hk, d, pad, dtype, xp=cp)
    assert x.data.ptr == qkv.data.ptr and not x.flags.c_contiguous  # a view, not a copy
    cos, sin = rope_tables(t + 3, d, xp=cp)
    bits = np.uint32 if dtype == "fp32" else np.uint16

    def same(got, w, name):
        np.testing.assert_array_equal(backend.to_numpy(got).view(bits), backend.to_numpy(w).view(bits), err_msg=name)

    for fn in (rope_forward, rope_backward):
        want = fn(x.copy(), cos, sin, seq_axis=1)
        assert_close(want, fn(backend.to_numpy(x), backend.to_numpy(cos), backend.to_numpy(sin), seq_axis=1), dtype,
                     name=f"{fn.__name__} vs reference")
        same(fn(x, cos, sin, seq_axis=1), want, f"{fn.__name__} (new out)")
        buf = poisoned((b, t, (h + hk + 1) * d + 1), dtype, cp)
        out = buf[:, :, 1:(h + hk) * d + 1].reshape(x.shape)
        assert out.data.ptr == buf.data.ptr + buf.itemsize  # a view of buf, not a copy
        assert fn(x, cos, sin, out=out, seq_axis=1) is out
        same(out, want, f"{fn.__name__} (row-view out)")
        around = backend.to_numpy(buf).astype(np.float32)
        assert np.isnan(around[..., 0]).all() and np.isnan(around[..., (h + hk) * d + 1:]).all()
        before = backend.to_numpy(qkv)
        assert fn(x, cos, sin, out=x, seq_axis=1) is x
        same(x, want, f"{fn.__name__} (in place)")
        same(qkv[..., (h + hk) * d:], before[..., (h + hk) * d:], "v heads and pad")


@pytest.mark.gpu
def test_gpu_row_views_nonfinite_and_bad_layouts(cp, rng):
    """NaN and inf through the qkv view (packed kernel) as the reference gives them; bad layouts and an overlapping
    out refused as on NumPy."""
    qkv, x = _qkv(rng, 1, 4, 2, 1, 16, 0, "fp32")
    x[0, 0, 0, 1] = np.nan
    x[0, 1, 2, 9] = np.inf
    x[0, 3, 1, 2] = -np.inf
    cos, sin = rope_tables(4, 16, xp=np)
    want = rope_forward(x.copy(), cos, sin, seq_axis=1)
    qd = cp.asarray(qkv)
    xd = qd[:, :, :48].reshape(1, 4, 3, 16)
    got = backend.to_numpy(rope_forward(xd, cp.asarray(cos), cp.asarray(sin), out=xd, seq_axis=1))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"^x must be C-contiguous, or a view whose last two axes"):
        rope_forward(cp.zeros((1, 4, 3, 32), cp.float32)[..., ::2], cp.asarray(cos), cp.asarray(sin), seq_axis=1)
    with pytest.raises(ValueError, match="out overlaps x without being the same buffer"):
        rope_forward(xd, cp.asarray(cos), cp.asarray(sin), out=qd[:, :, 16:64].reshape(1, 4, 3, 16), seq_axis=1)


def test_method_checked_and_numpy_runs_the_reference(rng):
    from llmgpu.ops import rope

    x = random_array(rng, (2, 5, 4, 8))
    cos, sin = rope_tables(5, 8, xp=np)
    for fn in (rope_forward, rope_backward):
        want = fn(x, cos, sin, seq_axis=1)
        for method in rope.METHODS:
            np.testing.assert_array_equal(fn(x, cos, sin, seq_axis=1, method=method), want)
        with pytest.raises(ValueError, match="method"):
            fn(x, cos, sin, seq_axis=1, method="naive")
    assert rope.HEADS_PER_THREAD == (4, 2) and rope.ROPE_METHOD in rope.METHODS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("dims", [(2, 9, 15, 5, 64, 0), (1, 7, 9, 3, 64, 0), (2, 5, 3, 1, 64, 0), (2, 5, 3, 1, 6, 0),
                                  (1, 4, 5, 1, 64, 8), (1, 4, 3, 0, 64, 0)])
def test_gpu_fast_method_agrees_with_optimized(cp, rng, dtype, dims):
    """method="fast" (HPT heads per thread: SmolLM-360M's 20 and -135M's 12 q|k heads take 4, 4 heads 4, 6 heads
    2, with pad 8 another token stride; 3 heads and D = 6 fall back to "optimized"), on the qkv row view in place
    and on a contiguous [B, T, H, D] copy: within one rounding of "optimized" (the same arithmetic;
    equal unless the compiler contracts it differently), v's heads untouched, and the reference's values."""
    b, t, h, hk, d, pad = dims
    qkv, x = _qkv(rng, b, t, h, hk, d, pad, dtype, xp=cp)
    cos, sin = rope_tables(t, d, xp=cp)
    cos_np, sin_np = backend.to_numpy(cos), backend.to_numpy(sin)
    eps = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype]
    for fn in (rope_forward, rope_backward):
        for view in (x, x.copy()):  # the row view in place, then a contiguous array
            orig = backend.to_numpy(view)
            want = fn(view, cos, sin, seq_axis=1, method="optimized")
            before = backend.to_numpy(qkv)
            got = fn(view, cos, sin, out=view, seq_axis=1, method="fast")
            assert got is view
            g, w = (backend.to_numpy(a).astype(np.float64) for a in (got, want))
            assert np.all(np.abs(g - w) <= eps * np.abs(w) + 1e-6), fn.__name__
            assert_close(got, fn(orig, cos_np, sin_np, seq_axis=1), dtype, name=f"{fn.__name__} fast vs reference")
            np.testing.assert_array_equal(backend.to_numpy(qkv[..., (h + hk) * d:]), before[..., (h + hk) * d:])
