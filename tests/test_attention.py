"""Attention forward/backward: float64 finite differences on the reference, GPU against the reference."""

import math

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.attention import (
    AttentionStats,
    attention_backward,
    attention_flops,
    attention_forward,
)
from llmgpu.perf.sweeps import attention_stage_times
from llmgpu.testing import assert_close, check_gradient, random_array

pytestmark = pytest.mark.ch2

BF16 = backend.bfloat16


def ref_attention(q, k, v, causal):
    """Direct float64 formula with einsum, independent of the package."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, D = q.shape[-2:]
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v)


def qkv(rng, shape, dtype=np.float64, xp=np):
    return tuple(random_array(rng, shape, dtype, xp) for _ in range(3))


# --------------------------------------------------------------------------- NumPy reference


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 1, 3), (2, 2, 5, 8), (1, 3, 17, 4)])
def test_forward_matches_formula(rng, causal, shape):
    q, k, v = qkv(rng, shape)
    o, stats = attention_forward(q, k, v, causal=causal)
    assert o.shape == shape and o.dtype == np.float64
    np.testing.assert_allclose(o, ref_attention(q, k, v, causal), rtol=1e-11, atol=1e-13)
    assert isinstance(stats, AttentionStats) and stats.kind == "probs" and stats.causal == causal
    assert stats.p.shape == (*shape[:2], shape[2], shape[2])
    assert stats.scale == pytest.approx(1 / math.sqrt(shape[3]))


def test_single_token_output_is_v(rng):
    q, k, v = qkv(rng, (2, 2, 1, 6))
    o, _ = attention_forward(q, k, v, causal=True)
    np.testing.assert_allclose(o, v, rtol=1e-14)


@pytest.mark.parametrize(
    "shape,causal",
    [((1, 2, 1, 3), True), ((1, 2, 3, 4), True), ((2, 2, 5, 3), True), ((2, 2, 4, 8), False), ((1, 2, 5, 5), False)],
)
def test_backward_vs_finite_differences(rng, shape, causal):
    q, k, v = qkv(rng, shape)
    w = rng.standard_normal(shape)  # loss = Σ w ⊙ O, so dO = w

    def loss():
        return float((w * attention_forward(q, k, v, causal=causal)[0]).sum())

    o, stats = attention_forward(q, k, v, causal=causal)
    dq, dk, dv = attention_backward(w, q, k, v, o, stats, causal=causal)
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        check_gradient(loss, x, g, rtol=1e-7, name=name)


def test_causal_query_ignores_future_keys(rng):
    q, k, v = qkv(rng, (1, 2, 6, 4))
    o, _ = attention_forward(q, k, v, causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 3:] += 10.0
    v2[:, :, 3:] -= 5.0
    o2, _ = attention_forward(q, k2, v2, causal=True)
    np.testing.assert_array_equal(o[:, :, :3], o2[:, :, :3])


@pytest.mark.parametrize("fp32_scores", [True, False])
def test_bf16_numpy_path(rng, fp32_scores):
    q, k, v = qkv(rng, (1, 2, 9, 8), BF16)
    o, stats = attention_forward(q, k, v, fp32_scores=fp32_scores)
    assert o.dtype == BF16 and stats.p.dtype == BF16
    assert_close(o, ref_attention(q, k, v, True), BF16)
    dq, dk, dv = attention_backward(o, q, k, v, o, stats, fp32_scores=fp32_scores)
    assert dq.dtype == dk.dtype == dv.dtype == BF16


def test_flops_convention():
    assert attention_flops(8, 12, 1024, 64, causal=False) == 4.0 * 8 * 12 * 1024**2 * 64
    assert attention_flops(8, 12, 1024, 64, causal=True, direction="bwd") == 2.5 * 2.0 * 8 * 12 * 1024**2 * 64


def test_stage_times_cover_every_stage(rng):
    q, k, v = qkv(rng, (1, 2, 8, 4), np.float32)
    rows = attention_stage_times(q, k, v, q, reps=1, warmup=0)
    assert [r["pass"] for r in rows] == ["fwd"] * 3 + ["bwd"] * 5
    assert sum(r["kind"] == "softmax" for r in rows) == 2
    assert all(r["ms"] >= 0 for r in rows)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs(rng):
    q, k, v = qkv(rng, (1, 2, 4, 3), np.float32)
    with pytest.raises(ValueError, match="k must have shape"):
        attention_forward(q, k[:, :, :3], v)
    with pytest.raises(ValueError, match="v must have shape"):
        attention_forward(q, k, v[..., :2])
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention_forward(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="dtypes must match"):
        attention_forward(q, k.astype(BF16), v)
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        attention_forward(np.swapaxes(q, 1, 2), k, v)
    with pytest.raises(TypeError, match="q must be a NumPy or CuPy array"):
        attention_forward(q.tolist(), k, v)
    o, stats = attention_forward(q, k, v)
    with pytest.raises(ValueError, match="causal=True"):
        attention_backward(o, q, k, v, o, stats, causal=False)
    with pytest.raises(TypeError, match="AttentionStats"):
        attention_backward(o, q, k, v, o, {"p": stats.p})
    with pytest.raises(ValueError, match="only lse"):
        attention_backward(o, q, k, v, o, AttentionStats(lse=np.zeros((1, 2, 4), np.float32)))
    with pytest.raises(ValueError, match="do must have shape"):
        attention_backward(o[:, :1], q, k, v, o, stats)
    with pytest.raises(TypeError, match="dtypes must match"):
        attention_backward(o.astype(BF16), q, k, v, o, stats)
    with pytest.raises(TypeError, match="stats.p must be fp32, got bfloat16"):
        attention_backward(o, q, k, v, o, AttentionStats(p=stats.p.astype(BF16), scale=stats.scale))


# --------------------------------------------------------------------------- GPU

GPU_SHAPES = [(1, 2, 1, 8), (2, 3, 33, 64), (1, 4, 128, 64), (2, 2, 77, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["naive", "warp", "block", "auto"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_fp32_against_float64_reference(cp, rng, method, causal, shape):
    q, k, v = qkv(rng, shape, np.float32, cp)
    do = random_array(rng, shape, np.float32, cp)
    o, stats = attention_forward(q, k, v, causal=causal, method=method)
    dq, dk, dv = attention_backward(do, q, k, v, o, stats, causal=causal, method=method)
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v, do)]
    ro, rs = attention_forward(*h[:3], causal=causal)
    rdq, rdk, rdv = attention_backward(h[3], *h[:3], ro, rs, causal=causal)
    assert_close(o, ref_attention(*h[:3], causal), rtol=1e-5, name="o")
    for name, got, ref in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(got, ref, rtol=1e-5, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_scores", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_bf16_against_float64_reference(cp, rng, fp32_scores, causal, shape):
    q, k, v = qkv(rng, shape, BF16, cp)
    do = random_array(rng, shape, BF16, cp)
    o, stats = attention_forward(q, k, v, causal=causal, fp32_scores=fp32_scores)
    assert o.dtype == BF16 and stats.p.dtype == BF16
    dq, dk, dv = attention_backward(do, q, k, v, o, stats, causal=causal, fp32_scores=fp32_scores)
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v, do)]
    ro, rs = attention_forward(*h[:3], causal=causal)
    rdq, rdk, rdv = attention_backward(h[3], *h[:3], ro, rs, causal=causal)
    assert_close(o, ro, rtol=2e-2, name="o")
    for name, got, ref in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(got, ref, rtol=2e-2, name=name)


@pytest.mark.gpu
def test_gpu_stage_times(cp, rng):
    q, k, v = qkv(rng, (1, 2, 64, 16), BF16, cp)
    rows = attention_stage_times(q, k, v, q, reps=2, warmup=1)
    assert len(rows) == 8 and all(r["ms"] > 0 for r in rows)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    q, k, v = qkv(rng, (1, 2, 4, 8), np.float32, cp)
    with pytest.raises(TypeError, match="q=cupy, k=ndarray"):
        attention_forward(q, backend.to_numpy(k), v)
    with pytest.raises(TypeError, match="fp32, fp16, bf16"):
        attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    o, stats = attention_forward(q, k, v)
    with pytest.raises(TypeError, match="do=ndarray"):
        attention_backward(backend.to_numpy(o), q, k, v, o, stats)
    with pytest.raises(TypeError, match="stats.p=ndarray"):
        attention_backward(o, q, k, v, o, AttentionStats(p=backend.to_numpy(stats.p), scale=stats.scale))
    with pytest.raises(ValueError, match="k must have shape"):
        attention_forward(q, k[:, :, :3].copy(), v)
    with pytest.raises(ValueError, match="v must have shape"):  # one K head (grouped-query) but two V heads
        attention_forward(q, k[:, :1].copy(), v)
