"""Grouped-query attention (H_kv K/V heads shared by groups of H / H_kv query heads; H_kv = 1 is multi-query).

CPU: chapter 2's attention (``ops.attention``, every softmax method) and the flash API's NumPy reference against an
independent computation that repeats K/V per group (Hugging Face's ``repeat_kv`` order), the backward against
float64 finite differences and against repeat-then-sum, bad head counts; for our flash kernels what needs no GPU
(the grouped QKV buffer's views, ``ours_unsupported`` taking H_kv < H, the "auto" record's H_kv key and the "auto"
dispatch with CuPy stood in). GPU: the math path in fp32/bf16, cuDNN's fused attention (which takes H_kv < H
natively) and our flash kernels (every forward, every backward variant; H_kv = 1, 2, H / 2 and 9 over 3; odd T;
D = 64 and 128) in fp16/bf16 against the float64 reference on strided views of one QKV buffer, ours against itself
on K/V repeated per group (bit for bit where the arithmetic is the same), its grouped backward bitwise repeatable
and in a CUDA graph, and "auto" resolving to ours for grouped heads.
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
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

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


@pytest.mark.parametrize("fn", ["attention", "flash"])
def test_causal_and_scale_of_the_wrong_type_are_refused(rng, fn):
    """causal="no" is a true value to Python and scale="0.5" a float to float(): both ran as if meant."""
    q, k, v = gqa_inputs(rng, 1, 4, 2, 5, 3, np.float32)
    fwd, bwd = ((attention_forward, attention_backward) if fn == "attention" else
                (fa.flash_attention_forward, fa.flash_attention_backward))
    with pytest.raises(TypeError, match="causal must be True or False, got 'no'"):
        fwd(q, k, v, "no")
    with pytest.raises(TypeError, match="scale must be a real number, got str '0.5'"):
        fwd(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        fwd(q, k, v, scale=float("nan"))
    o, st = fwd(q, k, v)
    with pytest.raises(TypeError, match="causal must be True or False, got 1"):
        bwd(o, q, k, v, o, st, 1)


@pytest.mark.parametrize("pair", [("dq", "dk"), ("dk", "dv"), ("dq", "dv")])
def test_flash_backward_refuses_gradient_buffers_that_share_memory(rng, pair):
    """The NumPy backward writes dq, dk, dv in turn: one buffer given twice came back holding the last one."""
    q, k, v = gqa_inputs(rng, 1, 2, 2, 5, 3, np.float32)  # H_kv = H: every gradient has q's shape
    o, st = fa.flash_attention_forward(q, k, v)
    buf = np.empty_like(q)
    with pytest.raises(ValueError, match=f"{pair[0]} and {pair[1]} share memory"):
        fa.flash_attention_backward(o, q, k, v, o, st, **{pair[0]: buf, pair[1]: buf})
    packed = np.empty((3, *q.shape), np.float32)  # three slices of one buffer: disjoint, accepted
    dq, dk, dv = fa.flash_attention_backward(o, q, k, v, o, st, dq=packed[0], dk=packed[1], dv=packed[2])
    assert all(np.array_equal(a, b) for a, b in zip((dq, dk, dv), fa.flash_attention_backward(o, q, k, v, o, st)))


@pytest.mark.parametrize("name", ["naive_forward", "tiled_forward", "naive_backward", "tiled_backward",
                                  "grouped_backward"])
def test_the_reference_refuses_k_and_v_it_does_not_take(rng, name):
    """The NumPy spec takes q's heads (grouped_backward: H_kv dividing H); other K/V broadcast into an error deep
    in np.matmul, or (H_kv = 1) silently."""
    q, k, v = gqa_inputs(rng, 1, 4, 2, 5, 3, np.float32)
    if name == "grouped_backward":
        k, v = k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1)  # H_kv = 3 does not divide 4
    fn, o, lse = getattr(flash_reference, name), np.zeros_like(q), np.zeros(q.shape[:-1], np.float32)
    args = (q, k, v, 0.5, True) if "forward" in name else (o, q, k, v, o, lse, 0.5, True)
    with pytest.raises(ValueError, match="do not fit q"):
        fn(*args)


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


# --------------------------------------------------------------------------- our flash kernels: what needs no GPU


def _llama_qkv(rng, B, H, H_kv, T, D, dtype, xp=np):
    """q, k, v as views of one [B, T, (H + 2 H_kv)·D] buffer (a fused Llama projection's output), and the buffer."""
    buf = random_array(rng, (B, T, (H + 2 * H_kv) * D), dtype, xp)
    return (*fa.split_qkv(buf, H, H_kv), buf)


def test_split_qkv_of_a_grouped_buffer(rng):
    """split_qkv(buf, H, H_kv): q's H heads, then k's and v's H_kv heads, each D columns, as views (no copy); with
    H_kv = H the very views of split_qkv(buf, H); widths that do not fit and H_kv not dividing H refused."""
    B, H, H_kv, T, D = 2, 6, 2, 7, 8
    q, k, v, buf = _llama_qkv(rng, B, H, H_kv, T, D, np.float32)
    assert q.shape == (B, H, T, D) and k.shape == v.shape == (B, H_kv, T, D)
    assert all(np.shares_memory(a, buf) for a in (q, k, v))
    rows = buf.reshape(B, T, H + 2 * H_kv, D)
    np.testing.assert_array_equal(q, rows[:, :, :H].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(k, rows[:, :, H:H + H_kv].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(v, rows[:, :, H + H_kv:].transpose(0, 2, 1, 3))
    mha = random_array(rng, (B, T, 3 * H * D))
    for a, b in zip(fa.split_qkv(mha, H), fa.split_qkv(mha, H, H)):
        assert a.strides == b.strides and a.shape == b.shape and a.ctypes.data == b.ctypes.data
    with pytest.raises(ValueError, match=r"qkv must be \[B, T, \(H \+ 2·H_kv\)·D\] with H_kv=1"):
        fa.split_qkv(buf, 7, 1)
    with pytest.raises(ValueError, match="H=6 to be a multiple of the key/value heads H_kv=4"):
        fa.split_qkv(buf, 6, 4)


def test_ours_take_grouped_heads(rng):
    """ours_unsupported no longer refuses H_kv < H (strided views of one QKV buffer included, and the backward's
    mix of H- and H_kv-headed arrays); its other reasons stay; K/V heads that do not divide H are refused."""
    B, H, H_kv, T, D = 2, 9, 3, 5, 64
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, BF16)
    assert fa.ours_unsupported(q, k, v) is None and fa.ours_unsupported(q, k, v, q, q, q, k, v) is None
    for h_kv in (1, 9):
        kv = random_array(rng, (B, h_kv, T, D), BF16)
        assert fa.ours_unsupported(q, kv, kv) is None
    q80, k80 = random_array(rng, (1, 4, 5, 80), BF16), random_array(rng, (1, 2, 5, 80), BF16)
    assert "head dims" in fa.ours_unsupported(q80, k80, k80)
    assert "dividing H=9" in fa.ours_unsupported(q, random_array(rng, (B, 2, T, D), BF16), v)


def test_kernel_choices_key_grouped_heads():
    """A record keys grouped shapes by H_kv too: the same query shape with H_kv = H is another entry, H_kv = H
    written out is the short key (records made before read the same), and the JSON form round-trips."""
    import json

    rec = fa.KernelChoices()
    rec.record(("bwd", 8, 9, 2048, 64, "bf16", True, 3), "ours")
    rec.record(("bwd", 8, 9, 2048, 64, "bf16", True), "cudnn")
    rec.record(("fwd", 8, 9, 2048, 64, "bf16", False, 9), "cudnn")
    assert rec.get(("bwd", 8, 9, 2048, 64, "bf16", True, 3)) == "ours"
    assert rec.get(("bwd", 8, 9, 2048, 64, "bf16", True)) == "cudnn"
    assert rec.get(("fwd", 8, 9, 2048, 64, "bf16", False)) == "cudnn" and len(rec) == 3
    text = rec.as_dict()
    assert text == {"bwd B=8 H=9 H_kv=3 T=2048 D=64 bf16 causal": "ours",
                    "bwd B=8 H=9 T=2048 D=64 bf16 causal": "cudnn", "fwd B=8 H=9 T=2048 D=64 bf16 full": "cudnn"}
    assert fa.KernelChoices.from_dict(json.loads(json.dumps(text))) == rec
    for bad in (("fwd", 1, 9, 4, 64, "bf16", True, 2), ("fwd", 1, 9, 4, 64, "bf16", True, 0),
                ("fwd", 1, 9, 4, 64, "bf16", True, 3, 1)):
        with pytest.raises(ValueError, match="H_kv"):
            rec.record(bad, "ours")
    with pytest.raises(ValueError, match="not of the form"):
        fa.KernelChoices.from_dict({"fwd B=1 H=9 H_kv= T=4 D=64 bf16 causal": "ours"})


def _stand_in_cupy():
    """What "auto" asks of CuPy besides running kernels: a device id, the CUDA version, a stream not capturing (and
    an array type no array is, so NumPy arrays stay NumPy's)."""
    from types import SimpleNamespace as NS

    runtime = NS(runtimeGetVersion=lambda: 12080, getDeviceProperties=lambda i: {"name": b"stand-in GPU"})
    return NS(ndarray=type("NoArray", (), {}), cuda=NS(Device=lambda: NS(id=0), runtime=runtime,
                                                      get_current_stream=lambda: NS(is_capturing=lambda: False)))


def test_auto_resolves_grouped_heads_like_any_shape(rng, monkeypatch, tmp_path):
    """The "auto" dispatch without a GPU (CuPy and the timings stood in): for H_kv < H ours is now a candidate, both
    are timed and the faster is recorded under a key with H_kv, in the caller's record and the machine's cache,
    apart from the same query shape with H_kv = H; asked again, nothing is timed; without cuDNN ours runs untimed;
    a head dim ours lacks goes to cuDNN, or raises ours' reason without it."""
    monkeypatch.setattr(backend, "cupy_module", _stand_in_cupy)
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fa.cudnn_attention, "available", lambda: True)
    ms, timed = {"ours": 1.0, "cudnn": 2.0}, []
    monkeypatch.setattr(fa, "_time_ms", lambda cp, fn: fn() or ms[timed[-1]])  # fn runs (records) its kernel
    B, H, H_kv, T, D = 2, 9, 3, 40, 64
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, BF16)
    rec = fa.KernelChoices()
    assert fa._resolve("auto", "fwd", q, (k, v, q), True, timed.append, rec) == "ours"
    assert timed == ["ours", "cudnn"]
    assert rec.as_dict() == {"fwd B=2 H=9 H_kv=3 T=40 D=64 bf16 causal": "ours"}
    (disk_key,) = fa.read_auto_cache()
    assert "|fwd|bf16|B=2 H=9 H_kv=3 T=40 D=64|" in disk_key
    ms["ours"] = 3.0  # the same query shape with H_kv = H: timed on its own
    full = random_array(rng, (B, H, T, D), BF16)
    assert fa._resolve("auto", "fwd", q, (full, full, q), True, timed.append, rec) == "cudnn"
    assert rec.get(("fwd", B, H, T, D, "bf16", True)) == "cudnn" and len(fa.read_auto_cache()) == 2
    timed.clear()
    assert fa._resolve("auto", "fwd", q, (k, v, q), True, timed.append, rec) == "ours" and timed == []
    monkeypatch.setattr(fa.cudnn_attention, "available", lambda: False)
    fresh = fa.KernelChoices()
    assert fa._resolve("auto", "bwd", q, (k, v, q, q, q, k, v), True, timed.append, fresh) == "ours"
    assert timed == [] and fresh.as_dict() == {"bwd B=2 H=9 H_kv=3 T=40 D=64 bf16 causal": "ours"}
    monkeypatch.setattr(fa.cudnn_attention, "available", lambda: True)
    ms.update(ours=1.0, cudnn=0.5)  # a backward allowed cuDNN's atomics: a contest of its own, timed and recorded
    timed.clear()
    assert fa._resolve("auto", "bwd", q, (k, v, q, q, q, k, v), True, timed.append, fresh, False) == "cudnn"
    shape = "B=2 H=9 H_kv=3 T=40 D=64 bf16 causal"
    assert timed == ["ours", "cudnn"]
    assert fresh.as_dict() == {f"bwd {shape}": "ours", f"bwd-nondeterministic {shape}": "cudnn"}
    assert any("|bwd-nondeterministic|" in key for key in fa.read_auto_cache())
    assert fa.KernelChoices.from_dict(fresh.as_dict()) == fresh  # what a checkpoint keeps reads back
    monkeypatch.setattr(fa.cudnn_attention, "available", lambda: False)
    q80, k80 = random_array(rng, (1, 4, 5, 80), BF16), random_array(rng, (1, 2, 5, 80), BF16)
    with pytest.raises(ValueError, match="head dims"):
        fa._resolve("auto", "fwd", q80, (k80, k80, q80), True, timed.append, fa.KernelChoices())
    monkeypatch.setattr(fa.cudnn_attention, "available", lambda: True)
    assert fa._resolve("auto", "fwd", q80, (k80, k80, q80), True, timed.append, fa.KernelChoices()) == "cudnn"


def test_flash_benchmark_takes_grouped_shapes(capsys):
    """benchmarks/bench_flash_attention.py --shape B,H,H_kv,T,D: a shape H_kv does not divide is a usage error naming
    the form; a good one runs (on a GPU it is the benchmark itself: run it there; here it says why it times nothing)."""
    import runpy
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        main = runpy.run_path(str(Path(bench_dir) / "bench_flash_attention.py"), run_name="bench")["main"]
        for bad in ("8,9,4,2048,64", "8,9,3,2048", "8,9,x,2048,64"):
            with pytest.raises(SystemExit) as e:
                main(["--shape", bad])
            assert e.value.code == 2 and "--shape takes B,H,H_kv,T,D" in capsys.readouterr().err
        if backend.default_xp() is not np:
            pytest.skip("a GPU is usable: run benchmarks/bench_flash_attention.py --shape 8,9,3,2048,64 itself")
        assert main(["--shape", "8,9,3,2048,64"]) == {}
    finally:
        sys.path.remove(bench_dir)
    assert "need a GPU" in capsys.readouterr().out


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


# (B, H, H_kv, T, D) for our kernels: H_kv = 1 (multi-query), 2 and H / 2; SmolLM-135M's 9 query heads over 3 (an
# odd group); odd T of one query tile, several, a ragged last one; T = 1; head dims 64 and 128
OURS_GQA = [(2, 8, 1, 77, 64), (1, 8, 2, 129, 64), (2, 8, 4, 333, 64), (1, 9, 3, 257, 64), (1, 6, 3, 1, 64),
            (2, 4, 1, 65, 128), (1, 8, 2, 161, 128), (2, 8, 4, 97, 128)]
BWD_VARIANTS = fa.BWD_VARIANTS  # every backward variant of ours runs every backward test


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BWD_VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,H_kv,T,D", OURS_GQA, ids=lambda s: str(s))
def test_gpu_ours_against_float64(cp, rng, variant, dtype, causal, B, H, H_kv, T, D):
    """Our forward and backward on q, k, v as strided views of one [B, T, (H + 2 H_kv) D] buffer, o into a view of a
    poisoned [B, T, H D] buffer and dq, dk, dv into views of a poisoned buffer like the input's (every element
    written), against chapter 2's float64 grouped attention (and lse against the float64 flash reference)."""
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, dtype, cp)
    y = poisoned((B, T, H * D), dtype, cp)
    o, st = fa.flash_attention_forward(q, k, v, causal, out=fa.heads_view(y, H), kernel="ours")
    do = fa.heads_view(random_array(rng, (B, T, H * D), dtype, cp), H)
    dbuf = poisoned((B, T, (H + 2 * H_kv) * D), dtype, cp)
    dq, dk, dv = fa.split_qkv(dbuf, H, H_kv)
    fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=dq, dk=dk, dv=dv, kernel="ours", variant=variant)
    assert not bool(cp.isnan(y.astype(np.float32)).any()) and not bool(cp.isnan(dbuf.astype(np.float32)).any())
    want = _reference(q, k, v, do, causal)
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v)]
    G = H // H_kv
    _, rlse = flash_reference.naive_forward(h[0], repeat_kv(h[1], G), repeat_kv(h[2], G), st.scale, causal)
    assert_close(st.lse, rlse, rtol=1e-4, name="lse")
    rtol = FLASH_RTOL[dtype]
    assert_close(o, want[0], rtol=rtol, name="o")
    assert_close(dv, want[3], rtol=2 * rtol, name="dv")
    if T == 1:  # one key: P = 1, dV = the group's sum of dO; dQ = dK = 0 up to rounding (dP − D summed two ways)
        for name, g in (("dq", dq), ("dk", dk)):
            assert float(cp.abs(g.astype(np.float32)).max()) < 1e-3 * G, name
        return
    for name, a, w in zip(("dq", "dk"), (dq, dk), want[1:3]):
        assert_close(a, w, rtol=2 * rtol, name=name)


REPEAT_CASES = [(2, 8, 1, 77, 64), (1, 9, 3, 257, 64), (2, 8, 4, 161, 128)]  # (B, H, H_kv, T, D)


def _repeated(cp, k, v, G):
    """K and V with each head repeated for its G query heads (contiguous copies)."""
    return tuple(cp.ascontiguousarray(a.repeat(G, axis=1)) for a in (k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "scalar"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,H,H_kv,T,D", REPEAT_CASES, ids=lambda s: str(s))
def test_gpu_forward_kernels_equal_repeated_kv(cp, rng, kernel, dtype, B, H, H_kv, T, D):
    """Each forward kernel ("ours" runs mma or wgmma) on grouped K/V views against itself on K/V repeated per group:
    o and lse bit for bit (the same arithmetic on the same values, so a wrong K/V head shows), and near float64."""
    if kernel == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma forward runs on Hopper (sm_90) only")
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, dtype, cp)
    o, st = fa.flash_attention_forward(q, k, v, out=poisoned(q.shape, dtype, cp), kernel=kernel)
    o_r, st_r = fa.flash_attention_forward(q, *_repeated(cp, k, v, H // H_kv), kernel=kernel)
    assert cp.array_equal(o, o_r) and cp.array_equal(st.lse, st_r.lse)
    assert_close(o, _reference(q, k, v, q, True)[0], rtol=FLASH_RTOL[dtype], name="o")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BWD_VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,H,H_kv,T,D", REPEAT_CASES, ids=lambda s: str(s))
def test_gpu_backward_equals_repeated_kv_summed(cp, rng, variant, dtype, B, H, H_kv, T, D):
    """Our backward on grouped K/V against itself on K/V repeated per group: dq bit for bit, dk and dv the group sums
    of the repeated run's (to its rounding: there each query head's part is rounded to 16 bits before the sum)."""
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, dtype, cp)
    G = H // H_kv
    do = random_array(rng, q.shape, dtype, cp)
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, kernel="ours", variant=variant)
    dq_r, dk_r, dv_r = fa.flash_attention_backward(do, q, *_repeated(cp, k, v, G), o, st, kernel="ours",
                                                   variant=variant)
    assert cp.array_equal(dq, dq_r)
    for name, g, r in (("dk", dk, dk_r), ("dv", dv, dv_r)):
        summed = r.astype(np.float32).reshape(B, H_kv, G, T, D).sum(axis=2)
        assert_close(g, summed, rtol=FLASH_RTOL[dtype] / 2, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BWD_VARIANTS)
def test_gpu_ours_grouped_backward_is_bitwise_repeatable_and_captures(cp, rng, variant):
    """The dK/dV sum over a group is a fixed loop in registers (no atomics): three more runs and a CUDA-graph replay
    give the same bits."""
    from llmgpu.perf.graphs import capture

    B, H, H_kv, T, D = 2, 9, 3, 333, 64
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, "bf16", cp)
    do = random_array(rng, q.shape, "bf16", cp)
    o, lse = cp.empty(q.shape, q.dtype), cp.empty((B, H, T), np.float32)
    dq, dk, dv = cp.empty(q.shape, q.dtype), cp.empty(k.shape, q.dtype), cp.empty(k.shape, q.dtype)

    def step():
        _, st = fa.flash_attention_forward(q, k, v, out=o, lse=lse, kernel="ours")
        fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="ours", variant=variant)

    step()
    first = [a.copy() for a in (o, lse, dq, dk, dv)]
    for _ in range(3):
        step()
        for a, b in zip((o, lse, dq, dk, dv), first):
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))
    g = capture(step)
    for a in (o, lse, dq, dk, dv):
        a.fill(np.nan)
    g.replay()
    cp.cuda.Device().synchronize()
    for a, b in zip((o, lse, dq, dk, dv), first):
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))


@pytest.mark.gpu
def test_gpu_auto_may_take_ours_for_grouped_kv(cp, rng, monkeypatch, tmp_path):
    """"auto" takes ours as a candidate for H_kv < H: where cuDNN is installed it times both and records the choice
    under a key with H_kv (ours here, where the comparison is made to prefer it; what it runs is then kernel="ours"
    bit for bit), and on its own times it resolves to either; without cuDNN it runs ours (no longer an error)."""
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})
    B, H, H_kv, T, D = 2, 9, 3, 160, 64
    q, k, v, _ = _llama_qkv(rng, B, H, H_kv, T, D, "bf16", cp)
    do = random_array(rng, q.shape, "bf16", cp)
    keys = [f"{d} B=2 H=9 H_kv=3 T=160 D=64 bf16 causal" for d in ("bwd", "fwd")]
    compared = []
    if fa.cudnn_attention.unavailable_reason() is None:  # make the comparison pick ours, and see that it ran
        monkeypatch.setattr(fa, "pick_faster", lambda times: compared.append(sorted(times)) or "ours")
    rec = fa.KernelChoices()
    o, st = fa.flash_attention_forward(q, k, v, choices=rec)
    got = fa.flash_attention_backward(do, q, k, v, o, st, choices=rec)
    assert rec.as_dict() == dict.fromkeys(keys, "ours")
    assert compared == ([] if fa.cudnn_attention.unavailable_reason() else [["cudnn", "ours"]] * 2)
    o_ours, st_ours = fa.flash_attention_forward(q, k, v, kernel="ours")
    assert cp.array_equal(o, o_ours)
    for g, w in zip(got, fa.flash_attention_backward(do, q, k, v, o_ours, st_ours, kernel="ours")):
        assert cp.array_equal(g, w)
    if fa.cudnn_attention.unavailable_reason() is not None:
        return
    monkeypatch.undo()  # the real comparison, in a fresh process record and cache
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})
    rec = fa.KernelChoices()
    o, _ = fa.flash_attention_forward(q, k, v, choices=rec)
    choice = rec.as_dict()[keys[1]]
    assert choice in fa.AUTO_RESOLVES_TO and cp.array_equal(o, fa.flash_attention_forward(q, k, v, kernel=choice)[0])
    assert [key for key in fa.read_auto_cache() if "H=9 H_kv=3 T=160" in key]
