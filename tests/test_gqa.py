"""Grouped-query attention (H_kv K/V heads shared by groups of H / H_kv query heads; H_kv = 1 is multi-query).

CPU: chapter 2's attention (``ops.attention``, every softmax method) and the flash API's NumPy reference against an
independent computation that repeats K/V per group (Hugging Face's ``repeat_kv`` order), the backward against
float64 finite differences and against repeat-then-sum, bad head counts. GPU: the math path in fp32/bf16, cuDNN's
fused attention (which takes H_kv < H natively) in fp16/bf16 against the float64 reference, and our flash kernels'
one-line refusal.
"""

import math

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import flash_attention as fa
from llmgpu.ops import flash_reference
from llmgpu.ops.attention import attention_backward, attention_forward, kv_group
from llmgpu.ops.softmax import METHODS
from llmgpu.perf.sweeps import attention_stage_times
from llmgpu.testing import assert_close, check_gradient, random_array

pytestmark = pytest.mark.ch2

BF16 = backend.bfloat16
# (H, H_kv): G = 1 (multi-head), 2, 3, 4 and multi-query (H_kv = 1)
HEADS = [(2, 2), (4, 2), (6, 2), (4, 1), (3, 1)]


def repeat_kv(x, G):
    """[B, H_kv, T, D] -> [B, H_kv·G, T, D], K/V head j copied to query heads j·G … j·G + G − 1."""
    return np.repeat(x, G, axis=1)


def sum_groups(dx, G):
    """[B, H, T, D] -> [B, H / G, T, D]: a K/V head's gradient is the sum over its query group."""
    B, H, T, D = dx.shape
    return dx.reshape(B, H // G, G, T, D).sum(axis=2)


def ref_gqa(q, k, v, causal):
    """float64 einsum formula on K/V repeated per group, independent of the package."""
    G = q.shape[1] // k.shape[1]
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    k, v = repeat_kv(k, G), repeat_kv(v, G)
    T, D = q.shape[-2:]
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v)


def gqa_inputs(rng, B, H, H_kv, T, D, dtype=np.float64, xp=np):
    q = random_array(rng, (B, H, T, D), dtype, xp)
    k, v = (random_array(rng, (B, H_kv, T, D), dtype, xp) for _ in range(2))
    return q, k, v


# --------------------------------------------------------------------------- chapter 2's attention (NumPy)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,H_kv", HEADS)
@pytest.mark.parametrize("T,D", [(1, 3), (5, 7), (17, 5)])
def test_forward_matches_repeated_kv(rng, method, causal, H, H_kv, T, D):
    q, k, v = gqa_inputs(rng, 2, H, H_kv, T, D)
    o, stats = attention_forward(q, k, v, causal=causal, method=method)
    assert o.shape == q.shape and stats.p.shape == (2, H, T, T)
    np.testing.assert_allclose(o, ref_gqa(q, k, v, causal), rtol=1e-11, atol=1e-13)


def test_causal_mask_is_per_query_position(rng):
    """A query at position t sees keys ≤ t in every head of its group (not rows ≤ t of the stacked G·T rows)."""
    q, k, v = gqa_inputs(rng, 1, 4, 1, 6, 3)
    o, _ = attention_forward(q, k, v, causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 3:] += 10.0
    v2[:, :, 3:] -= 5.0
    o2, _ = attention_forward(q, k2, v2, causal=True)
    np.testing.assert_array_equal(o[:, :, :3], o2[:, :, :3])  # every head's first 3 positions unchanged
    assert not np.allclose(o[:, :, 3:], o2[:, :, 3:])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,H_kv,T,D", [(4, 2, 3, 3), (6, 2, 5, 5), (4, 1, 4, 3), (3, 1, 1, 3), (6, 3, 5, 3)])
def test_backward_vs_finite_differences(rng, causal, H, H_kv, T, D):
    q, k, v = gqa_inputs(rng, 2, H, H_kv, T, D)
    w = rng.standard_normal(q.shape)  # loss = Σ w ⊙ O, so dO = w

    def loss():
        return float((w * attention_forward(q, k, v, causal=causal)[0]).sum())

    o, stats = attention_forward(q, k, v, causal=causal)
    dq, dk, dv = attention_backward(w, q, k, v, o, stats, causal=causal)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        check_gradient(loss, x, g, rtol=1e-7, name=name)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,H_kv", HEADS)
def test_backward_equals_repeat_then_sum(rng, method, causal, H, H_kv):
    G = H // H_kv
    q, k, v = gqa_inputs(rng, 2, H, H_kv, 13, 5)
    do = rng.standard_normal(q.shape)
    o, stats = attention_forward(q, k, v, causal=causal, method=method)
    dq, dk, dv = attention_backward(do, q, k, v, o, stats, causal=causal, method=method)
    kr, vr = repeat_kv(k, G), repeat_kv(v, G)
    ro, rs = attention_forward(q, kr, vr, causal=causal, method=method)
    rdq, rdk, rdv = attention_backward(do, q, kr, vr, ro, rs, causal=causal, method=method)
    np.testing.assert_allclose(o, ro, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dq, rdq, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, sum_groups(rdk, G), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dv, sum_groups(rdv, G), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("fp32_scores", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_16_and_32_bit_numpy_paths(rng, dtype, fp32_scores):
    q, k, v = gqa_inputs(rng, 2, 6, 2, 9, 8, dtype)
    do = random_array(rng, q.shape, dtype)
    o, stats = attention_forward(q, k, v, fp32_scores=fp32_scores)
    assert o.dtype == stats.p.dtype == dtype
    assert_close(o, ref_gqa(q, k, v, True), dtype, name="o")
    dq, dk, dv = attention_backward(do, q, k, v, o, stats, fp32_scores=fp32_scores)
    assert dq.dtype == dk.dtype == dv.dtype == dtype and dk.shape == k.shape
    h = [a.astype(np.float64) for a in (q, k, v, do)]
    ro, rs = attention_forward(*h[:3])
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_backward(h[3], *h[:3], ro, rs)):
        assert_close(got, want, dtype, name=name)


def test_stage_times_run_grouped_shapes(rng):
    q, k, v = gqa_inputs(rng, 1, 4, 2, 8, 4, np.float32)
    rows = attention_stage_times(q, k, v, q, reps=1, warmup=0)
    assert len(rows) == 8 and all(r["ms"] >= 0 for r in rows)


def test_kv_group():
    assert [kv_group(12, h) for h in (12, 6, 4, 3, 2, 1)] == [1, 2, 3, 4, 6, 12]
    for H, H_kv in ((4, 3), (2, 4), (5, 2), (4, 0)):
        with pytest.raises(ValueError, match=f"H={H} to be a multiple of the key/value heads H_kv={H_kv}"):
            kv_group(H, H_kv)


@pytest.mark.parametrize("call", ["forward", "backward", "flash_forward", "flash_backward"])
def test_bad_head_counts_are_one_line(rng, call):
    q, k, v = gqa_inputs(rng, 1, 4, 2, 5, 3, np.float32)
    bad = {"forward": lambda: attention_forward(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1)),
           "flash_forward": lambda: fa.flash_attention_forward(q, k[:, :1].repeat(3, axis=1),
                                                               v[:, :1].repeat(3, axis=1))}
    if call in bad:
        with pytest.raises(ValueError, match="H=4 to be a multiple of the key/value heads H_kv=3") as e:
            bad[call]()
        assert "\n" not in str(e.value)
        return
    if call == "backward":
        o, st = attention_forward(q, k, v)
        k3 = np.concatenate([k, k[:, :1]], axis=1)
        with pytest.raises(ValueError, match="H=4 to be a multiple of the key/value heads H_kv=3") as e:
            attention_backward(o, q, k3, np.concatenate([v, v[:, :1]], axis=1), o, st)
        assert "\n" not in str(e.value)
    else:
        o, st = fa.flash_attention_forward(q, k, v)
        with pytest.raises(ValueError, match=r"dk must have shape \[1, 2, 5, 3\]"):
            fa.flash_attention_backward(o, q, k, v, o, st, dk=np.empty(q.shape, np.float32))
    with pytest.raises(ValueError, match=r"v must have shape \[1, 2, 5, 3\]"):  # K and V disagree on the heads
        attention_forward(q, k, v[:, :1].copy())
    with pytest.raises(ValueError, match=r"k must have shape \[1, \*, 5, 3\]"):
        attention_forward(q, k[:, :, :4].copy(), v[:, :, :4].copy())


# --------------------------------------------------------------------------- the flash API's NumPy reference


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H,H_kv", HEADS)
def test_flash_numpy_reference(rng, causal, H, H_kv):
    """flash_attention_* on NumPy arrays (the tiled reference, K/V repeated and dK/dV summed) against the
    float64 formula and chapter 2's grouped backward; T = 70 spans two of the reference's 64-row tiles."""
    q, k, v = gqa_inputs(rng, 2, H, H_kv, 70, 7)
    do = rng.standard_normal(q.shape)
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    np.testing.assert_allclose(o, ref_gqa(q, k, v, causal), rtol=1e-11, atol=1e-13)
    assert st.lse.shape == (2, H, 70)
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, causal)
    ro, rs = attention_forward(q, k, v, causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_backward(do, q, k, v, ro, rs, causal)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=name)


def test_flash_traffic_counts_kv_heads():
    args = (4, 12, 1024, 64, "bf16")
    for d in ("fwd", "bwd"):
        assert fa.flash_traffic_bytes(*args, d) == fa.flash_traffic_bytes(*args, d, kv_heads=12)
    n, n_kv, lse = 4 * 12 * 1024 * 64, 4 * 3 * 1024 * 64, 4 * 4 * 12 * 1024
    assert fa.flash_traffic_bytes(*args, "fwd", kv_heads=3) == 2 * (2 * n + 2 * n_kv) + lse
    assert fa.flash_traffic_bytes(*args, "bwd", kv_heads=3) == 2 * (4 * n + 4 * n_kv) + lse


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_cudnn_single_position_backward_sums_dv_over_the_group(rng, dtype):
    """cuDNN builds no backward graph for T = 1; its exact stand-in (run before any GPU call, so NumPy arrays reach
    it here) must sum dO over each K/V head's query heads."""
    q, k, v = gqa_inputs(rng, 2, 6, 2, 1, 8, dtype)
    do = random_array(rng, q.shape, dtype)
    dq, dk, dv = (np.full(a.shape, np.nan, dtype) for a in (q, k, v))
    fa.cudnn_attention.backward(do, q, k, v, do, None, 0.5, True, dq, dk, dv)
    h = [a.astype(np.float64) for a in (q, k, v, do)]
    ro, rs = attention_forward(*h[:3])
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_backward(h[3], *h[:3], ro, rs)):
        assert_close(got, want, dtype, name=name)
    assert not dq.any() and not dk.any()


# --------------------------------------------------------------------------- GPU

GPU_GQA = [(1, 4, 2, 1, 8), (2, 6, 2, 33, 64), (1, 4, 1, 128, 64), (2, 6, 3, 77, 32), (1, 8, 2, 100, 128)]


def _reference(q, k, v, do, causal):
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v, do)]
    ro, rs = attention_forward(*h[:3], causal=causal)
    return (ro, *attention_backward(h[3], *h[:3], ro, rs, causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (BF16, 2e-2)])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,H_kv,T,D", GPU_GQA, ids=lambda s: str(s))
def test_gpu_math_path_against_float64(cp, rng, dtype, rtol, method, causal, B, H, H_kv, T, D):
    q, k, v = gqa_inputs(rng, B, H, H_kv, T, D, dtype, cp)
    do = random_array(rng, q.shape, dtype, cp)
    o, stats = attention_forward(q, k, v, causal=causal, method=method)
    got = (o, *attention_backward(do, q, k, v, o, stats, causal=causal, method=method))
    assert got[2].shape == got[3].shape == k.shape
    for name, a, want in zip(("o", "dq", "dk", "dv"), got, _reference(q, k, v, do, causal)):
        assert_close(a, want, rtol=rtol, name=name)


def _cudnn_or_skip():
    why = fa.cudnn_attention.unavailable_reason()
    if why is not None:
        pytest.skip(f"cuDNN flash attention not available: {why}")


# relative error against float64 for 16-bit inputs, as tests/test_flash_kernels.py
FLASH_RTOL = {"bf16": 2e-2, "fp16": 5e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,H_kv,T,D", [(2, 6, 2, 257, 64), (1, 4, 1, 130, 128), (2, 8, 2, 77, 64),
                                          (1, 6, 3, 1, 64), (1, 4, 4, 65, 64)], ids=lambda s: str(s))
def test_gpu_cudnn_against_float64(cp, rng, dtype, causal, B, H, H_kv, T, D):
    """cuDNN's SDPA with K/V of H_kv heads straight in, dK/dV out with H_kv heads (T = 1: the exact special case)."""
    _cudnn_or_skip()
    q, k, v = gqa_inputs(rng, B, H, H_kv, T, D, dtype, cp)
    do = random_array(rng, q.shape, dtype, cp)
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="cudnn")
    got = (o, *fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="cudnn"))
    assert got[2].shape == got[3].shape == k.shape
    for name, a, want in zip(("o", "dq", "dk", "dv"), got, _reference(q, k, v, do, causal)):
        assert_close(a, want, rtol=FLASH_RTOL[dtype], name=name)
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v)]
    _, rlse = flash_reference.naive_forward(h[0], repeat_kv(h[1], H // H_kv), repeat_kv(h[2], H // H_kv),
                                               st.scale, causal)
    assert_close(st.lse, rlse, rtol=1e-4, name="lse")


@pytest.mark.gpu
def test_gpu_cudnn_grouped_views_of_one_qkv_buffer(cp, rng):
    """Llama's fused projection output [B, T, (H + 2 H_kv) D]: q, k, v as strided views, dK/dV into views too."""
    _cudnn_or_skip()
    B, H, H_kv, T, D = 2, 8, 2, 96, 64
    buf = random_array(rng, (B, T, (H + 2 * H_kv) * D), "bf16", cp)
    dbuf = cp.zeros_like(buf)

    def views(x):
        r = x.reshape(B, T, H + 2 * H_kv, D).transpose(0, 2, 1, 3)
        return r[:, :H], r[:, H:H + H_kv], r[:, H + H_kv:]

    q, k, v = views(buf)
    dq, dk, dv = views(dbuf)
    do = random_array(rng, (B, H, T, D), "bf16", cp)
    o, st = fa.flash_attention_forward(q, k, v, True, kernel="cudnn")
    fa.flash_attention_backward(do, q, k, v, o, st, True, kernel="cudnn", dq=dq, dk=dk, dv=dv)
    want = _reference(q, k, v, do, True)
    for name, a, w in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), want):
        assert_close(a, w, rtol=FLASH_RTOL["bf16"], name=name)


@pytest.mark.gpu
def test_gpu_ours_refuses_grouped_kv_in_one_line(cp, rng):
    q, k, v = gqa_inputs(rng, 1, 4, 2, 64, 64, "bf16", cp)
    with pytest.raises(ValueError, match="kernel='cudnn'") as e:
        fa.flash_attention_forward(q, k, v, kernel="ours")
    assert "\n" not in str(e.value) and "H=4" in str(e.value) and "H_kv=2" in str(e.value)
    o, st = fa.flash_attention_forward(q, k.repeat(2, axis=1), v.repeat(2, axis=1), kernel="ours")
    with pytest.raises(ValueError, match="kernel='cudnn'"):
        fa.flash_attention_backward(o, q, k, v, o, st, kernel="ours")


@pytest.mark.gpu
def test_gpu_auto_takes_cudnn_for_grouped_kv(cp, rng):
    """"auto" has one candidate for H_kv < H (cuDNN) and records nothing, so a choice made for the same query shape
    with H_kv = H is neither read nor overwritten; without cuDNN it raises ours' reason."""
    q, k, v = gqa_inputs(rng, 2, 4, 2, 96, 64, "bf16", cp)
    choices = fa.KernelChoices()
    if fa.cudnn_attention.unavailable_reason() is not None:
        with pytest.raises(ValueError, match="kernel='cudnn'"):
            fa.flash_attention_forward(q, k, v, choices=choices)
        return
    choices.record(("fwd", 2, 4, 96, 64, "bf16", True), "ours")
    o, st = fa.flash_attention_forward(q, k, v, choices=choices)
    assert cp.array_equal(o, fa.flash_attention_forward(q, k, v, kernel="cudnn")[0])
    assert choices.as_dict() == {"fwd B=2 H=4 T=96 D=64 bf16 causal": "ours"}
