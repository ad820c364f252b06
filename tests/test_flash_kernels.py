"""Our flash attention (``kernels/flash_attention.cu`` through ``llmgpu.ops.flash_attention``, chapter 2b).

CPU: the NumPy reference of the algorithm (online softmax identity, tiled == naive in float64, backward against
finite differences) and the argument checks that need no GPU. GPU: the tensor-core and scalar forward and the
deterministic backward against the float64 reference on fresh random inputs (odd T, small and large B·H, fp16 and
bf16, causal or not, D = 64 and 128), strided QKV views, poisoned outputs, NaN propagation, bitwise
repeatability, CUDA-graph capture, agreement with cuDNN and PyTorch SDPA where they are installed. Every backward
variant (``fa.BWD_VARIANTS``) runs every backward test, and each agrees with the current default.
"""

import math

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.kernels import loader
from llmgpu.kernels.launch import SMEM_WITHOUT_OPT_IN, SMLimits
from llmgpu.ops import flash_attention as fa
from llmgpu.ops import flash_launch as fl
from llmgpu.ops import flash_reference as ref
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch2

# relative error ‖out − ref‖ / ‖ref‖ against float64, for 16-bit inputs and outputs (the output rounding alone
# is ~2⁻⁹ for bf16, ~2⁻¹² for fp16; P and dS are rounded to 16 bits once more inside the kernels)
RTOL = {"bf16": 2e-2, "fp16": 5e-3}
VARIANTS = fa.BWD_VARIANTS  # our backward kernels, each run by every backward test below


# =========================================================================== NumPy reference (CPU)


def test_online_softmax_identity(rng):
    """Softmax statistics of two halves merge exactly: m = max(m1, m2), l = l1 e^(m1−m) + l2 e^(m2−m)."""
    x = rng.standard_normal(1000) * 4
    a, b = x[:377], x[377:]
    m1, m2 = a.max(), b.max()
    l1, l2 = np.exp(a - m1).sum(), np.exp(b - m2).sum()
    m = max(m1, m2)
    l = l1 * np.exp(m1 - m) + l2 * np.exp(m2 - m)
    assert np.isclose(m + np.log(l), np.log(np.exp(x).sum()), rtol=1e-14)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,tile", [(1, 64), (7, 4), (63, 16), (65, 64), (130, 32)])
def test_tiled_equals_naive_float64(rng, causal, T, tile):
    q, k, v, do = (rng.standard_normal((2, 3, T, 8)) for _ in range(4))
    o, lse = ref.tiled_forward(q, k, v, 0.4, causal, tile=tile)
    o2, lse2 = ref.naive_forward(q, k, v, 0.4, causal)
    np.testing.assert_allclose(o, o2, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, lse2, rtol=1e-12, atol=1e-13)
    got = ref.tiled_backward(do, q, k, v, o, lse, 0.4, causal, tile=tile)
    want = ref.naive_backward(do, q, k, v, o2, lse2, 0.4, causal)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_backward_matches_finite_differences(rng, causal):
    shape = (1, 2, 9, 4)
    q, k, v, r = (rng.standard_normal(shape) for _ in range(4))

    def f():
        return float((ref.tiled_forward(q, k, v, 0.5, causal, tile=4)[0] * r).sum())

    o, lse = ref.tiled_forward(q, k, v, 0.5, causal, tile=4)
    dq, dk, dv = ref.tiled_backward(r, q, k, v, o, lse, 0.5, causal, tile=4)
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        check_gradient(f, x, g, name=name)


def test_numpy_path_runs_the_tiled_reference(rng):
    q, k, v = (random_array(rng, (2, 2, 70, 16), "fp64") for _ in range(3))
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    o2, lse2 = ref.naive_forward(q, k, v, 0.25, True)
    np.testing.assert_allclose(o, o2, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st.lse, lse2, rtol=1e-12)


def test_bad_kernel_name_and_what_ours_cannot_take(rng):
    q = random_array(rng, (1, 2, 5, 64))
    with pytest.raises(ValueError, match="kernel"):
        fa.flash_attention_forward(q, q, q, kernel="fastest")
    o, st = fa.flash_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="kernel"):
        fa.flash_attention_backward(q, q, q, q, o, st, kernel="scalar")  # forward only
    assert fa.ours_unsupported(q) is None
    assert "head dims" in fa.ours_unsupported(random_array(rng, (1, 2, 5, 80)))
    x = random_array(rng, (1, 5, 3 * 2 * 64 + 4))[..., :3 * 2 * 64]  # rows of 388 elements: not 8-aligned
    assert "multiples of 8" in fa.ours_unsupported(x.reshape(1, 5, 6, 64).transpose(0, 2, 1, 3)[:, :2])
    # rows 2**22 elements apart: T · stride reaches 2**31 at T = 512, past the kernels' 32-bit row offsets
    wide = np.lib.stride_tricks.as_strided(q, shape=(1, 2, 512, 64), strides=(0, 256, 2**22 * 4, 4))  # fp32, never read
    assert "2**31" in fa.ours_unsupported(wide)
    assert fa.ours_unsupported(wide[:, :, :511]) is None


def test_backward_variant_argument(rng):
    q = random_array(rng, (1, 2, 5, 64))
    o, st = fa.flash_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="variant"):
        fa.flash_attention_backward(q, q, q, q, o, st, kernel="ours", variant="fastest")
    with pytest.raises(ValueError, match="kernel='ours'"):
        fa.flash_attention_backward(q, q, q, q, o, st, variant="wide")  # auto (or cuDNN) has no variants
    want = fa.flash_attention_backward(q, q, q, q, o, st, kernel="ours")
    for variant in VARIANTS:  # NumPy: the reference, whatever the variant
        for g, w in zip(fa.flash_attention_backward(q, q, q, q, o, st, kernel="ours", variant=variant), want):
            np.testing.assert_array_equal(g, w)
    assert fa.DEFAULT_BWD_VARIANT in VARIANTS


def test_every_variant_launches_declared_kernels():
    declared = {e.split("<")[0] for f in ("flash_attention", fl.WGMMA_FILE) for e in loader.name_expressions(f)}
    for variant in VARIANTS:
        names = fl.backward_kernels(variant)
        assert set(names) <= declared
        assert names[-1] != "flash_bwd_dot" and sum("dkdv" in n for n in names) == 1
        assert sum(n.startswith("flash_bwd_dq") for n in names) == 1
        # D (rowsum dO ⊙ O) is written before dK, dV read it: by flash_bwd_dot or by the wide dQ kernel
        first_dkdv = next(i for i, n in enumerate(names) if "dkdv" in n)
        assert any(n in ("flash_bwd_dot", "flash_bwd_dq_wide") for n in names[:first_dkdv])


def test_backward_variants_benchmark_runs_on_the_cpu(capsys):
    """The script imports and says why it times nothing (on a GPU it is the benchmark itself: run it there)."""
    if backend.default_xp() is not np:
        pytest.skip("a GPU is usable: run benchmarks/bench_flash_backward_variants.py itself")
    import runpy
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        main = runpy.run_path(str(Path(bench_dir) / "bench_flash_backward_variants.py"), run_name="bench")["main"]
        assert main(["--quick"]) == {}
    finally:
        sys.path.remove(bench_dir)
    assert "need a GPU" in capsys.readouterr().out


def test_shared_memory_fits_an_sm90_block():
    lim = SMLimits()
    for f in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq", "flash_bwd_dkdv_wide", "flash_bwd_dq_wide"):
        for D in (64, 128):  # double-buffered tiles: above the 48 KiB default, the host opts in
            assert SMEM_WITHOUT_OPT_IN < fa.smem_bytes(f, D) <= lim.smem_per_block_optin
    for D in (64, 128):  # the Hopper forward: D = 64 two blocks per SM (228 KiB, 1 KiB reserved per block)
        assert SMEM_WITHOUT_OPT_IN < fl.wgmma_smem_bytes(D) <= lim.smem_per_block_optin
    assert 2 * (fl.wgmma_smem_bytes(64) + 1024) <= 228 * 1024 < 2 * (fl.wgmma_smem_bytes(128) + 1024)


def test_forward_kernel_names(rng):
    """Every forward implementation name is accepted (NumPy runs the reference for each); the backward takes only
    "auto", "ours", "cudnn"."""
    q = random_array(rng, (1, 2, 9, 64), "fp64")
    want, _ = fa.flash_attention_forward(q, q, q)
    for kernel in ("ours", "mma", "wgmma", "scalar"):
        o, st = fa.flash_attention_forward(q, q, q, kernel=kernel)
        np.testing.assert_array_equal(o, want)
        if kernel != "ours":
            with pytest.raises(ValueError, match="kernel"):
                fa.flash_attention_backward(q, q, q, q, o, st, kernel=kernel)
    assert fl.forward_impl(q) == "mma"  # NumPy arrays: no Hopper kernel to take
    with pytest.raises(ValueError, match="impl must be one of"):
        fl.forward_impl(q, "fastest")


def _launch_order(blocks):
    """(head, tile) of every block of a grid from ``fl.grid`` in the order the GPU starts them (x fastest, then y,
    then z), as fa_block_head / fa_block_tile compute them (longest_last: tiles counted from the end); blocks past
    the heads (the last group's extra) are left out, as the kernels return at once."""
    gx, gy, gz = blocks
    return [(z * gx + x, gy - 1 - y) for z in range(gz) for y in range(gy) for x in range(gx)]


@pytest.mark.parametrize("n_bh,n_tiles", [(1, 1), (7, 3), (192, 8), (768, 8), (64, 32)])
def test_launch_order_groups_heads_and_covers_every_tile_once(n_bh, n_tiles):
    for group in (1, 3, 5, 60, n_bh, 10 * n_bh):
        blocks = fl.ordered_grid(n_bh, n_tiles, group)
        order = [b for b in _launch_order(blocks) if b[0] < n_bh]
        assert sorted(order) == [(h, t) for h in range(n_bh) for t in range(n_tiles)]  # each once
        g = blocks[0]
        assert g == min(group, n_bh) and blocks[2] == -(-n_bh // g)
        first = order[:g * n_tiles]  # the first group's blocks: its heads only, every tile, longest first
        assert {h for h, _ in first} == set(range(g)) and [t for _, t in first[::g]] == list(range(n_tiles))[::-1]
    plain = _launch_order(fl.ordered_grid(n_bh, n_tiles, n_bh))  # the order before groups: head fastest
    assert plain == [(h, n_tiles - 1 - y) for y in range(n_tiles) for h in range(n_bh)]
    assert fl.ordered_grid(10**6, 4, 1)[2] <= 65535  # gridDim.z's limit: larger groups
    with pytest.raises(ValueError, match="group"):
        fl.ordered_grid(8, 4, 0)


def test_tile_group_divides_the_heads_and_fills_the_gpu_twice():
    """The sweep of dev/cuda/flash_tile_order.py (H200, 2026-12-03) in numbers: the H200 holds 264 blocks of the
    D = 64 forward (two per SM); 8 tiles per head at T = 1024."""
    assert fl.GROUP_WAVES == 2
    assert fl.tile_group(768, 8, 264) == 96  # B = 64: 96 heads (768 = 8 x 96), 768 blocks a group
    assert fl.tile_group(192, 8, 264) == 96  # B = 16: 192 = 2 x 96
    assert fl.tile_group(64, 32, 132) == 16  # D = 128, T = 4096, one block per SM
    assert fl.tile_group(12, 8, 264) == 12  # few heads: the plain order
    assert fl.tile_group(97, 8, 264) == 97  # a prime: no smaller divisor
    for n_bh, n_tiles, resident in [(768, 8, 264), (300, 3, 400), (64, 64, 264), (5, 1, 1)]:
        g = fl.tile_group(n_bh, n_tiles, resident)
        assert n_bh % g == 0 and (g * n_tiles >= 2 * resident or g == n_bh)
        assert not any(n_bh % h == 0 and h * n_tiles >= 2 * resident for h in range(1, g))  # the fewest


def test_auto_cache_file_round_trip_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path / "c"))
    path = fa.auto_cache_path()
    assert path.parent == tmp_path / "c" and fa.read_auto_cache() == {}  # missing: empty, no crash
    assert fa.write_auto_choice("gpu|fwd|a", "ours") and fa.write_auto_choice("gpu|bwd|a", "cudnn")
    assert fa.read_auto_cache() == {"gpu|fwd|a": "ours", "gpu|bwd|a": "cudnn"}
    assert not list(path.parent.glob("*.tmp"))  # the temporary file was renamed over the cache
    for damaged in ("{not json", "[1, 2]", '{"k": "torch", "j": 3}', ""):
        path.write_text(damaged)
        assert fa.read_auto_cache() == {}  # ignored ...
        assert fa.write_auto_choice("k", "cudnn") and fa.read_auto_cache() == {"k": "cudnn"}  # ... and rewritten
    ro = tmp_path / "ro"
    ro.write_text("a file, not a folder")
    assert not fa.write_auto_choice("k", "ours", ro / "x" / "flash_auto.json")  # cannot write: False, no crash


def test_kernel_choices_round_trip_through_json(rng):
    """A run's record of what "auto" resolved goes into a checkpoint's meta.json and back unchanged."""
    import json

    entries = {(d, int(rng.integers(1, 64)), int(rng.integers(1, 16)), int(rng.integers(1, 4096)), D, dt, c):
               str(rng.choice(fa.AUTO_RESOLVES_TO))
               for d in ("fwd", "bwd") for D in (64, 128) for dt in ("bf16", "fp16") for c in (True, False)}
    rec = fa.KernelChoices(entries)
    text = json.dumps(rec.as_dict())
    back = fa.KernelChoices.from_dict(json.loads(text))
    assert back == rec and len(back) == len(entries) and dict(back.items()) == entries
    assert "fwd B=" in text and " causal" in text and " full" in text
    assert fa.KernelChoices.from_dict({}) == fa.KernelChoices()


@pytest.mark.parametrize("bad,match", [
    ({"fwd B=1 H=2 T=3 D=64 bf16 causal": "torch"}, "one of"),
    ({"sideways B=1 H=2 T=3 D=64 bf16 causal": "ours"}, "not of the form"),
    ({"fwd B=1 H=2 T=3 bf16 causal": "ours"}, "not of the form"),
    (["fwd"], "must be a dict"),
])
def test_kernel_choices_refuse_a_bad_record(bad, match):
    with pytest.raises(ValueError, match=match):
        fa.KernelChoices.from_dict(bad)


def test_choices_argument_is_checked(rng):
    q = random_array(rng, (1, 2, 9, 64), "fp64")
    with pytest.raises(TypeError, match="choices must be a KernelChoices"):
        fa.flash_attention_forward(q, q, q, choices={})
    o, st = fa.flash_attention_forward(q, q, q, choices=fa.KernelChoices())
    with pytest.raises(TypeError, match="choices must be a KernelChoices"):
        fa.flash_attention_backward(q, q, q, q, o, st, choices="auto")


def test_auto_prefers_cudnn_within_the_margin():
    assert fa.pick_faster({"ours": 1.0, "cudnn": 1.02}) == "cudnn"  # 2 % faster: inside the margin
    assert fa.pick_faster({"ours": 1.0, "cudnn": 1.0 + fa.AUTO_MARGIN}) == "ours"
    assert fa.pick_faster({"ours": 2.0, "cudnn": 1.0}) == "cudnn"
    assert fa.pick_faster({"ours": 1.0}) == "ours"


# =========================================================================== GPU


def _dev(cp, rng, shape, dtype, scale=1.0):
    return cp.asarray(random_array(rng, shape, dtype, scale=scale))


def _ref64(cp, q, k, v, do, causal):
    """float64 (o, lse, dq, dk, dv) on the host from the device inputs."""
    f = [cp.asnumpy(a).astype(np.float64) for a in (q, k, v, do)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = ref.naive_forward(*f[:3], scale, causal)
    return (o, lse, *ref.naive_backward(f[3], *f[:3], o, lse, scale, causal))


CASES = [((1, 1, 1, 64), True), ((1, 2, 7, 64), True), ((2, 3, 63, 64), False), ((2, 3, 65, 128), True),
         ((1, 2, 1000, 64), True), ((1, 2, 1024, 128), False), ((8, 24, 65, 64), True), ((1, 1, 130, 128), True),
         ((2, 2, 1000, 128), True), ((1, 1, 1024, 64), False)]


def _f64(a):
    return a.astype(np.float32).astype(np.float64)


def _poison_stats(cp, shape, variant):
    """NaN in the cached row-stats buffer, so a variant that fails to write D (or reads it before it is written)
    shows."""
    fl.row_stats_buffer(cp, *shape[:3], variant).fill(np.nan)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", CASES)
def test_gpu_ours_matches_float64(cp, rng, dtype, shape, causal, variant):
    q, k, v, do = (_dev(cp, rng, shape, dtype) for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, causal, out=poisoned(shape, dtype, cp),
                                       lse=poisoned(shape[:3], "fp32", cp), kernel="ours")
    _poison_stats(cp, shape, variant)
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=poisoned(shape, dtype, cp),
                                             dk=poisoned(shape, dtype, cp), dv=poisoned(shape, dtype, cp),
                                             kernel="ours", variant=variant)
    r_o, r_lse, r_dq, r_dk, r_dv = _ref64(cp, q, k, v, do, causal)
    assert_close(o, r_o, rtol=RTOL[dtype], name="o")
    assert_close(st.lse, r_lse, rtol=1e-4, name="lse")
    stats = fl.row_stats_buffer(cp, *shape[:3], variant)  # D = rowsum(dO ⊙ O) of the o it was given, every row
    assert_close(stats[..., -1], (_f64(do) * _f64(o)).sum(-1), rtol=1e-5, name="D")
    if stats.shape[-1] == 2:  # and lse · log2 e, as the dK, dV kernel uses it
        assert_close(stats[..., 0], st.lse.astype(np.float64) * np.log2(np.e), rtol=1e-6, name="lse·log2e")
    if shape[2] == 1:  # one key: P = 1, dv = dO exactly; dq = dk = 0 up to rounding (dP and D are summed in
        # different orders, so dS = dP − D is ~1e-7, not exactly 0)
        assert float(cp.abs(dq.astype(np.float32)).max()) < 1e-3 and float(cp.abs(dk.astype(np.float32)).max()) < 1e-3
        assert cp.array_equal(dv, do)
        return
    for g, r, n in ((dq, r_dq, "dq"), (dk, r_dk, "dk"), (dv, r_dv, "dv")):
        assert_close(g, r, rtol=2 * RTOL[dtype], name=n)


def _hopper(cp) -> bool:
    return cp.cuda.Device().compute_capability == "90"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", CASES)
def test_gpu_forward_kernels_match_float64(cp, rng, kernel, dtype, shape, causal):
    """Both tensor-core forwards (``"ours"`` is one of them: the backward test above runs it) into poisoned o, lse."""
    if kernel == "wgmma" and not _hopper(cp):
        pytest.skip("the wgmma forward runs on Hopper (sm_90) only")
    q, k, v = (_dev(cp, rng, shape, dtype) for _ in range(3))
    o, st = fa.flash_attention_forward(q, k, v, causal, out=poisoned(shape, dtype, cp),
                                       lse=poisoned(shape[:3], "fp32", cp), kernel=kernel)
    r_o, r_lse, *_ = _ref64(cp, q, k, v, q, causal)
    assert_close(o, r_o, rtol=RTOL[dtype], name="o")
    assert_close(st.lse, r_lse, rtol=1e-4, name="lse")


@pytest.mark.gpu
def test_gpu_ours_forward_is_the_hopper_one_there(cp, rng):
    """On an sm_90 GPU ``"ours"`` runs the wgmma forward (bit for bit), repeatably and inside a CUDA graph; elsewhere
    it runs mma.sync and ``kernel="wgmma"`` says why it cannot run."""
    from llmgpu.perf.graphs import capture

    shape = (2, 3, 333, 64)
    q, k, v = (_dev(cp, rng, shape, "bf16") for _ in range(3))
    if not _hopper(cp):
        assert fl.forward_impl(q) == "mma"
        with pytest.raises(RuntimeError, match="sm_90a"):
            fa.flash_attention_forward(q, k, v, kernel="wgmma")
        return
    assert fl.forward_impl(q) == "wgmma" and fl.forward_impl(_dev(cp, rng, shape, "fp32")) == "mma"
    want, want_st = fa.flash_attention_forward(q, k, v, kernel="wgmma")
    o, lse = poisoned(shape, "bf16", cp), poisoned(shape[:3], "fp32", cp)
    g = capture(lambda: fa.flash_attention_forward(q, k, v, out=o, lse=lse, kernel="ours"))
    for _ in range(2):
        o.fill(np.nan)
        g.replay()
        cp.cuda.Device().synchronize()
        assert cp.array_equal(o, want) and cp.array_equal(lse, want_st.lse)
    mma, _ = fa.flash_attention_forward(q, k, v, kernel="mma")
    assert_close(mma, want, rtol=RTOL["bf16"], name="mma vs wgmma")  # the same math, other roundings


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", [((1, 1, 1, 64), True), ((2, 3, 63, 64), False), ((2, 3, 65, 128), True),
                                          ((1, 2, 1000, 128), True), ((4, 6, 257, 64), True)])
def test_gpu_scalar_forward_matches_float64(cp, rng, dtype, shape, causal):
    q, k, v = (_dev(cp, rng, shape, dtype) for _ in range(3))
    o, st = fa.flash_attention_forward(q, k, v, causal, out=poisoned(shape, dtype, cp),
                                       lse=poisoned(shape[:3], "fp32", cp), kernel="scalar")
    r_o, r_lse, *_ = _ref64(cp, q, k, v, q, causal)
    assert_close(o, r_o, rtol=RTOL[dtype] / 2, name="o")
    assert_close(st.lse, r_lse, rtol=1e-5, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_qkv_views(cp, rng, D, variant):
    """q, k, v as strided views of one [B, T, 3C] buffer, o into [B, T, C], dq/dk/dv into [B, T, 3C]."""
    B, T, H = 2, 77, 3
    C = H * D
    qkv = _dev(cp, rng, (B, T, 3 * C), "bf16")
    q, k, v = fa.split_qkv(qkv, H)
    y = poisoned((B, T, C), "bf16", cp)
    o, st = fa.flash_attention_forward(q, k, v, out=fa.heads_view(y, H), kernel="ours")
    dout = _dev(cp, rng, (B, T, C), "bf16")
    dqkv = poisoned((B, T, 3 * C), "bf16", cp)
    dq, dk, dv = fa.split_qkv(dqkv, H)
    fa.flash_attention_backward(fa.heads_view(dout, H), q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="ours",
                                variant=variant)
    assert not cp.isnan(y.astype(np.float32)).any() and not cp.isnan(dqkv.astype(np.float32)).any()
    oc, stc = fa.flash_attention_forward(*(cp.ascontiguousarray(a) for a in (q, k, v)), kernel="ours")
    assert cp.array_equal(fa.heads_view(y, H), oc)  # the same arithmetic whatever the strides
    want = fa.flash_attention_backward(cp.ascontiguousarray(fa.heads_view(dout, H)),
                                       *(cp.ascontiguousarray(a) for a in (q, k, v)), oc, stc, kernel="ours",
                                       variant=variant)
    for g, w in zip((dq, dk, dv), want):
        assert cp.array_equal(g, w)
    r_o, _, r_dq, r_dk, r_dv = _ref64(cp, q, k, v, fa.heads_view(dout, H), True)
    assert_close(fa.heads_view(y, H), r_o, rtol=RTOL["bf16"], name="o")
    for g, r, n in ((dq, r_dq, "dq"), (dk, r_dk, "dk"), (dv, r_dv, "dv")):
        assert_close(g, r, rtol=2 * RTOL["bf16"], name=n)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "scalar"])
def test_gpu_nan_in_nan_out(cp, rng, kernel):
    if kernel == "wgmma" and not _hopper(cp):
        pytest.skip("the wgmma forward runs on Hopper (sm_90) only")
    shape = (1, 2, 100, 64)
    q, k, v = (_dev(cp, rng, shape, "bf16") for _ in range(3))
    q[0, 1, 40, 3] = np.nan
    o, st = fa.flash_attention_forward(q, k, v, kernel=kernel)
    bad = cp.isnan(o.astype(np.float32)).any(axis=-1)
    assert bool(bad[0, 1, 40]) and int(bad.sum()) == 1  # that row only
    assert bool(cp.isnan(st.lse[0, 1, 40]))
    k[0, 0, 10, 0] = np.nan  # a key: every row that sees it (causal: rows 10..99 of head 0)
    o, _ = fa.flash_attention_forward(q, k, v, kernel=kernel)
    bad = cp.isnan(o.astype(np.float32)).any(axis=-1)
    assert bool(bad[0, 0, 10:].all()) and not bool(bad[0, 0, :10].any())


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_backward_is_bitwise_repeatable(cp, rng, D, variant):
    shape = (2, 4, 333, D)
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    first = [g.copy() for g in fa.flash_attention_backward(do, q, k, v, o, st, kernel="ours", variant=variant)]
    for _ in range(3):
        again = fa.flash_attention_backward(do, q, k, v, o, st, kernel="ours", variant=variant)
        for a, b in zip(first, again):
            assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    assert fa.backward_is_deterministic() in (True, False)  # cuDNN may have run in another test


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_launch_order_changes_no_bit(cp, rng, D, causal):
    """Groups of 1, 3 (B·H = 10 is no multiple: the last group has blocks past the heads) and every head: the same
    outputs bit for bit (each block computes the same tile wherever it runs), every element written."""
    B, H, T = 2, 5, 333
    qkv = random_array(rng, (B, T, 3 * H * D), "bf16", cp)
    q, k, v = fa.split_qkv(qkv, H)
    do = _dev(cp, rng, (B, H, T, D), "bf16")
    impls = ["mma"] + (["wgmma"] if fl.forward_impl(q) == "wgmma" else [])
    runs = []
    for group in (B * H, 3, 1):
        out = []
        for impl in impls:
            o, lse = fa.heads_view(poisoned((B, T, H * D), "bf16", cp), H), poisoned((B, H, T), "fp32", cp)
            fl.ours_forward(q, k, v, o, lse, 1 / math.sqrt(D), causal, impl=impl, group=group)
            out += [o, lse]
        for variant in VARIANTS:
            dq, dk, dv = (poisoned((B, H, T, D), "bf16", cp) for _ in range(3))
            fl.ours_backward(do, q, k, v, out[0], out[1], 1 / math.sqrt(D), causal, dq, dk, dv, variant=variant,
                             group=group)
            out += [dq, dk, dv]
        runs.append([cp.asnumpy(a) for a in out])
    assert all(np.isfinite(a.astype(np.float32)).all() for a in runs[0])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != fa.DEFAULT_BWD_VARIANT])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", [((1, 2, 1, 64), True), ((2, 3, 97, 64), True), ((2, 3, 97, 64), False),
                                          ((1, 2, 300, 128), True), ((1, 2, 161, 128), False),
                                          ((2, 2, 1024, 64), True), ((1, 1, 4 * 128 + 31, 64), True)])
def test_gpu_variant_agrees_with_the_default(cp, rng, dtype, shape, causal, variant):
    """Each candidate against the default kernels on the same inputs: to rounding (the wide kernels round P to
    16 bits before dS, and the wide dQ kernel sums D in another order), much tighter than against float64."""
    q, k, v, do = (_dev(cp, rng, shape, dtype) for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    want = [g.copy() for g in fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours")]
    delta = fl.row_stats_buffer(cp, *shape[:3])[..., -1].copy()
    _poison_stats(cp, shape, variant)
    got = fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours", variant=variant)
    for g, w, n in zip(got, want, ("dq", "dk", "dv")):
        assert not bool(cp.isnan(g.astype(np.float32)).any()), n
        if shape[2] == 1:  # one key: dv = dO exactly, dq and dk are rounding noise around 0 (as against float64)
            assert cp.array_equal(g, w) if n == "dv" else float(cp.abs(g.astype(np.float32)).max()) < 1e-3
            continue
        assert_close(g, w, rtol=RTOL[dtype] / 2, name=n)
    assert_close(fl.row_stats_buffer(cp, *shape[:3], variant)[..., -1], delta, rtol=1e-5, name="D")  # every row


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_backward_nan_stays_in_its_rows(cp, rng, variant):
    """A NaN in one row of dO: dq of that row only, dk and dv of every key it sees, nothing in another head. (Keys
    after it in the same tiles may turn NaN too: 0 · NaN in the MMAs, as in the float64 reference, where every
    key of the head does; so those are not asserted.)"""
    shape, t = (1, 2, 200, 64), 150
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    do[0, 1, t, 5] = np.nan
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, kernel="ours", variant=variant)
    bad = {n: cp.asnumpy(cp.isnan(g.astype(np.float32)).any(axis=-1)) for n, g in (("dq", dq), ("dk", dk), ("dv", dv))}
    assert bad["dq"][0, 1, t] and int(bad["dq"].sum()) == 1
    for n in ("dk", "dv"):  # causal: keys 0..t see query t
        assert bad[n][0, 1, : t + 1].all() and not bad[n][0, 0].any(), n


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_captured_in_graph(cp, rng, variant):
    from llmgpu.perf.graphs import capture

    shape = (2, 4, 200, 64)
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    o, lse = cp.empty(shape, backend.bfloat16), cp.empty(shape[:3], np.float32)
    dq, dk, dv = (cp.empty(shape, backend.bfloat16) for _ in range(3))

    def step():
        _, st = fa.flash_attention_forward(q, k, v, out=o, lse=lse, kernel="ours")
        fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="ours", variant=variant)

    g = capture(step)
    cp.cuda.Device().synchronize()
    eager = [a.copy() for a in (o, lse, dq, dk, dv)]
    for a in (o, lse, dq, dk, dv):
        a.fill(np.nan)
    g.replay()
    cp.cuda.Device().synchronize()
    for a, e in zip((o, lse, dq, dk, dv), eager):
        assert cp.array_equal(a, e)  # deterministic: replay is bit-identical to eager


@pytest.mark.gpu
def test_gpu_auto_decides_once_per_shape(cp, rng):
    shape = (2, 3, 128, 64)
    q, k, v = (_dev(cp, rng, shape, "fp16") for _ in range(3))
    o, _ = fa.flash_attention_forward(q, k, v)
    choice = [c for key, c in fa.auto_choices().items() if key[1:] == ("fwd", *shape, "fp16", True)]
    assert choice and choice[0] in ("ours", "cudnn")
    if fa.cudnn_attention.unavailable_reason() is not None:
        assert choice[0] == "ours"  # the fast path needs no cuDNN
    o2, _ = fa.flash_attention_forward(q, k, v, kernel=choice[0])
    assert cp.array_equal(o, o2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", [((2, 3, 257, 64), True), ((1, 2, 1024, 128), False)])
def test_gpu_agrees_with_cudnn(cp, rng, dtype, shape, causal, variant):
    why = fa.cudnn_attention.unavailable_reason()
    if why is not None:
        pytest.skip(f"cuDNN flash attention not available: {why}")
    q, k, v, do = (_dev(cp, rng, shape, dtype) for _ in range(4))
    res = {}
    for kern in ("ours", "cudnn"):
        o, st = fa.flash_attention_forward(q, k, v, causal, kernel=kern)
        var = {"variant": variant} if kern == "ours" else {}
        res[kern] = (o, st.lse, *fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel=kern, **var))
    for n, a, b in zip(("o", "lse", "dq", "dk", "dv"), res["ours"], res["cudnn"]):
        assert_close(a, b, rtol=1e-4 if n == "lse" else 2 * RTOL[dtype], name=n)
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="cudnn")  # either backward takes either's lse
    assert_close(fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours", variant=variant)[0],
                 res["cudnn"][2], rtol=2 * RTOL[dtype], name="dq from cuDNN's lse")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_agrees_with_torch_sdpa(cp, rng, causal, variant):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    shape = (2, 4, 300, 64)
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours", variant=variant)
    cp.cuda.Device().synchronize()
    tq, tk, tv = (torch.from_dlpack(a).detach().requires_grad_(True) for a in (q, k, v))
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    to.backward(torch.from_dlpack(do))
    torch.cuda.synchronize()
    for n, a, t in (("o", o, to), ("dq", dq, tq.grad), ("dk", dk, tk.grad), ("dv", dv, tv.grad)):
        assert_close(a, cp.from_dlpack(t.detach().contiguous()), rtol=2 * RTOL["bf16"], name=n)


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    q = _dev(cp, rng, (1, 2, 16, 64), "fp32")
    with pytest.raises(TypeError, match="supports fp16, bf16"):
        fa.flash_attention_forward(q, q, q, kernel="ours")
    qb = q.astype(backend.bfloat16)
    with pytest.raises(TypeError, match="k=ndarray"):
        fa.flash_attention_forward(qb, cp.asnumpy(qb), qb, kernel="ours")
    odd = _dev(cp, rng, (1, 2, 16, 96), "bf16")
    with pytest.raises(ValueError, match="head dims"):
        fa.flash_attention_forward(odd, odd, odd, kernel="ours")
    with pytest.raises(ValueError, match="head dims"):
        fa.flash_attention_forward(odd, odd, odd, kernel="scalar")
    wide = _dev(cp, rng, (1, 2, 16, 72), "bf16")[..., :64]  # rows of 72 elements: fine (a multiple of 8)
    fa.flash_attention_forward(wide, wide, wide, kernel="ours")
    ragged = _dev(cp, rng, (1, 2, 16, 68), "bf16")[..., :64]
    with pytest.raises(ValueError, match="multiples of 8"):
        fa.flash_attention_forward(ragged, ragged, ragged, kernel="ours")
    shifted = _dev(cp, rng, (1 * 2 * 16 * 64 + 4,), "bf16")[4:].reshape(1, 2, 16, 64)
    with pytest.raises(ValueError, match="16-byte boundary"):
        fa.flash_attention_forward(shifted, shifted, shifted, kernel="ours")


@pytest.mark.gpu
def test_gpu_auto_choice_survives_a_new_process(cp, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path))
    shape = (1, 2, 192, 64)
    q, k, v = (_dev(cp, rng, shape, "bf16") for _ in range(3))
    fa.flash_attention_forward(q, k, v)
    key = next(key for key in fa.auto_choices() if key[1:] == ("fwd", *shape, "bf16", True))
    choice = fa.auto_choices()[key]
    cached = fa.read_auto_cache()
    if fa.cudnn_attention.unavailable_reason() is not None:
        assert cached == {}  # one candidate: nothing to remember
        return
    (disk_key,) = [dk for dk in cached if "|fwd|" in dk and "T=192" in dk]
    assert cached[disk_key] == choice
    other = "cudnn" if choice == "ours" else "ours"
    fa.write_auto_choice(disk_key, other)  # as if another process had decided the other way
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})  # a new process: nothing in memory
    monkeypatch.setattr(fa, "_time_ms", lambda *a: pytest.fail("the cached choice must be used, not re-timed"))
    run = fa.KernelChoices()  # a new run's own record
    fa.flash_attention_forward(q, k, v, choices=run)
    assert fa.auto_choices()[key] == other and run.get(key[1:]) == other


@pytest.mark.gpu
def test_gpu_auto_writes_the_callers_record_and_keeps_to_it(cp, rng, monkeypatch, tmp_path):
    """choices=: "auto" records what it resolved, per direction, in the caller's record; a record given back (a
    resumed run's, pinned from its checkpoint) is run as it says, the process record and the machine's cache file
    notwithstanding, and nothing is timed."""
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path))
    shape = (1, 3, 160, 64)
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    run = fa.KernelChoices()
    o, st = fa.flash_attention_forward(q, k, v, choices=run)
    fa.flash_attention_backward(do, q, k, v, o, st, choices=run)
    fwd, bwd = ("fwd", *shape, "bf16", True), ("bwd", *shape, "bf16", True)
    assert {key for key, _ in run.items()} == {fwd, bwd} and run.get(fwd) in fa.AUTO_RESOLVES_TO
    assert fa.choices_unavailable(run) == {}
    if fa.cudnn_attention.unavailable_reason() is not None:
        assert run.get(fwd) == run.get(bwd) == "ours"
        assert fa.choices_unavailable(fa.KernelChoices({fwd: "cudnn"})).keys() == {"cudnn"}
        return
    pinned = fa.KernelChoices.from_dict(run.as_dict())
    flip = {"ours": "cudnn", "cudnn": "ours"}
    pinned.record(fwd, flip[run.get(fwd)])  # as if the checkpointed run had resolved the other way
    monkeypatch.setattr(fa, "_time_ms", lambda *a: pytest.fail("a pinned choice is run, not re-timed"))
    o2, _ = fa.flash_attention_forward(q, k, v, choices=pinned)
    o3, _ = fa.flash_attention_forward(q, k, v, kernel=pinned.get(fwd))
    assert cp.array_equal(o2, o3) and pinned.get(fwd) == flip[run.get(fwd)]
