"""FP8 (issue 37, chapter 5): the formats, the scaled casts and their amax, scales from amax, the amax history, and
the cuBLASLt FP8 GEMM (``llmgpu.ops.fp8``, ``kernels/fp8.cu``, ``llmgpu.gemm.fp8``).

CPU: the NumPy reference against first principles (the 256 codes of each format, round-to-nearest-even found by
brute force, error bounds from the unit roundoff, saturation, NaN / inf, the scale guards), the amax history's
ring, the GEMM's emulation against the float64 product, argument checks, and the cuBLASLt plan's wiring (which
attribute and layout gets which operand) against a stand-in for nvmath's bindings. GPU (skipped with the reason
without one): the kernels' bytes, amax and scales bit for bit against the reference on odd sizes, special values,
misaligned views and poisoned outputs; fp8_gemm against the dequantized float64 product within the stated bound;
a CUDA-graph capture of cast + GEMM + scale update replayed bit-identically.
"""

from __future__ import annotations

import shutil
import subprocess
import types

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.gemm import fp8 as gemm_fp8
from llmgpu.gemm.fp8 import fp8_gemm
from llmgpu.ops import fp8
from llmgpu.ops.fp8 import E4M3, E5M2, AmaxHistory, fp8_amax, fp8_cast, quantize, quantize_reference, scale_reference
from llmgpu.ops.gelu import gelu_backward_reference, gelu_forward_reference
from llmgpu.testing import random_array, rel_error

pytestmark = pytest.mark.ch5
FORMATS = [E4M3, E5M2]
F32 = np.float32


def _f32_bits(v) -> int:
    return int(np.array([v], F32).view(np.uint32)[0])


def _one(v):
    return np.array([v], dtype=F32)


# =========================================================================== the formats


def test_format_facts():
    assert E4M3.max == 448.0 == 1.75 * 2**8 and E5M2.max == 57344.0 == 1.75 * 2**15
    assert (E4M3.mantissa_bits, E5M2.mantissa_bits) == (3, 2)
    assert (E4M3.unit_roundoff, E5M2.unit_roundoff) == (2**-4, 2**-3)
    assert (E4M3.smallest_normal, E5M2.smallest_normal) == (2**-6, 2**-14)
    assert (E4M3.smallest_subnormal, E5M2.smallest_subnormal) == (2**-9, 2**-16)
    for f in FORMATS:
        v = f.values()
        assert v.dtype == F32 and v.shape == (256,)
        assert np.isnan(v[fp8.NAN_BITS]) and np.nanmax(v[np.isfinite(v)]) == f.max
    assert np.isnan(E4M3.values()).sum() == 2 and not np.isinf(E4M3.values()).any()  # E4M3fn: no inf
    assert np.isinf(E5M2.values()).sum() == 2
    assert fp8.fp8_format("e5m2") is E5M2 and fp8.fp8_format(E4M3) is E4M3
    with pytest.raises(ValueError, match="fp8 format"):
        fp8.fp8_format("e3m4")


def test_cuda_data_type_codes_match_nvmath():
    nvmath = pytest.importorskip("nvmath", reason="nvmath-python (the fast extra) is not installed here")
    assert E4M3.cuda_data_type == int(nvmath.CudaDataType.CUDA_R_8F_E4M3)
    assert E5M2.cuda_data_type == int(nvmath.CudaDataType.CUDA_R_8F_E5M2)


def _nearest_even(v: np.ndarray, fmt) -> np.ndarray:
    """Round-to-nearest-even by brute force over the format's finite codes (no ml_dtypes rounding involved)."""
    codes = np.arange(256, dtype=np.uint8)
    vals = fmt.values().astype(np.float64)
    finite = np.isfinite(vals) & ~(codes == 0x80)  # -0 is +0's value: keep one zero
    codes, vals = codes[finite], vals[finite]
    order = np.argsort(vals)
    codes, vals = codes[order], vals[order]
    d = np.abs(v.astype(np.float64)[:, None] - vals[None, :])
    best = d.min(axis=1, keepdims=True)
    tie = d == best
    # among tied codes take the one whose mantissa is even (the code's last bit is the mantissa's)
    pick = np.where(tie & (codes[None, :] % 2 == 0), 1, 0) + tie
    out = codes[np.argmax(pick, axis=1)]
    zero = out == 0
    out[zero & np.signbit(v)] = 0x80  # signed zero, as the conversion keeps the sign
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reference_rounds_to_nearest_even(rng, fmt):
    vals = fmt.values()
    finite = np.sort(np.unique(vals[np.isfinite(vals)]))
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(F32)  # exact ties (representable in fp32)
    rand = (rng.standard_normal(3000) * fmt.max / 4).astype(F32)
    small = (rng.standard_normal(1000) * fmt.smallest_normal).astype(F32)  # subnormal range
    x = np.concatenate([mids, -mids, rand, small, finite, -finite])
    np.testing.assert_array_equal(quantize_reference(x, 1.0, fmt), _nearest_even(x, fmt))


_HOST_CONVERSION = r"""
#include <cuda_fp8.h>
#include <cstdio>
int main() {  // float32 in on stdin, the E4M3 bytes then the E5M2 bytes out: cuda_fp8.h's own conversion
    static float buf[1 << 20];
    const size_t n = fread(buf, 4, 1 << 20, stdin);
    for (int f = 0; f < 2; ++f)
        for (size_t i = 0; i < n; ++i) {
            const unsigned char q = __nv_cvt_float_to_fp8(buf[i], __NV_SATFINITE, f ? __NV_E5M2 : __NV_E4M3);
            fwrite(&q, 1, 1, stdout);
        }
}
"""


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no nvcc: the CUDA toolkit's compiler builds "
                    "cuda_fp8.h's host conversion, the reference's second opinion")
def test_reference_matches_cuda_fp8_conversion(rng, tmp_path):
    """The kernels convert with cuda_fp8.h (__NV_SATFINITE); its host build is NVIDIA's bit-exact emulation of the
    hardware conversion. The reference must give its bytes on every float32 (random bit patterns: subnormals,
    NaN payloads, infinities), NaN aside: the kernels write one canonical NaN byte."""

    (tmp_path / "conv.cu").write_text(_HOST_CONVERSION)
    subprocess.run(["nvcc", "-o", str(tmp_path / "conv"), str(tmp_path / "conv.cu")], check=True, timeout=300)
    x = np.concatenate([(rng.standard_normal(60_000) * s).astype(F32) for s in (1e-4, 1e-2, 1.0, 30.0, 500.0, 1e5)]
                       + [rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(F32),
                          np.array([np.inf, -np.inf, -0.0, 464, 465, -464.0001, 57344, 61440, 61441], F32)])
    got = np.frombuffer(subprocess.run([str(tmp_path / "conv")], input=x.tobytes(), capture_output=True, check=True,
                                       timeout=300).stdout, np.uint8).reshape(2, -1)
    for k, fmt in enumerate(FORMATS):
        want = quantize_reference(x, 1.0, fmt)
        assert np.array_equal(np.where(np.isnan(x), want, got[k]), want), fmt.name
        assert np.all(want[np.isnan(x)] == fp8.NAN_BITS)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_round_trip_error_bounds(rng, fmt, dtype):
    """|x − dequant(quant(x))| ≤ u·|x| where x·s is normal, ≤ half the smallest subnormal / s below that."""
    x = random_array(rng, (4099,), dtype, scale=3.0)
    x32 = x.astype(F32)
    amax = fp8.amax_reference(x)
    s = scale_reference(amax, 1.0, fmt)
    q = quantize_reference(x, s, fmt)
    back = fmt.values()[q].astype(np.float64) / np.float64(s)
    err = np.abs(back - x32)
    normal = np.abs(x32 * s) >= fmt.smallest_normal
    assert np.all(err[normal] <= fmt.unit_roundoff * np.abs(x32[normal]) * (1 + 1e-6))
    assert np.all(err[~normal] <= fmt.smallest_subnormal / 2 / s * (1 + 1e-6))
    assert np.max(np.abs(fmt.values()[q])) == fmt.max  # the scale maps amax onto the largest value


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_saturation_nan_and_signed_zero(fmt):
    big = np.array([fmt.max, fmt.max * 1.01, 1e30, np.inf, -fmt.max * 3, -np.inf, np.nan, -np.nan, -0.0, -1e-30, 1e-30],
                   F32)
    q = quantize_reference(big, 1.0, fmt)
    v = fmt.values()[q]
    np.testing.assert_array_equal(v[:6], [fmt.max, fmt.max, fmt.max, fmt.max, -fmt.max, -fmt.max])
    assert q[6] == q[7] == fp8.NAN_BITS
    assert list(q[8:]) == [0x80, 0x80, 0x00]
    # the scale multiplies first: 300 fits E4M3 unscaled, not scaled by 2 (E5M2 rounds 600 to 640)
    assert fmt.values()[quantize_reference(np.array([300.0], F32), 2.0, fmt)][0] == (448.0 if fmt is E4M3 else 640.0)


# =========================================================================== amax and scales


@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
def test_amax_reference_finite_nan_inf(rng, n):
    x = random_array(rng, (n,), "bf16", scale=5.0)
    assert fp8.amax_reference(x) == np.abs(x.astype(F32)).max()
    y = x.astype(F32)
    y[n // 2] = -np.inf
    assert fp8.amax_reference(y) == np.inf
    y[n - 1] = np.array([0xFFC00123], np.uint32).view(F32)[0]  # a negative NaN with a payload
    a = fp8.amax_reference(y)
    assert np.isnan(a) and _f32_bits(a) == 0x7FC00000  # canonical quiet NaN, whatever came in


def test_fp8_amax_accumulates(rng):
    out = _one(0.0)
    fp8_amax(random_array(rng, (100,), scale=0.1), out)
    first = out[0]
    x = random_array(rng, (50,), scale=10.0)
    fp8_amax(x, out, accumulate=True)
    assert out[0] == max(first, np.abs(x).max())
    fp8_amax(random_array(rng, (50,), scale=1e-3), out, accumulate=True)
    assert out[0] == max(first, np.abs(x).max())
    with pytest.raises(ValueError, match="out must be given"):
        fp8_amax(x, accumulate=True)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_reference_and_guards(fmt):
    assert scale_reference(F32(2.0), 1.0, fmt) == F32(fmt.max) / F32(2.0)
    assert scale_reference(F32(3.0), 1.0, fmt, margin=2) == F32(fmt.max) / F32(3.0) / 4
    p = scale_reference(F32(3.0), 1.0, fmt, pow2=True)
    assert p <= F32(fmt.max) / F32(3.0) < 2 * p and np.log2(p) == np.round(np.log2(p))
    for bad in (0.0, np.inf, np.nan):  # keep the previous scale
        assert scale_reference(F32(bad), F32(0.25), fmt) == F32(0.25)
    hi, lo = F32(2.0**fp8.SCALE_EXP_LIMIT), F32(2.0**-fp8.SCALE_EXP_LIMIT)
    assert scale_reference(F32(1e-44), 1.0, fmt) == hi  # a subnormal amax: clamped, not inf
    assert scale_reference(np.finfo(F32).max, 1.0, fmt, margin=64) == lo
    for s in (hi, lo):
        assert np.isfinite(F32(1) / s) and abs(F32(1) / s) >= np.finfo(F32).tiny


def test_amax_history_ring_and_scale():
    h = AmaxHistory("e4m3", 3, xp=np)
    assert h.scale[0] == 1 and h.scale_inv[0] == 1
    seen = []
    for a in (2.0, 8.0, 1.0, 0.5, 0.25, 0.0):
        h.amax[0] = a
        h.update()
        seen.append(a)
        want = max(seen[-3:])
        assert h.scale[0] == (scale_reference(F32(want), 0, "e4m3") if want > 0 else h.scale[0])
        assert h.scale_inv[0] == F32(1) / h.scale[0]
    assert list(h.history) == [0.5, 0.25, 0.0] and h.pos[0] == 0  # pos wrapped: the ring rotates on the device
    before = h.scale[0]
    h.amax[0] = np.nan
    h.update()
    assert np.isnan(h.history).any() and h.scale[0] == before  # a NaN freezes the scale while it is in the ring
    for _ in range(3):
        h.amax[0] = 4.0
        h.update()
    assert h.scale[0] == scale_reference(F32(4.0), 0, "e4m3")  # and it leaves after n steps
    with pytest.raises(ValueError, match="length"):
        AmaxHistory(length=0, xp=np)
    with pytest.raises(ValueError, match="margin"):
        AmaxHistory(margin=-1, xp=np)


STATE_ARRAYS = ("history", "pos", "amax", "scale", "scale_inv")


def _random_states(rng, n, length):
    """Values for n scaling states: rings of amaxes over many magnitudes with, here and there, an all-zero ring or
    an inf, a NaN or a subnormal entry (a ring max of 0, inf or NaN keeps the previous scale; a subnormal one clamps
    the scale), write positions (every other one near the ring's end, so that a few updates wrap it) and scales."""
    states = []
    for i in range(n):
        hist = (np.abs(rng.standard_normal(length)) * 10.0 ** rng.integers(-4, 5, length)).astype(F32)
        kind = i % 5
        if kind == 1:
            hist[:] = 0
        elif kind in (2, 3, 4):
            hist[rng.integers(0, length)] = (np.inf, np.nan, 1e-44)[kind - 2]
        pos = rng.integers(max(0, length - 3), length) if i % 2 else rng.integers(0, length)
        scale = F32(2.0 ** rng.integers(-20, 20) * rng.uniform(0.5, 1.0))
        states.append({"history": hist, "pos": np.array([pos], np.int32), "amax": _one(0.0), "scale": _one(scale),
                       "scale_inv": _one(F32(1) / scale)})
    return states


def _random_amaxes(rng, n):
    """One step's amaxes of n tensors: mostly random magnitudes, some 0, inf, NaN and subnormal."""
    a = (np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-4, 5, n)).astype(F32)
    special = rng.random(n) < 0.3
    a[special] = rng.choice(np.array([0.0, np.inf, np.nan, 1e-44], F32), size=int(special.sum()))
    return a


def _make_states(xp, values, length, margin, pow2):
    """AmaxHistory states (E4M3 and E5M2 in turn) holding ``values`` (``_random_states``)."""
    states = [AmaxHistory(FORMATS[i % 2], length, margin=margin, pow2=pow2, xp=xp) for i in range(len(values))]
    for st, v in zip(states, values):
        for name in STATE_ARRAYS:
            getattr(st, name)[...] = backend.to_device(v[name], xp)
    return states


def _set_amaxes(states, amaxes):
    for st, a in zip(states, amaxes):
        st.amax[...] = backend.to_device(_one(a), st.xp)


def _assert_states_bitwise(got, want):
    """Every array of two lists of states equal bit for bit (NaN payloads included)."""
    for name in STATE_ARRAYS:
        g, w = (np.stack([backend.to_numpy(getattr(st, name)) for st in sts]) for sts in (got, want))
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("length,margin,pow2", [(1, 0, False), (3, 1, True), (5, 0, True), (4, 3, False)])
def test_amax_histories_match_per_state_updates(rng, length, margin, pow2):
    """A group of states (E4M3 and E5M2 mixed) keeps their values when it is made, its buffers are the states' arrays,
    and its update_and_clear gives bit for bit what each state's update() and a zeroed amax give, through rounds
    that wrap every ring, with 0, inf, NaN and subnormal amaxes."""
    n = 11
    start = _random_states(rng, n, length)
    grouped, own = (_make_states(np, start, length, margin, pow2) for _ in range(2))
    group = fp8.AmaxHistories(grouped)
    assert len(group.states) == n and group.history.shape == (n, length) and group.fp8_max.dtype == F32
    np.testing.assert_array_equal(group.fp8_max, [FORMATS[i % 2].max for i in range(n)])
    _assert_states_bitwise(grouped, own)  # grouping copies the values
    for i, st in enumerate(grouped):
        assert st.group is group and np.shares_memory(st.history, group.history[i])
        for name in STATE_ARRAYS[1:]:
            view = getattr(st, name)
            assert view.shape == (1,) and np.shares_memory(view, getattr(group, name)[i, :1])
            assert view.ctypes.data % 16 == 0, name  # cuBLASLt refuses scale pointers off 16-byte boundaries
    for _ in range(length + 3):
        amaxes = _random_amaxes(rng, n)
        _set_amaxes(grouped, amaxes)
        _set_amaxes(own, amaxes)
        np.testing.assert_array_equal(group.amax[:, 0].view(np.uint32), amaxes.view(np.uint32))  # the casts' writes
        group.update_and_clear()
        for st in own:
            st.update()
            st.amax[0] = 0
        _assert_states_bitwise(grouped, own)
    assert not group.amax.any()
    grouped[0].amax[0] = 5.0
    grouped[0].update()  # a grouped state still updates alone, in the group's buffers
    assert group.pos[0, 0] == grouped[0].pos[0] and group.history[0].max() >= 5.0
    group.clear_amax()
    assert not group.amax.any()


def test_amax_histories_checks():
    a, b = AmaxHistory("e4m3", 4, xp=np), AmaxHistory("e5m2", 4, xp=np)
    for bad, needle in (([a, AmaxHistory("e4m3", 3, xp=np)], "share their length"),
                        ([a, AmaxHistory("e4m3", 4, margin=1, xp=np)], "share their margin"),
                        ([a, AmaxHistory("e4m3", 4, pow2=True, xp=np)], "share their pow2"),
                        ([a, b, a], "each once"), ([], "at least one")):
        with pytest.raises(ValueError, match=needle):
            fp8.AmaxHistories(bad)
    fp8.AmaxHistories([a, b])
    with pytest.raises(ValueError, match="already in a group"):
        fp8.AmaxHistories([b])
    assert "2 states" in repr(a.group) and a.group is b.group


# =========================================================================== the cast (NumPy)


@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 5, 33), (64, 64)])
def test_cast_numpy_rowwise_transpose_amax(rng, shape):
    x = random_array(rng, shape, "bf16", scale=2.0)
    scale, amax = _one(37.5), _one(123.0)
    t = fp8_cast(x, scale, "e4m3", transpose=True, amax=amax)
    np.testing.assert_array_equal(t.data, quantize_reference(x, scale[0], E4M3))
    np.testing.assert_array_equal(t.data_t, t.data.reshape(-1, shape[-1]).T)
    assert t.data_t.shape == (shape[-1], x.size // shape[-1]) and t.data.dtype == np.uint8
    assert amax[0] == fp8.amax_reference(x) and t.scale_inv[0] == F32(1) / F32(37.5) and t.fmt is E4M3
    only_t = fp8_cast(x, scale, "e4m3", rowwise=False, transpose=True)
    assert only_t.data is None
    np.testing.assert_array_equal(only_t.data_t, t.data_t)
    np.testing.assert_array_equal(fp8.dequantize(t.data, t.scale_inv, "e4m3"),
                                  E4M3.values()[t.data] * (F32(1) / F32(37.5)))


def test_quantize_recipes():
    x = np.array([[1.0, -3.0], [0.5, 2.0]], F32)
    cur = AmaxHistory("e4m3", xp=np)
    t = quantize(x, cur, recipe="current")
    assert cur.scale[0] == F32(448) / F32(3) and np.abs(E4M3.values()[t.data]).max() == 448
    late = AmaxHistory("e4m3", 4, xp=np)
    t = quantize(x, late, recipe="delayed")
    assert t.scale_inv[0] == 1 and late.amax[0] == 3 and late.history.max() == 0  # cast with the old scale
    late.update()
    t2 = quantize(2 * x, late, recipe="delayed")
    assert t2.scale_inv[0] == F32(1) / (F32(448) / F32(3)) and late.amax[0] == 6
    assert np.abs(E4M3.values()[t2.data]).max() == 448  # 6 · 448/3 saturates: the cast clips
    with pytest.raises(ValueError, match="recipe"):
        quantize(x, cur, recipe="just-in-time")


def test_cast_bad_arguments(rng):
    x = random_array(rng, (4, 8))
    s = _one(1.0)
    with pytest.raises(ValueError, match="shape"):
        fp8_cast(x, np.ones(2, F32))
    with pytest.raises(TypeError, match="fp32"):
        fp8_cast(x, np.ones(1, np.float64))
    with pytest.raises(TypeError, match="dtype"):
        fp8_cast(x.astype(np.float64), s)
    with pytest.raises(TypeError, match="uint8"):
        fp8_cast(x, s, out=np.empty((4, 8), np.int8))
    with pytest.raises(ValueError, match="out_t must have shape"):
        fp8_cast(x, s, transpose=True, out_t=np.empty((4, 8), np.uint8))
    with pytest.raises(ValueError, match="writes nothing"):
        fp8_cast(x, s, rowwise=False)
    with pytest.raises(ValueError, match="out_t= was given"):
        fp8_cast(x, s, out_t=np.empty((8, 4), np.uint8))
    with pytest.raises(ValueError, match="needs amax"):
        fp8_cast(x, s, accumulate_amax=True)
    with pytest.raises(ValueError, match="overlaps"):
        fp8_cast(x, s, scale_inv=s)
    with pytest.raises(ValueError, match="fp8 format"):
        fp8_cast(x, s, "e4m3fnuz")
    with pytest.raises(ValueError, match="x must have at least one axis"):  # it failed on x.shape[-1]
        fp8_cast(np.array(1.0, F32), s)
    for bad in (0.0, -2.0, np.inf, np.nan):  # the bytes would be all 0 (inf) or NaN: refused where it is free
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            fp8_cast(x, _one(bad))
    with pytest.raises(ValueError, match=r"scale_inv must have shape \[1\], got \(2,\)"):
        fp8.dequantize(fp8_cast(x, s).data, np.ones(2, F32))
    with pytest.raises(TypeError, match="state must be an AmaxHistory"):
        quantize(x, "e4m3")


# =========================================================================== GELU inside the casts (NumPy)


def _act_inputs(rng, shape, dtype="fp32"):
    """x, pre, bias for the act= casts: GELU's input spread over its curved part, in ``dtype``."""
    x = random_array(rng, shape, dtype, scale=3.0)
    pre = random_array(rng, shape, dtype, scale=3.0)
    bias = random_array(rng, (shape[-1],), dtype, scale=0.5)
    return x, pre, bias


def test_act_reference_is_gelu_and_its_gradient(rng):
    """GELU(x + b) as chapter 3's reference gives it; x · GELU'(pre + b) against central differences of that
    reference in float64; no act: x itself."""
    x, pre, b = _act_inputs(rng, (5, 12))
    x64, p64, b64 = (a.astype(np.float64) for a in (x, pre, b))
    v = fp8.act_reference(x, "gelu", bias=b)
    assert v.dtype == F32 and v.shape == x.shape
    np.testing.assert_allclose(v, gelu_forward_reference(x64 + b64), rtol=1e-6, atol=1e-30)
    h = 1e-6
    fd = (gelu_forward_reference(p64 + b64 + h) - gelu_forward_reference(p64 + b64 - h)) / (2 * h)
    np.testing.assert_allclose(fp8.act_reference(x, "dgelu", pre=pre, bias=b), x64 * fd, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fp8.act_reference(x, "gelu"), gelu_forward_reference(x64).astype(F32))
    assert fp8.act_reference(x) is x


@pytest.mark.parametrize("act", ["gelu", "dgelu"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (64, 64)])
def test_cast_numpy_gelu_in_the_cast(rng, act, shape):
    """The cast of act's values: the bytes, the transpose and amax of GELU(x + b) or x · GELU'(pre + b), and the
    column sums added (not written) into the bias gradient."""
    x, pre, b = _act_inputs(rng, shape, "bf16")
    pre = pre if act == "dgelu" else None
    v = fp8.act_reference(x, act, pre, b)
    scale, amax = _one(40.0), _one(-1.0)
    sums = np.full(shape[-1], 0.5, F32)
    t = fp8_cast(x, scale, "e5m2", transpose=True, amax=amax, act=act, pre=pre, bias=b, column_sums=sums)
    np.testing.assert_array_equal(t.data, quantize_reference(v, scale[0], E5M2))
    np.testing.assert_array_equal(t.data_t, t.data.T)
    assert _f32_bits(amax[0]) == _f32_bits(fp8.amax_reference(v))
    np.testing.assert_allclose(sums, 0.5 + v.astype(np.float64).sum(axis=0), rtol=1e-6, atol=1e-6)
    st = AmaxHistory("e4m3", xp=np)
    q = quantize(x, st, recipe="current", act=act, pre=pre, bias=b)
    assert st.scale[0] == F32(448) / fp8.amax_reference(v)
    np.testing.assert_array_equal(q.data, quantize_reference(v, st.scale[0], E4M3))
    got = fp8_amax(x, act=act, pre=pre, bias=b)
    assert _f32_bits(got[0]) == _f32_bits(fp8.amax_reference(v))


def test_act_bad_arguments(rng):
    x, pre, b = _act_inputs(rng, (4, 8))
    s = _one(1.0)
    cases = [
        (dict(act="relu"), ValueError, "act must be one of"),
        (dict(act="dgelu"), ValueError, "pre= .GELU's input. must be given"),
        (dict(act="gelu", pre=pre), ValueError, "act='gelu' takes none"),
        (dict(act="dgelu", pre=pre[:2]), ValueError, "pre must have shape"),
        (dict(act="dgelu", pre=pre.astype(backend.bfloat16)), TypeError, "pre must be fp32, got bfloat16"),
        (dict(bias=b), ValueError, "act=None takes none"),
        (dict(act="gelu", bias=b[:4]), ValueError, "bias must have shape"),
        (dict(act="dgelu", pre=pre, column_sums=np.zeros(4, F32)), ValueError, "column_sums must have shape"),
        (dict(act="dgelu", pre=pre, column_sums=np.zeros(8, np.float64)), TypeError, "column_sums must be fp32"),
    ]
    for kwargs, err, match in cases:
        with pytest.raises(err, match=match):
            fp8_cast(x, s, transpose=True, **kwargs)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        fp8_cast(x.astype(np.float16), s, act="gelu")
    with pytest.raises(TypeError, match="column_sums= takes x as float32 or bfloat16"):
        fp8_cast(x.astype(np.float16), s, column_sums=np.zeros(8, F32))
    with pytest.raises(ValueError, match="overlaps"):
        flat = np.zeros(40, F32)
        fp8_cast(flat[:32].reshape(4, 8), s, act="dgelu", pre=pre, column_sums=flat[24:32])
    with pytest.raises(ValueError, match="pre= .GELU's input. must be given"):
        fp8_amax(x, act="dgelu")


# =========================================================================== the GEMM (NumPy emulation)


def _fp8_operand(rng, shape, fmt, spread=1.0):
    """Random FP8 bytes of ``fmt`` (finite), a power-of-two-free scale_inv, and their float64 values."""
    x = random_array(rng, shape, scale=spread)
    s = scale_reference(fp8.amax_reference(x), 1.0, fmt)
    q = quantize_reference(x, s, fmt)
    sinv = _one(F32(1) / s)
    return q, sinv, fmt.values()[q].astype(np.float64) * np.float64(sinv[0])


def _bound(A, B, out_fmt_u, k):
    """The docstring's elementwise bound: u_out·|R| + K·2^-13·(|A||B|ᵀ) (+ the output's smallest step)."""
    R = A @ B.T
    return R, out_fmt_u * np.abs(R) + k * 2.0**-13 * (np.abs(A) @ np.abs(B).T) + 1e-30


U_OUT = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24, "e4m3": 2.0**-4, "e5m2": 2.0**-3}


@pytest.mark.parametrize("out_dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_gemm_emulation_matches_float64(rng, out_dtype, fmts):
    M, K, N = 9, 48, 32
    a, sa, A = _fp8_operand(rng, (M, K), fp8.fp8_format(fmts[0]))
    b, sb, B = _fp8_operand(rng, (N, K), fp8.fp8_format(fmts[1]), spread=0.01)
    out = fp8_gemm(a, b, sa, sb, a_format=fmts[0], b_format=fmts[1], out_dtype=out_dtype)
    assert out.shape == (M, N) and out.dtype == backend.resolve_dtype(out_dtype)
    R, tol = _bound(A, B, U_OUT[out_dtype], K)
    assert np.all(np.abs(out.astype(np.float64) - R) <= tol)
    acc = random_array(rng, (M, N))
    want = 0.5 * R + 2.0 * acc.astype(np.float64)
    got = fp8_gemm(a, b, sa, sb, a_format=fmts[0], b_format=fmts[1], out=acc.copy(), out_dtype="fp32", alpha=0.5,
                   beta=2.0)
    assert rel_error(got, want) < 1e-5


def test_gemm_emulation_fp8_output_and_amax(rng):
    M, K, N = 5, 32, 16
    a, sa, A = _fp8_operand(rng, (M, K), E4M3)
    b, sb, B = _fp8_operand(rng, (N, K), E4M3)
    R = A @ B.T
    out_scale, amax = _one(F32(E4M3.max) / F32(np.abs(R).max() * 1.1)), _one(-1.0)
    q = fp8_gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=out_scale, amax_out=amax)
    assert q.dtype == np.uint8
    assert abs(amax[0] - np.abs(R).max()) <= 1e-5 * np.abs(R).max()
    got = E4M3.values()[q].astype(np.float64) / out_scale[0]
    R, tol = _bound(A, B, U_OUT["e4m3"], K)
    assert np.all(np.abs(got - R) <= tol + E4M3.smallest_subnormal / out_scale[0])


def test_linear_layer_in_fp8_with_transposed_casts(rng):
    """y = x Wᵀ, dx = dy W, dW = dyᵀ x: every GEMM in the TN form, the backward ones on the casts' transposes."""
    T, Cin, Cout = 24, 32, 48
    x, w, dy = random_array(rng, (T, Cin)), random_array(rng, (Cout, Cin), scale=0.2), random_array(rng, (T, Cout))
    hx, hw, hg = AmaxHistory("e4m3", xp=np), AmaxHistory("e4m3", xp=np), AmaxHistory("e5m2", xp=np)
    qx, qw, qg = (quantize(v, h, transpose=True) for v, h in ((x, hx), (w, hw), (dy, hg)))
    y = fp8_gemm(qx.data, qw.data, qx.scale_inv, qw.scale_inv, out_dtype="fp32")
    dx = fp8_gemm(qg.data, qw.data_t, qg.scale_inv, qw.scale_inv, a_format="e5m2", out_dtype="fp32")
    dw = fp8_gemm(qg.data_t, qx.data_t, qg.scale_inv, qx.scale_inv, a_format="e5m2", out_dtype="fp32")
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, dy))
    u4, u5 = E4M3.unit_roundoff, E5M2.unit_roundoff
    assert rel_error(y, x64 @ w64.T) < 2 * u4 and rel_error(dx, g64 @ w64) < u4 + u5
    assert rel_error(dw, g64.T @ x64) < u4 + u5


def test_gemm_bad_arguments(rng):
    a, sa, _ = _fp8_operand(rng, (4, 16), E4M3)
    b, sb, _ = _fp8_operand(rng, (16, 16), E4M3)
    with pytest.raises(ValueError, match="share K"):
        fp8_gemm(a, b[:, :8].copy(), sa, sb)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8_gemm(a, b, sa, sb, a_format="e5m2", b_format="e5m2")
    with pytest.raises(ValueError, match="needs out_scale"):
        fp8_gemm(a, b, sa, sb, out_dtype="e4m3")
    with pytest.raises(ValueError, match="FP8 outputs only"):
        fp8_gemm(a, b, sa, sb, amax_out=_one(0))
    with pytest.raises(ValueError, match="not FP8 bytes"):
        fp8_gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=_one(1), out=np.zeros((4, 16), np.uint8), beta=1.0)
    with pytest.raises(TypeError, match="uint8"):
        fp8_gemm(a.astype(F32), b, sa, sb)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_gemm(a, b, sa, sb, out_dtype="fp64")
    with pytest.raises(TypeError, match="out must be"):
        fp8_gemm(a, b, sa, sb, out=np.zeros((4, 16), F32))  # default out_dtype is bf16
    with pytest.raises(ValueError, match="out must be given"):
        fp8_gemm(a, b, sa, sb, beta=1.0)


# =========================================================================== the cuBLASLt plan's wiring (no GPU)


class _FakeLt:
    """Records what ``_Fp8Plan`` asks of nvmath.bindings.cublasLt; the attribute ids are cuBLASLt's own."""

    MatmulDescAttribute = types.SimpleNamespace(TRANSA=3, TRANSB=4, EPILOGUE=7, BIAS_POINTER=8, EPILOGUE_AUX_POINTER=10,
                                                EPILOGUE_AUX_LD=11, A_SCALE_POINTER=17, B_SCALE_POINTER=18,
                                                D_SCALE_POINTER=20, AMAX_D_POINTER=21, EPILOGUE_AUX_DATA_TYPE=22,
                                                FAST_ACCUM=25, BIAS_DATA_TYPE=26)
    Epilogue = types.SimpleNamespace(DEFAULT=1, BIAS=4, GELU_AUX_BIAS=164, DGELU=192)
    MatmulPreferenceAttribute = types.SimpleNamespace(MAX_WORKSPACE_BYTES=1, MIN_ALIGNMENT_A_BYTES=5,
                                                      MIN_ALIGNMENT_B_BYTES=6, MIN_ALIGNMENT_C_BYTES=7,
                                                      MIN_ALIGNMENT_D_BYTES=8)
    matmul_heuristic_result_dtype = np.dtype([("algo", np.uint64, 8), ("workspace_size", np.uint64),
                                              ("state", np.int32), ("waves", np.float32), ("reserved", np.int32, 4)])

    def __init__(self):
        self.desc, self.layouts, self.calls = {}, [], []

    def matmul_desc_create(self, compute, scale):
        self.calls.append(("desc", compute, scale))
        return 1

    def get_matmul_desc_attribute_dtype(self, attr):
        return np.int8 if attr == 25 else (np.int64 if attr in (8, 10, 11, 17, 18, 20, 21) else np.int32)

    def matmul_desc_set_attribute(self, desc, attr, ptr, size):
        self.desc[attr] = int(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_byte * size).from_address(ptr)).view(
            {1: np.int8, 4: np.int32, 8: np.int64}[size])[0])

    def matrix_layout_create(self, code, rows, cols, ld):
        self.layouts.append((code, rows, cols, ld))
        return 100 + len(self.layouts)

    get_matmul_preference_attribute_dtype = staticmethod(lambda attr: np.uint64)
    matmul_preference_create = staticmethod(lambda: 7)
    matmul_preference_set_attribute = staticmethod(lambda *a: None)
    matmul_preference_destroy = staticmethod(lambda p: None)
    matrix_layout_destroy = staticmethod(lambda lay: None)
    matmul_desc_destroy = staticmethod(lambda d: None)

    def matmul_algo_get_heuristic(self, handle, desc, la, lb, lc, ld, pref, n, algos_ptr, cnt_ptr):
        self.calls.append(("heuristic", la, lb, lc, ld))
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * 1).from_address(cnt_ptr))[0] = 1

    def matmul(self, *args):
        self.calls.append(("matmul",) + args)


@pytest.mark.parametrize("fp8_out", [False, True])
def test_fp8_plan_wiring_without_a_gpu(fp8_out):
    lt = _FakeLt()
    st = types.SimpleNamespace(handle=11, ws_size=1024, ws_ptr=4096, device_id=0)
    M, N, K = 40, 32, 64
    spec = {"m": M, "n": N, "k": K, "fast_accum": True, "fp8_out": fp8_out, "align": (256, 256, 256),
            "a_code": 28, "b_code": 29, "out_code": 28 if fp8_out else 14, "describe": "test", "epilogue": "none",
            "bias_code": None}
    # (b scale, a scale, d scale, amax, bias, aux)
    ptrs = (1000, 2000, 3000 if fp8_out else 0, 4000 if fp8_out else 0, 0, 0)
    plan = gemm_fp8._Fp8Plan(lt, st, spec, ptrs)
    A = lt.MatmulDescAttribute
    assert lt.desc[A.TRANSA] == 1 and lt.desc[A.TRANSB] == 0 and lt.desc[A.FAST_ACCUM] == 1  # TN
    assert lt.desc[A.A_SCALE_POINTER] == 1000 and lt.desc[A.B_SCALE_POINTER] == 2000
    assert (A.D_SCALE_POINTER in lt.desc) == fp8_out and (A.AMAX_D_POINTER in lt.desc) == fp8_out
    # cuBLASLt A = our b [N, K]: K x N column-major, ld K; B = our a: K x M, ld K; C/D N x M, ld N
    want = [(29, K, N, K), (28, K, M, K)] + ([(14, N, M, N), (28, N, M, N)] if fp8_out else [(14, N, M, N)])
    assert lt.layouts == want
    heur = next(c for c in lt.calls if c[0] == "heuristic")
    assert heur[3] == 103 and heur[4] == (104 if fp8_out else 103)  # D's own layout only for FP8 bytes
    assert not {A.EPILOGUE, A.BIAS_POINTER, A.EPILOGUE_AUX_POINTER} & set(lt.desc)
    plan.point_to((1000, 2500, *ptrs[2:]))  # a new a-scale buffer: one attribute rewritten
    assert lt.desc[A.B_SCALE_POINTER] == 2500 and lt.desc[A.A_SCALE_POINTER] == 1000
    plan.launch(st, 1, 5000, 6000, 2, 7000, 7000, 9)
    call = lt.calls[-1]
    assert call[4] == 5000 and call[6] == 6000 and call[9] == call[11] == 7000 and call[-1] == 9


@pytest.mark.parametrize("epilogue,code", [("bias", 4), ("gelu_bias", 164), ("dgelu", 192)])
def test_fp8_plan_epilogue_wiring_without_a_gpu(epilogue, code):
    lt = _FakeLt()
    st = types.SimpleNamespace(handle=11, ws_size=1024, ws_ptr=4096, device_id=0)
    M, N, K = 48, 32, 64
    bias, aux = (5000 if epilogue != "dgelu" else 0), (6000 if epilogue != "bias" else 0)
    spec = {"m": M, "n": N, "k": K, "fast_accum": False, "fp8_out": False, "align": (256, 256, 256), "a_code": 28,
            "b_code": 28, "out_code": 14, "describe": "test", "epilogue": epilogue,
            "bias_code": 14 if bias else None}
    plan = gemm_fp8._Fp8Plan(lt, st, spec, (1000, 2000, 0, 0, bias, aux))
    A = lt.MatmulDescAttribute
    assert lt.desc[A.EPILOGUE] == code
    assert lt.desc.get(A.BIAS_POINTER) == (bias or None) and lt.desc.get(A.BIAS_DATA_TYPE) == (14 if bias else None)
    assert lt.desc.get(A.EPILOGUE_AUX_POINTER) == (aux or None)
    assert lt.desc.get(A.EPILOGUE_AUX_LD) == (N if aux else None)  # aux is [M, N] row-major: N x M, ld N
    plan.point_to((1000, 2000, 0, 0, bias and 5100, aux and 6100))  # the next layer's bias, the next call's aux
    assert lt.desc.get(A.BIAS_POINTER) == (5100 if bias else None)
    assert lt.desc.get(A.EPILOGUE_AUX_POINTER) == (6100 if aux else None)


@pytest.mark.parametrize("epilogue", ["bias", "gelu_bias", "dgelu"])
def test_gemm_emulation_epilogues(rng, epilogue):
    M, N, K = 9, 32, 48
    a, sa, A = _fp8_operand(rng, (M, K), E4M3)
    b, sb, B = _fp8_operand(rng, (N, K), E4M3)
    bias = rng.standard_normal(N).astype(F32) if epilogue != "dgelu" else None
    aux = rng.standard_normal((M, N)).astype(F32) if epilogue == "dgelu" else None
    aux_out = np.full((M, N), np.nan, F32) if epilogue == "gelu_bias" else None
    out = gemm_fp8.fp8_gemm(a, b, sa, sb, out_dtype="fp32", epilogue=epilogue, bias=bias,
                            aux=aux if aux is not None else aux_out)
    r = A @ B.T
    if epilogue == "dgelu":
        want = r * gelu_backward_reference(np.ones_like(aux, np.float64), aux.astype(np.float64))
    else:
        pre = r + bias
        want = pre if epilogue == "bias" else gelu_forward_reference(pre)
        if epilogue == "gelu_bias":
            np.testing.assert_allclose(aux_out, pre, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_gemm_epilogue_bad_arguments(rng):
    a, sa, _ = _fp8_operand(rng, (8, 16), E4M3)
    b, sb, _ = _fp8_operand(rng, (16, 16), E4M3)
    bias, aux = np.zeros(16, F32), np.zeros((8, 16), F32)
    for kwargs, msg in [(dict(epilogue="bias"), "needs bias="), (dict(epilogue="gelu_bias", bias=bias), "needs aux="),
                        (dict(bias=bias), "does not use it"), (dict(epilogue="relu"), "epilogue"),
                        (dict(epilogue="bias", bias=np.zeros(15, F32)), "bias"),
                        (dict(epilogue="dgelu", aux=np.zeros((8, 16), np.float64)), "aux"),
                        (dict(epilogue="bias", bias=bias, beta=1.0, out=np.zeros((8, 16), F32)), "beta == 0"),
                        (dict(epilogue="bias", bias=bias, out_dtype="e4m3", out_scale=np.ones(1, F32)), "FP8 bytes")]:
        kw = {"out_dtype": "fp32", **kwargs}
        with pytest.raises((ValueError, TypeError), match=msg):
            gemm_fp8.fp8_gemm(a, b, sa, sb, **kw)
    out = np.zeros((8, 16), F32)
    with pytest.raises(ValueError, match="aux overlaps out"):
        gemm_fp8.fp8_gemm(a, b, sa, sb, out=out, out_dtype="fp32", epilogue="dgelu", aux=out)
    gemm_fp8.fp8_gemm(a, b, sa, sb, out_dtype="fp32", epilogue="dgelu", aux=aux)  # the good call runs


# =========================================================================== GPU: the kernels


def _dev(cp, a):
    return cp.asarray(a)


def _specials(rng, shape, dtype, fmt):
    """Random values around the format's range with NaN, ±inf, huge, tiny and -0 sprinkled in, as ``dtype``."""
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0], size=shape)).astype(F32)
    flat = x.reshape(-1)
    n = flat.size
    for v in (np.nan, np.inf, -np.inf, 1e30, -1e30, 1e-30, -0.0, fmt.max * 2):
        flat[rng.integers(0, n)] = v
    return x.astype(backend.resolve_dtype(dtype))


# the transposing cast's vector paths (R, C multiples of 4 or 8) and its scalar one, over whole and cut 64 x 64 tiles
CAST_SHAPES = [(1,), (3, 5), (7, 13), (64, 64), (65, 129), (96, 100), (100, 96), (136, 200), (1000, 768), (256, 4100)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", CAST_SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_cast_bitwise(cp, rng, dtype, fmt, shape, transpose):
    x = _specials(rng, shape, dtype, fmt)
    scale = _one(F32(fmt.max) / F32(30.0))
    C = shape[-1]
    R = x.size // C
    ref = quantize_reference(x, scale[0], fmt)
    for poison in (0xAB, 0x54):  # two poisons: an unwritten byte cannot match the reference both times
        y, yt = cp.full(shape, poison, np.uint8), cp.full((C, R), poison, np.uint8)
        amax, sinv = cp.full(1, np.nan, F32), cp.full(1, np.nan, F32)
        t = fp8_cast(_dev(cp, x), _dev(cp, scale), fmt, transpose=transpose, out=y, out_t=yt if transpose else None,
                     amax=amax, scale_inv=sinv)
        np.testing.assert_array_equal(cp.asnumpy(t.data), ref)
        if transpose:
            np.testing.assert_array_equal(cp.asnumpy(t.data_t), ref.reshape(R, C).T)
        assert _f32_bits(cp.asnumpy(amax)[0]) == _f32_bits(fp8.amax_reference(x))
        assert cp.asnumpy(sinv)[0] == F32(1) / scale[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_cast_misaligned_views_and_finite_inputs(cp, rng, dtype, transpose):
    """A view one element in (scalar paths), no special values (amax finite), accumulate_amax, rowwise=False."""
    R, C = 48, 40
    base = cp.asarray(random_array(rng, (R * C + 1,), dtype, scale=4.0))
    x = base[1:].reshape(R, C)
    scale = cp.asarray(_one(3.0))
    amax = cp.asarray(_one(1e6))
    t = fp8_cast(x, scale, "e5m2", rowwise=not transpose, transpose=transpose, amax=amax, accumulate_amax=True)
    ref = quantize_reference(cp.asnumpy(x), 3.0, E5M2)
    got = cp.asnumpy(t.data_t).T if transpose else cp.asnumpy(t.data)
    np.testing.assert_array_equal(got, ref)
    assert cp.asnumpy(amax)[0] == 1e6  # accumulated: the larger old value stays
    assert (t.data is None) == transpose


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 5, 4096, 100003])
def test_gpu_amax_bitwise_and_deterministic(cp, rng, dtype, n):
    x = _specials(rng, (n,), dtype, E4M3) if n > 5 else random_array(rng, (n,), dtype)
    xd = _dev(cp, x)
    got = [cp.asnumpy(fp8_amax(xd))[0] for _ in range(3)]
    assert len({_f32_bits(g) for g in got}) == 1 and _f32_bits(got[0]) == _f32_bits(fp8.amax_reference(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_amax_large_where_every_loop_runs(cp, rng, dtype, offset):
    """Large enough that a resident grid sweeps the tensor several times (an unrolled main loop, a remainder and an
    element tail all run; offset 1: misaligned, the scalar path alone): the maximum placed near the start, near the
    end and in the last elements in turn, then a NaN, is found bit for bit."""
    n = (1 << 24) + 13
    host = random_array(rng, (n + offset,), dtype, scale=0.5)
    base = cp.asarray(host)
    x = base[offset:]
    where = {"first sweeps": rng.integers(0, n // 4), "last packs": n - 300 - rng.integers(0, 4000), "tail": n - 3}
    for part, i in where.items():
        x[int(i)] = 1e4 if dtype == "fp32" else 9984.0  # exactly representable in bf16
        got = cp.asnumpy(fp8_amax(x))[0]
        assert _f32_bits(got) == _f32_bits(fp8.amax_reference(cp.asnumpy(x))), part
        assert got == (1e4 if dtype == "fp32" else 9984.0), part
        x[int(i)] = 0
    x[int(rng.integers(0, n))] = float("nan")
    assert _f32_bits(cp.asnumpy(fp8_amax(x))[0]) == 0x7FC00000
@pytest.mark.gpu
@pytest.mark.parametrize("length,margin,pow2", [(1, 0, False), (4, 1, True), (1000, 0, False)])
def test_gpu_amax_history_matches_reference(cp, rng, length, margin, pow2):
    ref, dev = AmaxHistory("e4m3", length, margin=margin, pow2=pow2, xp=np), AmaxHistory(
        "e4m3", length, margin=margin, pow2=pow2, xp=cp)
    amaxes = list(np.abs(rng.standard_normal(7) * 10).astype(F32)) + [0.0, np.inf, np.nan, 1e-44, 3.0]
    for a in amaxes * 2:
        ref.amax[0] = a
        dev.amax[...] = cp.asarray(_one(a))
        ref.update()
        dev.update()
        for name in ("scale", "scale_inv", "history", "pos"):
            np.testing.assert_array_equal(cp.asnumpy(getattr(dev, name)), getattr(ref, name), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("n,length,margin,pow2", [(1, 1, 0, False), (7, 4, 1, True), (216, 16, 0, False),
                                                  (5, 1000, 2, True), (40, 300, 0, True)])
def test_gpu_amax_histories_match_per_state_kernel(cp, rng, n, length, margin, pow2):
    """fp8_update_scales_kernel (one launch for the group) gives bit for bit what fp8_update_scale_kernel launched per
    state and a memset give, and what the NumPy group gives: E4M3 and E5M2 states mixed, rings longer than a block,
    0, inf, NaN and subnormal amaxes, rings that wrap."""
    start = _random_states(rng, n, length)
    grouped, single, ref = (_make_states(xp, start, length, margin, pow2) for xp in (cp, cp, np))
    group, ref_group = fp8.AmaxHistories(grouped), fp8.AmaxHistories(ref)
    _assert_states_bitwise(grouped, ref)
    assert all(st.scale_inv.data.ptr % 16 == 0 and st.scale.data.ptr % 16 == 0 for st in grouped)  # cuBLASLt's rule
    for _ in range(6):
        amaxes = _random_amaxes(rng, n)
        group.amax[:, 0] = cp.asarray(amaxes)  # where the casts write: the states' views
        _set_amaxes(single, amaxes)
        _set_amaxes(ref, amaxes)
        group.update_and_clear()
        for st in single:
            st.update()
            st.amax.fill(0)
        ref_group.update_and_clear()
        _assert_states_bitwise(grouped, single)
        _assert_states_bitwise(grouped, ref)
    assert not cp.asnumpy(group.amax).any()


@pytest.mark.gpu
def test_gpu_grouping_is_refused_while_capturing(cp):
    """Grouping re-points the states' arrays, which kernels already captured would not follow: refused during a
    capture, with the states left as they were."""
    states = [AmaxHistory(fmt, 4, xp=cp) for fmt in ("e4m3", "e5m2")]
    states[0].update()  # the kernel compiled and loaded outside the capture
    arrays = [st.scale for st in states]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            states[0].update()  # something to capture
            with pytest.raises(RuntimeError, match="captures a CUDA graph"):
                fp8.AmaxHistories(states)
        finally:
            s.end_capture()
    assert all(st.group is None and st.scale is a for st, a in zip(states, arrays))
    assert fp8.AmaxHistories(states).states == tuple(states)  # eagerly it groups them


def _one_rounding_apart(got, v, tol, scale, fmt):
    """Whether each byte ``got`` rounds a value within ``tol`` of ``v`` (the fp32 values the kernel computes are a
    few ulp from the float64 reference's): between the bytes of v - tol and v + tol; NaN exactly where v is NaN."""
    nan = np.isnan(v)
    if not np.array_equal(got[nan], np.full(nan.sum(), fp8.NAN_BITS, np.uint8)):
        return False
    tol = np.where(np.isfinite(v), tol, 0).astype(F32)
    vals = fmt.values()
    lo, hi = vals[quantize_reference(v - tol, scale, fmt)], vals[quantize_reference(v + tol, scale, fmt)]
    g = vals[got]
    return bool(((lo <= g) & (g <= hi))[~nan].all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("act", ["gelu", "dgelu"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (64, 64), (65, 129), (136, 200), (1000, 768)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_gelu_in_the_cast(cp, rng, dtype, act, shape, transpose, with_bias):
    """act= casts on odd shapes (vector and scalar paths, cut tiles) with NaN/±inf/huge inputs: every byte one
    rounding of the float64 reference's value (and equal to it for nearly all), the transpose the same bytes, amax
    NaN exactly when the reference's is and otherwise within the fp32 error, poisoned outputs all written."""
    fmt = E4M3 if act == "gelu" else E5M2
    x = _specials(rng, shape, dtype, fmt)
    pre = random_array(rng, shape, dtype, scale=3.0) if act == "dgelu" else None
    b = random_array(rng, (shape[-1],), dtype, scale=0.5) if with_bias else None
    if pre is not None and pre.size > 3:
        pre.reshape(-1)[rng.integers(0, pre.size)] = np.nan
    v = fp8.act_reference(x, act, pre, b)
    xa = np.abs(x.astype(np.float64))
    tol = 3e-5 * np.abs(v.astype(np.float64)) + 1e-6 * xa * (1 + (0 if pre is None else np.abs(pre.astype(float))))
    if b is not None:
        tol = tol + 1e-6 * np.abs(b.astype(np.float64))
    scale = _one(F32(fmt.max) / F32(30.0))
    R, C = v.size // shape[-1], shape[-1]
    ref = quantize_reference(v, scale[0], fmt)
    dev = lambda a: None if a is None else _dev(cp, a)  # noqa: E731
    for poison in (0xAB, 0x54):
        y, yt = cp.full(shape, poison, np.uint8), cp.full((C, R), poison, np.uint8)
        amax = cp.full(1, np.nan, F32)
        t = fp8_cast(_dev(cp, x), _dev(cp, scale), fmt, transpose=transpose, out=y, out_t=yt if transpose else None,
                     amax=amax, act=act, pre=dev(pre), bias=dev(b))
        got = cp.asnumpy(t.data)
        assert _one_rounding_apart(got, v, tol, scale[0], fmt)
        with np.errstate(invalid="ignore"):  # by value: -0 and +0 (where the references round GELU' to 0) agree
            differ = ~((fmt.values()[got] == fmt.values()[ref]) | (got == ref))
        assert differ.mean() < 0.01
        if transpose:
            np.testing.assert_array_equal(cp.asnumpy(t.data_t), got.reshape(R, C).T)
        a, a_ref = cp.asnumpy(amax)[0], fp8.amax_reference(v)
        assert np.isnan(a) == np.isnan(a_ref) and (np.isnan(a) or np.isclose(a, a_ref, rtol=3e-5, atol=0))
        a2 = fp8_amax(_dev(cp, x), act=act, pre=dev(pre), bias=dev(b))
        assert _f32_bits(cp.asnumpy(a2)[0]) == _f32_bits(a)  # the amax pass finds the cast's amax, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "dgelu"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (200, 136), (1000, 768), (4100, 96)])
def test_gpu_cast_column_sums(cp, rng, act, shape):
    """The bias gradient from the cast (of dy itself, or of dy · GELU'(pre + b)): added into what column_sums
    holds, within the fp32 error of the float64 column sums, the same bits on a second run (fixed-order sums),
    rowwise-only casts too, and the bytes those of the cast without sums."""
    x, pre, b = _act_inputs(rng, shape, "bf16")
    pre, b = (pre, b) if act else (None, None)
    v = fp8.act_reference(x, act, pre, b).astype(np.float64)
    want = 0.25 + v.sum(axis=0)
    bound = 1e-5 * np.abs(v).sum(axis=0) + 1e-6
    runs = []
    for transpose in (True, False, True):
        sums = cp.full(shape[-1], 0.25, F32)
        dev = lambda a: None if a is None else _dev(cp, a)  # noqa: E731
        kw = dict(transpose=transpose, act=act, pre=dev(pre), bias=dev(b))
        t = fp8_cast(_dev(cp, x), cp.asarray(_one(10.0)), "e5m2", column_sums=sums, **kw)
        runs.append(cp.asnumpy(sums))
        assert (np.abs(runs[-1] - want) <= bound).all()
        plain = fp8_cast(_dev(cp, x), cp.asarray(_one(10.0)), "e5m2", **kw)
        np.testing.assert_array_equal(cp.asnumpy(t.data), cp.asnumpy(plain.data))
    assert np.array_equal(runs[0], runs[2]) and np.array_equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("act,sums", [(None, False), (None, True), ("gelu", False), ("dgelu", True)])
@pytest.mark.parametrize("shape", [(8, 8), (264, 200), (1024, 1280)])
def test_gpu_cast_register_and_shared_tile_transposes_agree(cp, rng, act, sums, shape):
    """The two transposing kernels on the same values: 16-byte-aligned bf16 in whole 8 x 8 blocks takes the register
    transpose, the same data 4 elements (8 bytes) off that alignment the shared 64 x 64 tile. Bytes, transposed
    bytes and amax bit for bit; the column sums (each kernel's own fixed order) within fp32 rounding."""
    R, C = shape
    x, pre, b = _act_inputs(rng, shape, "bf16")
    x.reshape(-1)[rng.integers(0, x.size, 3)] = [np.nan, np.inf, 3e4]
    pre, b = pre if act == "dgelu" else None, b if act else None
    fmt = E4M3 if act == "gelu" else E5M2
    outs = []
    for off in (0, 4):
        dev = lambda a: None if a is None else cp.concatenate(  # noqa: E731
            [cp.zeros(off, a.dtype), cp.asarray(a).reshape(-1)])[off:].reshape(a.shape)
        xd = dev(x)
        assert (xd.data.ptr % 16 == 0) == (off == 0)
        amax, col = cp.full(1, np.nan, F32), cp.zeros(C, F32) if sums else None
        t = fp8_cast(xd, cp.asarray(_one(fmt.max / 64.0)), fmt, transpose=True, amax=amax, act=act, pre=dev(pre),
                     bias=dev(b), column_sums=col)
        outs.append([cp.asnumpy(a) for a in (t.data, t.data_t, amax, col if sums else amax)])
    (y0, t0, a0, c0), (y1, t1, a1, c1) = outs
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(t0, t1)
    np.testing.assert_array_equal(t0, y0.T)
    assert _f32_bits(a0[0]) == _f32_bits(a1[0])
    np.testing.assert_allclose(c0, c1, rtol=1e-5, atol=1e-4)


# =========================================================================== GPU: the GEMM


@pytest.fixture
def lt(cp):
    from llmgpu.gemm import cublaslt

    reason = cublaslt.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuBLASLt path not available: {reason}")
    cc = int(cp.cuda.Device().compute_capability)  # '90' on Hopper, '100' on Blackwell
    if cc < 89:
        pytest.skip(f"FP8 GEMMs need compute capability 8.9 or later (Ada, Hopper); this GPU is sm_{cc}")
    return cublaslt


GEMM_SHAPES = [(1, 16, 16), (7, 64, 32), (48, 128, 64), (33, 768, 2304), (1000, 768, 3072), (512, 3072, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gpu_gemm_within_bound(cp, lt, rng, shape, fmts, out_dtype, fast_accum):
    M, K, N = shape
    a, sa, A = _fp8_operand(rng, (M, K), fp8.fp8_format(fmts[0]))
    b, sb, B = _fp8_operand(rng, (N, K), fp8.fp8_format(fmts[1]), spread=0.02)
    assert sa[0] != sb[0]  # a swapped pair of scale pointers would show
    out = cp.full((M, N), np.nan, dtype=backend.resolve_dtype(out_dtype))
    fp8_gemm(*(_dev(cp, v) for v in (a, b, sa, sb)), a_format=fmts[0], b_format=fmts[1], out=out,
             out_dtype=out_dtype, fast_accum=fast_accum)
    got = cp.asnumpy(out).astype(np.float64)
    R, tol = _bound(A, B, U_OUT[out_dtype], K)
    bad = np.abs(got - R) > tol
    assert not bad.any(), f"{bad.sum()} elements beyond the bound, worst {np.max(np.abs(got - R) / tol):.2f} x"
    # typical error grows like sqrt(K): normwise well inside u_out + sqrt(K)·2^-13
    assert rel_error(got, R) < U_OUT[out_dtype] + np.sqrt(K) * 2.0**-13


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", [E4M3, E5M2])
def test_gpu_gemm_fp8_output_and_amax(cp, lt, rng, out_fmt):
    M, K, N = 64, 256, 128
    a, sa, A = _fp8_operand(rng, (M, K), E4M3)
    b, sb, B = _fp8_operand(rng, (N, K), E5M2 if out_fmt is E5M2 else E4M3)
    R, tol = _bound(A, B, out_fmt.unit_roundoff, K)
    ramax = np.abs(R).max()
    out_scale = _one(F32(out_fmt.max) / F32(ramax * 1.25))  # ≠ 1: tells a pre-scale amax from a post-scale one
    amax, q = cp.full(1, np.nan, F32), cp.full((M, N), 0xAB, np.uint8)
    fp8_gemm(*(_dev(cp, v) for v in (a, b, sa, sb)), b_format="e5m2" if out_fmt is E5M2 else "e4m3", out=q,
             out_dtype=out_fmt.name, out_scale=_dev(cp, out_scale), amax_out=amax)
    got = out_fmt.values()[cp.asnumpy(q)].astype(np.float64) / out_scale[0]
    assert np.all(np.abs(got - R) <= tol + out_fmt.smallest_subnormal / out_scale[0])
    a_tol = K * 2.0**-13 * (np.abs(A) @ np.abs(B).T).max()
    assert abs(cp.asnumpy(amax)[0] - ramax) <= a_tol  # amax of the result before out_scale


@pytest.mark.gpu
def test_gpu_gemm_accumulates_into_fp32_and_refuses_bad_sizes(cp, lt, rng):
    M, K, N = 32, 64, 48
    a, sa, A = _fp8_operand(rng, (M, K), E5M2)
    b, sb, B = _fp8_operand(rng, (N, K), E4M3)
    acc = random_array(rng, (M, N))
    out = cp.asarray(acc)
    args = [_dev(cp, v) for v in (a, b, sa, sb)]
    fp8_gemm(*args, a_format="e5m2", out=out, out_dtype="fp32", beta=1.0)
    R, tol = _bound(A, B, U_OUT["fp32"], K)
    assert np.all(np.abs(cp.asnumpy(out) - (R + acc)) <= tol + 2.0**-23 * np.abs(R + acc))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_gemm(args[0][:, :24].copy(), args[1][:, :24].copy(), *args[2:], a_format="e5m2")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_gemm(args[0], args[1][:40], *args[2:], a_format="e5m2")
    with pytest.raises(ValueError, match="16-byte boundary"):
        fp8_gemm(cp.asarray(np.zeros(M * K + 1, np.uint8))[1:].reshape(M, K), args[1], *args[2:], a_format="e5m2")


def _fp8_step(d):
    """What a training step does per linear layer: current-scaled casts of x and W (with transposes), the forward
    GEMM, and a delayed-scaled cast of dy recording its amax; then the history update."""
    qx = quantize(d["x"], d["hx"], transpose=True, out=d["qx"], out_t=d["qxt"], scale_inv=d["sx"])
    qw = quantize(d["w"], d["hw"], out=d["qw"], scale_inv=d["sw"])
    fp8_gemm(qx.data, qw.data, qx.scale_inv, qw.scale_inv, out=d["y"])
    quantize(d["dy"], d["hg"], recipe="delayed", transpose=True, out=d["qg"], out_t=d["qgt"], scale_inv=d["sg"])
    fp8_gemm(d["qgt"], d["qxt"], d["sg"], d["sx"], a_format="e5m2", out=d["dw"], out_dtype="fp32")
    d["hg"].update()


@pytest.mark.gpu
def test_gpu_capture_replay_bit_identical(cp, lt, rng):
    T, Cin, Cout = 256, 64, 128
    d = {"x": cp.asarray(random_array(rng, (T, Cin), "bf16")), "w": cp.asarray(random_array(rng, (Cout, Cin), "bf16")),
         "dy": cp.asarray(random_array(rng, (T, Cout), "bf16")),
         "hx": AmaxHistory("e4m3", xp=cp), "hw": AmaxHistory("e4m3", xp=cp), "hg": AmaxHistory("e5m2", 16, xp=cp),
         "qx": cp.empty((T, Cin), np.uint8), "qxt": cp.empty((Cin, T), np.uint8), "qw": cp.empty((Cout, Cin), np.uint8),
         "qg": cp.empty((T, Cout), np.uint8), "qgt": cp.empty((Cout, T), np.uint8),
         "y": cp.empty((T, Cout), backend.bfloat16), "dw": cp.empty((Cout, Cin), F32)}
    for n in ("sx", "sw", "sg"):
        d[n] = cp.empty(1, F32)
    outs = ("qx", "qxt", "qw", "qg", "qgt", "y", "dw", "sx", "sw", "sg")

    def state():
        got = {n: cp.asnumpy(d[n]).copy() for n in outs}
        got.update({f"hg.{n}": cp.asnumpy(getattr(d["hg"], n)).copy() for n in ("scale", "history", "pos")})
        return got

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _fp8_step(d)  # warm-up outside capture: kernels compiled, plans built, workspace allocated
        s.synchronize()
        before = state()
        _fp8_step(d)
        s.synchronize()
        eager = state()
        assert before["hg.scale"][0] != 1 and eager["hg.pos"][0] == 2  # the delayed scale moved off its start
        s.begin_capture()
        try:
            _fp8_step(d)
        finally:
            g = s.end_capture()
        s.synchronize()
        assert cp.asnumpy(d["hg"].pos)[0] == 2, "capture must record, not run"
        g.launch(s)
        s.synchronize()
        replay = state()
        assert replay["hg.pos"][0] == 3  # the ring position lives on the device: replays keep rotating it
        for n in ("qx", "qxt", "qw", "sx", "sw", "y"):  # same inputs, current scaling: same bytes and scales
            _assert_same(replay[n], eager[n], n)
        # new inputs written in place: the replay follows them, as an eager step on the same state does
        d["x"][...] = cp.asarray(random_array(rng, (T, Cin), "bf16", scale=3.0))
        snapshot = {n: getattr(d["hg"], n).copy() for n in ("scale", "scale_inv", "amax", "history", "pos")}
        _fp8_step(d)
        s.synchronize()
        eager = state()
        for n, v in snapshot.items():
            getattr(d["hg"], n)[...] = v
        for n in outs:
            d[n].fill(0)
        g.launch(s)
        s.synchronize()
        replay = state()
    for n in eager:
        _assert_same(replay[n], eager[n], n)


def _assert_same(got, want, name):
    """Bit for bit; a GEMM output may instead differ in the last bits (a split-K reduction's order)."""
    if name in ("y", "dw") and not np.array_equal(got, want):
        assert rel_error(got.astype(np.float64), want.astype(np.float64)) < 1e-5, name
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)
