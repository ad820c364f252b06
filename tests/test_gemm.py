"""llmgpu.gemm: row-major GEMMs through cuBLAS by the transposition identity, against float64."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.gemm import gemm
from llmgpu.testing import assert_close, random_array

pytestmark = pytest.mark.ch1


def _ref(a, b, ta, tb):
    A = backend.to_numpy(a).astype(np.float64)
    B = backend.to_numpy(b).astype(np.float64)
    return np.matmul(np.swapaxes(A, -1, -2) if ta else A, np.swapaxes(B, -1, -2) if tb else B)


def _operands(rng, m, n, k, ta, tb, xp, dtype, batch=()):
    a = random_array(rng, (*batch, k, m) if ta else (*batch, m, k), dtype, xp)
    b = random_array(rng, (*batch, n, k) if tb else (*batch, k, n), dtype, xp)
    return a, b


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_numpy_reference_transposes(rng, ta, tb):
    a, b = _operands(rng, 5, 7, 3, ta, tb, np, np.float32)
    assert_close(gemm(a, b, trans_a=ta, trans_b=tb), _ref(a, b, ta, tb))


def test_accumulate_requires_out(rng):
    a, b = _operands(rng, 2, 3, 4, False, False, np, np.float32)
    with pytest.raises(ValueError, match="out must be given"):
        gemm(a, b, beta=1.0)


def test_bad_inputs(rng):
    a = random_array(rng, (4, 5))
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(a, random_array(rng, (4, 5)))
    with pytest.raises(TypeError, match="share a dtype"):
        gemm(a, random_array(rng, (5, 2), backend.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        gemm(a, random_array(rng, (5, 4)).T)
    with pytest.raises(ValueError, match="batch shapes differ"):
        gemm(random_array(rng, (2, 4, 5)), random_array(rng, (3, 5, 2)))
    with pytest.raises(ValueError, match="out must have shape"):
        gemm(a, random_array(rng, (5, 2)), out=np.empty((4, 3), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (7, 33, 5), (1000, 768, 3072), (257, 129, 65)])
def test_gpu_against_float64(cp, rng, dtype, ta, tb, mnk):
    m, n, k = mnk
    a, b = _operands(rng, m, n, k, ta, tb, cp, dtype)
    out = cp.full((m, n), np.nan, dtype=backend.resolve_dtype(dtype))
    gemm(a, b, trans_a=ta, trans_b=tb, out=out)
    assert_close(out, _ref(a, b, ta, tb), dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_batched_and_broadcast(cp, rng, dtype):
    a, b = _operands(rng, 33, 17, 9, False, True, cp, dtype, batch=(2, 3))
    assert_close(gemm(a, b, trans_b=True), _ref(a, b, False, True), dtype=dtype)
    w = random_array(rng, (17, 9), dtype, cp)  # one matrix shared by every batch entry
    assert_close(gemm(a, w, trans_b=True), _ref(a, w, False, True), dtype=dtype)


@pytest.mark.gpu
def test_gpu_accumulate_into_fp32(cp, rng):
    a, b = _operands(rng, 64, 48, 32, True, False, cp, "bf16")
    acc = random_array(rng, (64, 48), np.float32, cp)
    expect = backend.to_numpy(acc).astype(np.float64) + 0.5 * _ref(a, b, True, False)
    gemm(a, b, trans_a=True, out=acc, alpha=0.5, beta=1.0)
    assert_close(acc, expect, rtol=1e-2)
