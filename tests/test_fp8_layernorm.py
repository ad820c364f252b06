"""The residual add + LayerNorm writing FP8 (``ops.fp8_layernorm``, ``kernels/fp8.cu``: fp8_add_layernorm_kernel and
fp8_transpose_kernel; issue 37, chapter 5b).

CPU: the NumPy path against first principles (the float64 LayerNorm of the rounded sum, within E4M3's rounding),
against the unfused pair it replaces (in fp32 the same bytes), NaN rows, in-place residual, amax accumulation and the
argument checks. GPU (skipped with the reason without one): the kernel's bytes against the NumPy reference on odd
shapes (one code apart at most, where the fp32 sums' order moves a value across a rounding boundary), s, mean and
rstd bit for bit those of ``add_layernorm_forward``, poisoned outputs, the unfused fallback, and the byte transpose.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu.ops.fp8 import E4M3, NAN_BITS, amax_reference, dequantize, fp8_cast, quantize_reference
from llmgpu.ops.fp8_layernorm import fp8_add_layernorm, fp8_transpose
from llmgpu.ops.layernorm import add_layernorm_forward, vector_plan
from llmgpu.testing import random_array

pytestmark = pytest.mark.ch5
F32 = np.float32


def _one(v, xp=np):
    return xp.asarray(np.array([v], dtype=F32))


def _inputs(rng, n, c, dtype, xp=np):
    a, b = (random_array(rng, (n, c), dtype, xp, scale=s) for s in (1.0, 0.5))
    gamma = random_array(rng, (c,), dtype, xp, scale=0.3) + 1
    beta = random_array(rng, (c,), dtype, xp, scale=0.1)
    return a, b, gamma, beta


def _ln64(s, gamma, beta, eps=1e-5):
    """LayerNorm in float64, independent of the package's reference."""
    s = np.asarray(s, dtype=np.float64)
    m = s.mean(axis=-1, keepdims=True)
    v = ((s - m) ** 2).mean(axis=-1, keepdims=True)
    return (s - m) / np.sqrt(v + eps) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 8), (3, 4, 24), (17, 100)])
def test_bytes_are_the_layernorm_of_the_rounded_sum(rng, dtype, shape):
    """Dequantized, the bytes are the float64 LayerNorm of s = a + b (rounded) within E4M3's half-ulp; s, mean, rstd
    are add_layernorm_forward's; amax is max |LN(s)| (fp32); scale_inv is 1/scale; data_t is data's transpose."""
    n, c = int(np.prod(shape[:-1])), shape[-1]
    a, b, gamma, beta = _inputs(rng, n, c, dtype)
    a, b = a.reshape(shape), b.reshape(shape)
    scale, amax = _one(64.0), _one(np.nan)
    s, t, mean, rstd = fp8_add_layernorm(a, b, gamma, beta, scale, transpose=True, amax=amax)
    s_ref, _, mean_ref, rstd_ref = add_layernorm_forward(a, b, gamma, beta)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(mean, mean_ref)
    np.testing.assert_array_equal(rstd, rstd_ref)
    y64 = _ln64(s, gamma, beta)
    got = dequantize(t.data, t.scale_inv, E4M3).astype(np.float64)
    assert t.data.shape == shape and t.data.dtype == np.uint8 and t.fmt is E4M3
    normal = np.abs(y64) * 64 >= E4M3.smallest_normal
    assert np.all(np.abs(got - y64)[normal] <= np.abs(y64)[normal] * 2.0 ** -4 * 1.001)
    assert np.all(np.abs(got - y64)[~normal] <= E4M3.smallest_subnormal / 64 * 0.501 + 1e-6)
    assert abs(float(amax[0]) - np.abs(y64).max()) <= 1e-5 * np.abs(y64).max()
    np.testing.assert_array_equal(t.data_t, t.data.reshape(n, c).T)
    assert t.scale_inv[0] == F32(1) / F32(64)


def test_fp32_bytes_equal_the_unfused_pair(rng):
    """In fp32 the LayerNorm's value is the same with or without the rounding to the storage type, so the bytes are
    those of add_layernorm_forward followed by fp8_cast (the step it replaces), amax too."""
    a, b, gamma, beta = _inputs(rng, 40, 48, "fp32")
    scale = _one(20.0)
    a1, a2 = _one(0.0), _one(0.0)
    _, y, _, _ = add_layernorm_forward(a, b, gamma, beta)
    ref = fp8_cast(y, scale, "e4m3", transpose=True, amax=a1)
    _, t, _, _ = fp8_add_layernorm(a, b, gamma, beta, scale, transpose=True, amax=a2)
    np.testing.assert_array_equal(t.data, ref.data)
    np.testing.assert_array_equal(t.data_t, ref.data_t)
    assert a1[0] == a2[0]


def test_in_place_residual_accumulated_amax_and_saturation(rng):
    a, b, gamma, beta = _inputs(rng, 6, 16, "fp32")
    b_before = b.copy()
    amax = _one(1e6)
    s, t, _, _ = fp8_add_layernorm(a, b, gamma, beta, _one(1e4), residual_out=b, amax=amax, accumulate_amax=True)
    assert s is b and np.array_equal(b, a + b_before)
    assert amax[0] == 1e6  # accumulated: the larger old value stays
    vals = dequantize(t.data, _one(1.0), E4M3)
    assert np.abs(vals).max() == E4M3.max  # scale 1e4 saturates: clipped to ±448, never inf or NaN
    assert t.data_t is None
    with pytest.raises(ValueError, match="accumulate_amax=True needs amax="):
        fp8_add_layernorm(a, b, gamma, beta, _one(1.0), accumulate_amax=True)


def test_nan_row_gives_nan_bytes_and_amax(rng):
    a, b, gamma, beta = _inputs(rng, 4, 8, "fp32")
    a[2, 3] = np.nan
    amax = _one(0.0)
    _, t, _, _ = fp8_add_layernorm(a, b, gamma, beta, _one(1.0), amax=amax)
    assert np.all(t.data[2] == NAN_BITS) and not np.any(t.data[[0, 1, 3]] == NAN_BITS)
    assert np.isnan(amax[0])


def test_bad_inputs(rng):
    a, b, gamma, beta = _inputs(rng, 4, 8, "fp32")
    sc = _one(1.0)
    with pytest.raises(TypeError, match="a"):
        fp8_add_layernorm(a.astype(np.float16), b.astype(np.float16), gamma.astype(np.float16),
                          beta.astype(np.float16), sc)
    with pytest.raises(ValueError, match="b"):
        fp8_add_layernorm(a, b[:3], gamma, beta, sc)
    with pytest.raises(ValueError, match="gamma"):
        fp8_add_layernorm(a, b, gamma[:4], beta, sc)
    with pytest.raises(ValueError, match="scale"):
        fp8_add_layernorm(a, b, gamma, beta, np.ones(2, F32))
    with pytest.raises(ValueError, match="at least 2-D"):
        fp8_add_layernorm(a[0], b[0], gamma, beta, sc)
    with pytest.raises(ValueError, match="residual_out"):
        fp8_add_layernorm(a, b, gamma, beta, sc, residual_out=a[:, :4])
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        fp8_add_layernorm(a, b, gamma, beta, sc, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a real number"):
        fp8_add_layernorm(a, b, gamma, beta, sc, eps="1e-5")
    with pytest.raises(ValueError, match="overlaps"):
        fp8_add_layernorm(a, b, gamma, beta, sc, amax=sc)
    with pytest.raises(TypeError, match="bits"):
        fp8_transpose(a)
    with pytest.raises(ValueError, match="2-D"):
        fp8_transpose(np.zeros(5, np.uint8))


def test_transpose_numpy():
    bits = np.arange(35, dtype=np.uint8).reshape(5, 7)
    np.testing.assert_array_equal(fp8_transpose(bits), bits.T)


# =========================================================================== GPU


def _dev(cp, *arrays):
    return tuple(cp.asarray(x) for x in arrays)


def _close_bytes(got, ref):
    """Bytes equal but where the fp32 sums' order moved a value across a rounding boundary: then one code apart
    (same sign), in at most 1 of 2000 elements."""
    diff = got != ref
    assert diff.mean() <= 5e-4, f"{int(diff.sum())} of {diff.size} bytes differ"
    g, r = got[diff].astype(np.int16), ref[diff].astype(np.int16)
    assert np.all(np.abs(g - r) == 1) and np.all((g & 0x80) == (r & 0x80))


# (rows, C): the vectorized kernel at every pack count (bf16: 8 elements a pack, fp32: 4), odd row counts, and
# shapes that take the unfused fallback (C not a multiple of the pack, rows over 8 packs per lane)
LN_SHAPES = [(1, 8), (37, 1280), (5, 64), (129, 1600), (3, 768), (64, 2048), (7, 100), (2, 4104), (3, 2056)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_gpu_kernel_matches_reference(cp, rng, dtype, shape):
    n, c = shape
    a, b, gamma, beta = _inputs(rng, n, c, dtype)
    scale = _one(40.0)
    s_ref, t_ref, mean_ref, rstd_ref = fp8_add_layernorm(a, b, gamma, beta, scale, transpose=True)
    da, db, dg, dbt = _dev(cp, a, b, gamma, beta)
    s_fused, _, m_fused, r_fused = add_layernorm_forward(da, db.copy(), dg, dbt)
    amax, sinv = cp.full(1, np.nan, F32), cp.full(1, np.nan, F32)
    res = cp.full((n, c), np.nan, dtype=da.dtype)  # poisoned: every element of s must be written
    s, t, mean, rstd = fp8_add_layernorm(da, db, dg, dbt, cp.asarray(scale), residual_out=res, transpose=True,
                                         amax=amax, scale_inv=sinv)
    assert s is res
    np.testing.assert_array_equal(cp.asnumpy(s), cp.asnumpy(s_fused))
    vec, packs = vector_plan(c, da.dtype, (da, db, s, dg, dbt))
    if vec and packs > 0:  # the kernel: add_layernorm_forward_warp's statistics, bit for bit (layernorm.cuh)
        np.testing.assert_array_equal(cp.asnumpy(mean), cp.asnumpy(m_fused))
        np.testing.assert_array_equal(cp.asnumpy(rstd), cp.asnumpy(r_fused))
    else:  # the fallback's fp32 LayerNorm may sum in another order than the storage type's
        np.testing.assert_allclose(cp.asnumpy(mean), cp.asnumpy(m_fused), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(cp.asnumpy(rstd), cp.asnumpy(r_fused), rtol=1e-5)
    np.testing.assert_array_equal(cp.asnumpy(s).astype(F32), s_ref.astype(F32))
    _close_bytes(cp.asnumpy(t.data), t_ref.data)
    np.testing.assert_array_equal(cp.asnumpy(t.data_t), cp.asnumpy(t.data).T)
    y_ref = _ln64(s_ref, gamma, beta).astype(F32)
    assert abs(float(cp.asnumpy(amax)[0]) - float(amax_reference(y_ref))) <= 1e-5 * float(amax_reference(y_ref))
    assert cp.asnumpy(sinv)[0] == F32(1) / F32(40)


@pytest.mark.gpu
def test_gpu_in_place_nan_row_and_accumulated_amax(cp, rng):
    a, b, gamma, beta = _dev(cp, *_inputs(rng, 9, 1024, "bf16"))
    a[4, 7] = np.nan
    b_before = b.copy()
    amax = cp.asarray(_one(1e6))
    s, t, _, _ = fp8_add_layernorm(a, b, gamma, beta, cp.asarray(_one(8.0)), residual_out=b, amax=amax,
                                   accumulate_amax=True)
    assert s is b
    ref = (a.astype(F32) + b_before.astype(F32)).astype(a.dtype)
    np.testing.assert_array_equal(cp.asnumpy(b.astype(F32)), cp.asnumpy(ref.astype(F32)))
    data = cp.asnumpy(t.data)
    assert np.all(data[4] == NAN_BITS) and not np.any(np.delete(data, 4, axis=0) == NAN_BITS)
    assert np.isnan(cp.asnumpy(amax)[0])  # NaN propagates through the accumulation too


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (65, 129), (128, 68), (4, 4100), (1000, 768)])
def test_gpu_transpose(cp, rng, shape):
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    out = cp.full(shape[::-1], 0xAB, np.uint8)
    got = fp8_transpose(cp.asarray(bits), out=out)
    assert got is out
    np.testing.assert_array_equal(cp.asnumpy(got), bits.T)
    view = cp.asarray(np.concatenate([[0], bits.ravel()]).astype(np.uint8))[1:].reshape(shape)  # misaligned: scalar
    np.testing.assert_array_equal(cp.asnumpy(fp8_transpose(view)), bits.T)


@pytest.mark.gpu
def test_gpu_quantize_reference_is_what_the_bytes_mean(cp, rng):
    """The kernel's bytes against quantize_reference of the float64 LayerNorm, on a d36-sized row block."""
    a, b, gamma, beta = _inputs(rng, 256, 1280, "bf16")
    _, t, _, _ = fp8_add_layernorm(*_dev(cp, a, b, gamma, beta), cp.asarray(_one(32.0)))
    s = (a.astype(F32) + b.astype(F32)).astype(a.dtype)
    _close_bytes(cp.asnumpy(t.data), quantize_reference(_ln64(s, gamma, beta).astype(F32), F32(32.0), E4M3))


def test_benchmark_script_runs_on_the_cpu(capsys):
    """benchmarks/bench_ch5b_layernorm_casts.py --quick: every setting built and timed on a tiny model, the first
    as the baseline; an unknown setting is refused in one line."""
    from test_fast_model import _run_benchmark  # tests/ is not a package

    assert _run_benchmark("bench_ch5b_layernorm_casts.py", ["--quick", "--settings", "defaults,bias unfused"]) == 0
    out = capsys.readouterr().out
    assert "defaults over bias unfused: " in out and "not written" in out
    with pytest.raises(SystemExit):
        _run_benchmark("bench_ch5b_layernorm_casts.py", ["--quick", "--settings", "nope"])
    assert "--settings takes defaults, bf16 layernorm + cast, weights current, bias unfused; got nope" in \
        capsys.readouterr().err
