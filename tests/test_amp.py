"""Mixed precision: casts (rounding, overflow), inf/nan flag, the loss scaler, policies (chapter 5)."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.amp import LossScaler, Policy, cast, fp16_fate, has_inf_or_nan, log2_histogram

pytestmark = pytest.mark.ch5

BF16, F16, F32 = backend.bfloat16, backend.float16, backend.float32
DTYPES = [F32, BF16, F16]


def _bits(a):
    a = backend.to_numpy(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _specials():
    ulp = 2.0**-7  # bf16 spacing at 1
    return np.array([
        0.0, -0.0, 1.0, 1 + ulp / 2, 1 + 1.5 * ulp, 1 + ulp / 2 + 2**-20,  # ties to even, just above a tie
        65504.0, 65519.0, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan,  # fp16 max, overflow
        1e-8, 6e-8, 2.0**-24, 2.0**-133, 1e-40, 3.3e38,  # fp16 / bf16 subnormals, fp32 subnormal, near max
    ], dtype=np.float32)


def test_cast_numpy_rounding():
    x = _specials()
    b = cast(x, "bf16")
    assert b.dtype == BF16
    assert float(b[3]) == 1.0 and float(b[4]) == 1 + 2 * 2.0**-7 and float(b[5]) == 1 + 2.0**-7
    h = cast(x, "fp16")
    assert float(h[6]) == 65504.0 and float(h[7]) == 65504.0 and np.isinf(h[8]) and np.isinf(h[9])
    assert float(h[10]) == -np.inf and np.isnan(h[13]) and float(h[14]) == 0.0 and float(h[16]) == 2.0**-24
    assert np.isinf(float(cast(np.array([3.4e38], np.float32), "bf16")[0]))  # rounds past bf16 max (3.39e38)
    out = np.full(x.shape, np.nan, F16)
    assert cast(b, "fp16", out=out) is out
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_bits(out), _bits(b.astype(np.float32).astype(F16)))


def test_cast_bad_inputs():
    with pytest.raises(TypeError, match="dtype"):
        cast(np.ones(3, np.float32), "fp64")
    with pytest.raises(TypeError, match="x"):
        cast(np.ones(3, np.int32), "bf16")
    with pytest.raises(ValueError, match="x"):
        cast(np.ones(6, np.float32)[::2], "bf16")
    with pytest.raises(ValueError, match="out"):
        cast(np.ones(6, np.float32), "bf16", out=np.empty(5, BF16))
    with pytest.raises(TypeError, match="out"):
        cast(np.ones(6, np.float32), "bf16", out=np.empty(6, F16))


def test_has_inf_or_nan_numpy(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    assert float(has_inf_or_nan(x)) == 0.0
    x[2, 4] = np.nan
    assert float(has_inf_or_nan(x)) == 1.0
    assert float(has_inf_or_nan(cast(np.array([7e4], np.float32), "fp16"))) == 1.0  # fp16 overflow


def _trace(scaler, flags):
    out = []
    for f in flags:
        scaler.update(scaler.xp.asarray(np.float32(f)))
        out.append(scaler.scale_value())
    return out


def test_dynamic_scaler_numpy():
    s = LossScaler("dynamic", init_scale=1024.0, growth_interval=3, xp=np)
    assert float(s.loss_scale_for_backward()) == 1024.0 and float(s.unscale_factor()) == 1 / 1024
    flags = [0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0]
    assert _trace(s, flags) == [1024, 1024, 2048, 2048, 1024, 1024, 1024, 512, 256, 256, 256, 512]
    assert float(s.unscale_factor()) == 1 / 512
    st = s.state_dict()
    t = LossScaler("dynamic", xp=np)
    t.load_state_dict(st)
    assert t.scale_value() == 512 and int(t.good_steps) == 0 and t.growth_interval == 3
    with pytest.raises(ValueError, match="static"):
        LossScaler("static", xp=np).load_state_dict(st)


def test_scaler_growth_stays_finite():
    s = LossScaler("dynamic", init_scale=2.0**127, growth_interval=1, xp=np)
    assert _trace(s, [0, 0]) == [2.0**127, 2.0**127]


def test_static_and_none_scalers(rng):
    for kind, scale in (("static", 1024.0), ("none", 1.0)):
        s = LossScaler(kind, xp=np)
        assert _trace(s, [1, 0, 1]) == [scale] * 3
    g = rng.standard_normal(100).astype(np.float32) * 1024
    res = LossScaler("static", xp=np).check_and_clip(g, max_norm=1.0)
    np.testing.assert_allclose(float(res.norm), np.linalg.norm(g.astype(np.float64)) / 1024, rtol=1e-6)
    g[3] = np.inf
    assert float(LossScaler("none", xp=np).check(g)) == 1.0
    with pytest.raises(ValueError, match="kind"):
        LossScaler("auto")
    with pytest.raises(ValueError, match="none"):
        LossScaler("none", init_scale=8.0)
    with pytest.raises(ValueError, match="growth"):
        LossScaler(growth_factor=0.5)


def test_fp16_underflow_and_scaling_recovers(rng):
    # the reason for loss scaling in one assert: gradients ~1e-8 flush to zero in fp16 unless scaled
    g = (rng.standard_normal(10000) * 1e-8).astype(np.float32)
    lost = np.mean(cast(g, "fp16").astype(np.float32) == 0)
    kept = np.mean(cast(g * 2.0**16, "fp16").astype(np.float32) == 0)
    assert lost > 0.5 and kept < 0.01


def test_fp16_fate_counts_what_the_cast_does():
    x = np.array([0.0, 1e-10, -2.0**-26, 2.0**-24, 3e-6, -1e-4, 1.0, 7e4, -1e5], np.float32)
    f = fp16_fate(x)  # zero is not counted; 1e-10 and 2^-26 round to 0; 2^-24 and 3e-6 are subnormal
    assert f["n"] == 8 and f["zero"] == 2 / 8 and f["subnormal"] == 2 / 8 and f["overflow"] == 2 / 8
    assert f["normal"] == 2 / 8
    g = fp16_fate(x, scale=2.0**16)  # x 2^16: 1e-10 is subnormal, 2^-26 .. 1e-4 normal, 1.0 overflows too
    assert g["zero"] == 0 and g["subnormal"] == 1 / 8 and g["normal"] == 4 / 8 and g["overflow"] == 3 / 8
    assert fp16_fate(np.zeros(4, np.float32))["n"] == 0
    assert fp16_fate(x.astype(backend.bfloat16))["n"] == 8  # any float dtype the cast takes


def test_log2_histogram():
    x = np.array([0.0, 0.5, -0.75, 1.0, 3.0, 2.0**-30], np.float32)
    counts = log2_histogram(x, [-1.0, 0.0, 1.0, 2.0])  # log2: -1, -0.415, 0, 1.585 (-30: outside)
    assert counts.tolist() == [2, 1, 1] and counts.dtype == np.int64


def test_policy():
    assert Policy().compute == "bf16" and not Policy().needs_scaler
    p = Policy("float16")
    assert p.compute == "fp16" and p.needs_scaler and p.compute_dtype == F16 and p.master_dtype == F32
    assert p.make_scaler(xp=np).kind == "dynamic" and Policy("fp32").make_scaler(xp=np).kind == "none"
    with pytest.raises(ValueError, match="compute"):
        Policy("fp64")


@pytest.mark.gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 33, 1000, 50257])
def test_cast_gpu(cp, rng, src, dst, n):
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)
    sp = _specials()
    x[: min(n, sp.size)] = sp[: min(n, sp.size)]
    xs = cast(x, src)  # NumPy reference, src dtype
    ref = cast(xs, dst)
    out = cp.full(n, cp.nan, dtype=dst)  # poisoned
    got = cast(cp.asarray(xs), dst, out=out)
    assert got is out
    nan = np.isnan(ref.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(backend.to_numpy(got).astype(np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(ref)[~nan])
    if n > 1:  # unaligned views: scalar path
        got = cast(cp.asarray(xs)[1:], dst)
        np.testing.assert_array_equal(_bits(got)[~nan[1:]], _bits(ref[1:])[~nan[1:]])


@pytest.mark.gpu
def test_has_inf_or_nan_gpu(cp, rng):
    x = cp.asarray(rng.standard_normal((33, 7)).astype(BF16))
    assert float(has_inf_or_nan(x)) == 0.0
    x[32, 6] = float("inf")
    assert float(has_inf_or_nan(x)) == 1.0


@pytest.mark.gpu
def test_dynamic_scaler_gpu_matches_numpy(cp):
    flags = [0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0]
    ref = _trace(LossScaler("dynamic", init_scale=1024.0, growth_interval=3, xp=np), flags)
    s = LossScaler("dynamic", init_scale=1024.0, growth_interval=3, xp=cp)
    assert _trace(s, flags) == ref
    assert float(s.unscale_factor()) == 1 / ref[-1]
    t = LossScaler("dynamic", xp=cp)
    t.load_state_dict(s.state_dict())
    assert t.scale_value() == ref[-1] and float(t.inv_scale) == 1 / ref[-1]


@pytest.mark.gpu
def test_mixed_arrays_gpu(cp):
    with pytest.raises(TypeError, match="out"):
        cast(cp.ones(4, cp.float32), "bf16", out=np.empty(4, BF16))
    s = LossScaler(xp=cp)
    with pytest.raises(TypeError):
        s.update(np.array(0.0, np.float32))


@pytest.mark.gpu
def test_fp16_census_gpu_matches_numpy(cp, rng):
    x = (rng.standard_normal(100_003) * 10.0 ** rng.integers(-12, 6, 100_003)).astype(np.float32)
    for scale in (1.0, 2.0**16):
        assert fp16_fate(cp.asarray(x), scale) == fp16_fate(x, scale)
    edges = np.arange(-45.0, 20.0, 0.5)
    # log2 may differ in the last bit between the two libraries: a value next to an edge can change bins
    assert np.abs(log2_histogram(cp.asarray(x), edges) - log2_histogram(x, edges)).sum() <= 4
