"""RoPE's backward folded into the flash attention backward (``flash_attention_backward(..., rope=(cos, sin))``).

The Llama step rotates q and k in place before attention, so attention's dq and dk are gradients of the rotated
vectors; ``rope=`` returns the gradients of the unrotated ones. Our wide backward kernels apply the inverse
rotation in registers before their stores; cuDNN, the base variant and NumPy run ``rope_backward`` after.

CPU: the NumPy path against attention's backward followed by ``rope_backward``, and against float64 finite
differences of attention(RoPE(q), RoPE(k), v); bad tables refused in one line; the in-place pass on each layout
the fallback meets; the "auto" record's ``bwd-rope`` key. GPU: every backward (ours wide with the fold, ours base,
cuDNN) with ``rope=`` on strided views of one poisoned Llama q|k|v buffer against the float64 reference, the
fold against the separate pass to rounding, bitwise repeatable and in a CUDA graph, and "auto" timing the
contest under its own key.
"""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import flash_attention as fa
from llmgpu.ops import flash_launch as fl
from llmgpu.ops.attention import attention_backward, attention_forward
from llmgpu.ops.rope import rope_backward, rope_backward_heads, rope_forward, rope_reference, rope_tables
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch10

BF16 = backend.bfloat16


def _qkv(rng, B, H, H_kv, T, D, dtype, xp=np):
    """q, k, v as views of one [B, T, (H + 2 H_kv)·D] buffer (the Llama step's fused projection output)."""
    buf = random_array(rng, (B, T, (H + 2 * H_kv) * D), dtype, xp)
    return (*fa.split_qkv(buf, H, H_kv), buf)


def _reference(q, k, v, do, cos, sin, causal=True):
    """float64: attention's gradients with respect to the rotated q, k (q, k given rotated), then RoPE's backward."""
    h = [backend.to_numpy(a).astype(np.float64) for a in (q, k, v, do)]
    c, s = (backend.to_numpy(t).astype(np.float64) for t in (cos, sin))
    o, st = attention_forward(*h[:3], causal=causal)
    dq, dk, dv = attention_backward(h[3], *h[:3], o, st, causal=causal)
    return rope_reference(dq, c, s, inverse=True), rope_reference(dk, c, s, inverse=True), dv


# --------------------------------------------------------------------------- NumPy


@pytest.mark.parametrize("H,H_kv,T,D", [(4, 2, 5, 8), (3, 1, 7, 4), (2, 2, 1, 6)])
def test_numpy_rope_is_attention_backward_then_rope_backward(rng, H, H_kv, T, D):
    q, k, v = (random_array(rng, (2, h, T, D), np.float64) for h in (H, H_kv, H_kv))
    do = random_array(rng, q.shape, np.float64)
    cos, sin = rope_tables(T + 3, D, xp=np, dtype=np.float64)  # longer tables: rows 0 .. T - 1 are used
    o, st = fa.flash_attention_forward(q, k, v)
    plain = fa.flash_attention_backward(do, q, k, v, o, st)
    got = fa.flash_attention_backward(do, q, k, v, o, st, rope=(cos, sin))
    for name, g, p in zip(("dq", "dk"), got[:2], plain[:2]):
        assert_close(g, rope_backward(p, cos, sin), rtol=1e-12, name=name)
    np.testing.assert_array_equal(got[2], plain[2])
    for name, g, w in zip(("dq", "dk", "dv"), got, _reference(q, k, v, do, cos, sin)):
        assert_close(g, w, rtol=1e-10, name=name)


def test_numpy_rope_gradient_vs_finite_differences(rng):
    """The whole composition loss = Σ w ⊙ attention(RoPE(q), RoPE(k), v) against float64 central differences in
    the unrotated q and k."""
    B, H, H_kv, T, D = 1, 4, 2, 5, 6
    q0, k0, v = (random_array(rng, (B, h, T, D), np.float64) for h in (H, H_kv, H_kv))
    w = random_array(rng, q0.shape, np.float64)
    cos, sin = rope_tables(T, D, theta=7.0, xp=np, dtype=np.float64)

    def loss():
        o, _ = fa.flash_attention_forward(rope_forward(q0, cos, sin), rope_forward(k0, cos, sin), v)
        return float((o * w).sum())

    q, k = rope_forward(q0, cos, sin), rope_forward(k0, cos, sin)
    o, st = fa.flash_attention_forward(q, k, v)
    dq, dk, _ = fa.flash_attention_backward(w, q, k, v, o, st, rope=(cos, sin))
    check_gradient(loss, q0, dq, name="dq")
    check_gradient(loss, k0, dk, name="dk")


@pytest.mark.parametrize("rope,match", [
    ("tables", "rope must be the \\(cos, sin\\) pair"),
    ((np.ones((8, 4), np.float32),), "rope must be the \\(cos, sin\\) pair"),
    ((np.ones((8, 3), np.float32), np.ones((8, 3), np.float32)), "shape \\[S, 4\\] with S >= T = 5"),
    ((np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)), "S >= T = 5"),
    ((np.ones((8, 4), np.float32), np.ones((8, 4), np.float64)), "rope sin"),
    ((np.ones((8, 4), np.int32), np.ones((8, 4), np.int32)), "rope cos"),
])
def test_bad_rope_tables_are_one_line(rng, rope, match):
    q, k, v = (random_array(rng, (1, 2, 5, 8)) for _ in range(3))
    o, st = fa.flash_attention_forward(q, k, v)
    with pytest.raises((TypeError, ValueError), match=match) as err:
        fa.flash_attention_backward(q, q, k, v, o, st, rope=rope)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout", ["contiguous", "qkv view", "transposed"])
def test_rope_pass_in_place_on_every_layout(rng, layout):
    """The pass after cuDNN / the base kernels: on a contiguous [B, n, T, D] gradient, on split_qkv's token-major view
    (rope.py's row layout) and on any other view (through a copy), the same numbers as rope_backward."""
    B, H, H_kv, T, D = 2, 4, 2, 6, 8
    cos, sin = rope_tables(T, D, xp=np)
    if layout == "contiguous":
        g = random_array(rng, (B, H, T, D), np.float32)
    elif layout == "qkv view":
        g = _qkv(rng, B, H, H_kv, T, D, np.float32)[1]
    else:
        g = random_array(rng, (B, T, D, H), np.float32).transpose(0, 3, 1, 2)
    want = rope_backward(np.ascontiguousarray(g), cos, sin)
    rope_backward_heads(g, cos, sin)
    np.testing.assert_array_equal(g, want)


def test_kernel_choices_key_bwd_rope():
    """A backward with RoPE is a contest of its own in a record (deterministic or not), and round-trips as JSON."""
    rec = fa.KernelChoices()
    rec.record(("bwd-rope", 32, 15, 1024, 64, "bf16", True, 5), "ours")
    rec.record(("bwd-rope-nondeterministic", 32, 15, 1024, 64, "bf16", True, 5), "cudnn")
    rec.record(("bwd", 32, 15, 1024, 64, "bf16", True, 5), "cudnn")
    assert rec.as_dict() == {"bwd B=32 H=15 H_kv=5 T=1024 D=64 bf16 causal": "cudnn",
                             "bwd-rope B=32 H=15 H_kv=5 T=1024 D=64 bf16 causal": "ours",
                             "bwd-rope-nondeterministic B=32 H=15 H_kv=5 T=1024 D=64 bf16 causal": "cudnn"}
    assert fa.KernelChoices.from_dict(rec.as_dict()) == rec
    with pytest.raises(ValueError, match="direction"):
        rec.record(("bwd-rotary", 1, 2, 3, 64, "bf16", True), "ours")


# --------------------------------------------------------------------------- GPU

# (B, H, H_kv, T, D): SmolLM's 15 over 5 and 9 over 3, multi-query, odd T of one, several and a ragged last tile,
# T = 1 (position 0: the identity rotation); head dims 64 and 128
CASES = [(2, 15, 5, 161, 64), (1, 9, 3, 257, 64), (2, 8, 1, 77, 64), (1, 6, 3, 1, 64), (2, 8, 2, 97, 128),
         (1, 4, 4, 130, 128)]
RTOL = {"bf16": 2e-2, "fp16": 4e-3}


def _run(cp, rng, B, H, H_kv, T, D, dtype, rope=True, **kw):
    q, k, v, _ = _qkv(rng, B, H, H_kv, T, D, dtype, cp)
    cos, sin = rope_tables(T + 5, D, theta=500.0, xp=cp)
    do = fa.heads_view(random_array(rng, (B, T, H * D), dtype, cp), H)
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    dbuf = poisoned((B, T, (H + 2 * H_kv) * D), dtype, cp)
    dq, dk, dv = fa.split_qkv(dbuf, H, H_kv)
    fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, rope=(cos, sin) if rope else None, **kw)
    return (q, k, v, do, cos, sin), (dq, dk, dv), dbuf


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["ours wide (folded)", "ours wgmma (folded)", "ours base", "cudnn"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,H,H_kv,T,D", CASES, ids=lambda s: str(s))
def test_gpu_backward_with_rope_against_float64(cp, rng, how, dtype, B, H, H_kv, T, D):
    """dq, dk through RoPE's backward and dv, written into views of a poisoned q|k|v-shaped buffer (every element
    written), against float64 attention's backward followed by RoPE's."""
    kw = {"ours wide (folded)": dict(kernel="ours", variant="wide"), "ours base": dict(kernel="ours", variant="base"),
          "ours wgmma (folded)": dict(kernel="ours", variant="wgmma"), "cudnn": dict(kernel="cudnn")}[how]
    if how.startswith("ours wgmma") and (why := fl.wgmma_unsupported(cp.empty(1, np.float16))):
        pytest.skip(f"the Hopper flash backward cannot run here: {why}")
    if how == "cudnn" and (why := fa.cudnn_attention.unavailable_reason()):
        pytest.skip(f"cuDNN flash attention not available: {why}")
    ins, got, dbuf = _run(cp, rng, B, H, H_kv, T, D, dtype, **kw)
    assert not bool(cp.isnan(dbuf.astype(np.float32)).any())
    want = _reference(*ins)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        if T == 1 and name != "dv":  # one key: dQ = dK = 0 up to rounding (dP − D summed two ways)
            assert float(cp.abs(a.astype(np.float32)).max()) < 1e-3 * (H // H_kv), name
            continue
        assert_close(a, w, rtol=2 * RTOL[dtype], name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", fl.ROPE_VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,H,H_kv,T,D", CASES[:2] + CASES[4:5], ids=lambda s: str(s))
def test_gpu_fold_equals_separate_pass_to_rounding(cp, rng, variant, dtype, B, H, H_kv, T, D):
    """The folded rotation against the same kernels without it and rope_backward after: dv bit for bit, dq and dk
    within a 16-bit rounding of each other (the fold rotates fp32 accumulators, the pass the rounded dq, dk)."""
    seed = int(rng.integers(1 << 30))
    ins, folded, _ = _run(cp, np.random.default_rng(seed), B, H, H_kv, T, D, dtype, kernel="ours", variant=variant)
    _, plain, _ = _run(cp, np.random.default_rng(seed), B, H, H_kv, T, D, dtype, rope=False, kernel="ours",
                       variant=variant)
    cos, sin = ins[4:]
    assert cp.array_equal(folded[2], plain[2])
    eps = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}[dtype]
    for name, f, p in zip(("dq", "dk"), folded[:2], plain[:2]):
        sep = rope_backward(cp.ascontiguousarray(p), cos, sin, seq_axis=2).astype(np.float32)
        f32 = f.astype(np.float32)
        scale = float(cp.abs(sep).max())
        assert float(cp.abs(f32 - sep).max()) <= 3 * eps * scale, name  # a few ulps of the largest element
        assert not cp.array_equal(f32, p.astype(np.float32)), f"{name}: no rotation applied"


@pytest.mark.gpu
def test_gpu_fold_is_bitwise_repeatable_and_captures(cp, rng):
    from llmgpu.perf.graphs import capture

    B, H, H_kv, T, D = 2, 15, 5, 333, 64
    q, k, v, _ = _qkv(rng, B, H, H_kv, T, D, "bf16", cp)
    cos, sin = rope_tables(T, D, xp=cp)
    do = random_array(rng, q.shape, "bf16", cp)
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    dq, dk, dv = cp.empty(q.shape, q.dtype), cp.empty(k.shape, q.dtype), cp.empty(k.shape, q.dtype)

    def step():
        fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="ours", rope=(cos, sin))

    step()
    first = [a.copy() for a in (dq, dk, dv)]
    step()
    for a, b in zip((dq, dk, dv), first):
        assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    g = capture(step)
    for a in (dq, dk, dv):
        a.fill(np.nan)
    g.replay()
    cp.cuda.Device().synchronize()
    for a, b in zip((dq, dk, dv), first):
        assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


@pytest.mark.gpu
def test_gpu_auto_times_the_rope_contest_under_its_own_key(cp, rng, monkeypatch, tmp_path):
    """"auto" with rope= decides a "bwd-rope" contest (each contestant with its RoPE pass), apart from the plain
    backward's, and what it picked gives the same bits as that kernel asked for by name."""
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})
    B, H, H_kv, T, D = 2, 15, 5, 160, 64
    q, k, v, _ = _qkv(rng, B, H, H_kv, T, D, "bf16", cp)
    cos, sin = rope_tables(T, D, xp=cp)
    do = random_array(rng, q.shape, "bf16", cp)
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    rec = fa.KernelChoices()
    got = fa.flash_attention_backward(do, q, k, v, o, st, choices=rec, rope=(cos, sin))
    (key, choice), = rec.as_dict().items()
    assert key == "bwd-rope B=2 H=15 H_kv=5 T=160 D=64 bf16 causal" and choice in fa.AUTO_RESOLVES_TO
    again = fa.flash_attention_backward(do, q, k, v, o, st, kernel=choice, rope=(cos, sin))
    for g, w in zip(got, again):
        assert cp.array_equal(g, w)


def test_rope_fold_benchmark_script_runs_on_the_cpu(capsys):
    """benchmarks/bench_ch10_rope_fold.py --quick: both settings built and timed, their gradients compared."""
    from test_fast_model import _run_benchmark  # tests/ is not a package

    assert _run_benchmark("bench_ch10_rope_fold.py", ["--quick"]) == 0
    out = capsys.readouterr().out
    assert "'loss_equal': True" in out and "fold over separate pass" in out and "not written" in out
