"""Token + position embedding (chapter 3): reference vs finite differences (repeated tokens), CUDA
kernels vs the reference, determinism of the sorted scatter-add, bad ids, argument checks."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops.embedding import METHODS, embedding_backward, embedding_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3


def _inputs(rng, b, t, c, v, max_t=None, dtype="fp32", idx_dtype=np.int64):
    max_t = max_t or t + 3
    idx = rng.integers(0, v, (b, t)).astype(idx_dtype)
    wte = random_array(rng, (v, c), dtype)
    wpe = random_array(rng, (max_t, c), dtype)
    dx = random_array(rng, (b, t, c), dtype)
    return idx, wte, wpe, dx


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_direct_formula(rng):
    idx, wte, wpe, _ = _inputs(rng, 3, 5, 4, 11)
    x = embedding_forward(idx, wte, wpe)
    assert x.shape == (3, 5, 4) and x.dtype == np.float32
    for b in range(3):
        for t in range(5):
            np.testing.assert_allclose(x[b, t], wte[idx[b, t]] + wpe[t], rtol=1e-6)


def test_backward_matches_finite_differences_with_repeated_tokens(rng):
    b, t, c, v = 3, 4, 5, 3  # 12 positions over 3 tokens: every token repeats
    idx = rng.integers(0, v, (b, t))
    idx[0, 0] = idx[2, 3] = 1
    wte = rng.standard_normal((v, c))
    wpe = rng.standard_normal((t + 2, c))
    r = rng.standard_normal((b, t, c))

    def loss():
        return float((embedding_forward(idx, wte, wpe) * r).sum())

    dwte, dwpe = embedding_backward(r, idx, v, t + 2)
    check_gradient(loss, wte, dwte, name="dwte")
    check_gradient(loss, wpe, dwpe, name="dwpe")
    np.testing.assert_array_equal(dwpe[t:], 0.0)


def test_backward_accepts_wpe_shape_and_out(rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5, dtype="bf16", idx_dtype=np.int32)
    a = embedding_backward(dx, idx, 5, wpe.shape)
    o1, o2 = poisoned(wte.shape, "bf16", np), poisoned(wpe.shape, "bf16", np)
    b = embedding_backward(dx, idx, 5, wpe.shape[0], dwte_out=o1, dwpe_out=o2)
    assert b[0] is o1 and b[1] is o2 and a[0].dtype == backend.bfloat16
    np.testing.assert_array_equal(a[0].astype(np.float32), o1.astype(np.float32))
    np.testing.assert_array_equal(a[1].astype(np.float32), o2.astype(np.float32))


def test_bad_inputs(rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 5\)"):
        embedding_forward(np.array([[0, 5, 1]]), wte, wpe)
    with pytest.raises(ValueError, match="idx must lie"):
        embedding_backward(dx, np.array([[0, -1, 1], [0, 0, 0]]), 5, wpe.shape[0])
    with pytest.raises(TypeError, match="idx has dtype float64"):
        embedding_forward(idx.astype(np.float64), wte, wpe)
    with pytest.raises(ValueError, match="idx must be 2-D"):
        embedding_forward(idx[0], wte, wpe)
    with pytest.raises(ValueError, match="wpe must have shape"):
        embedding_forward(idx, wte, wpe[:, :3].copy())
    with pytest.raises(TypeError, match="dtypes must match"):
        embedding_forward(idx, wte, wpe.astype(np.float16))
    with pytest.raises(ValueError, match="wpe holds only"):
        embedding_forward(idx, wte, wpe[:2].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        embedding_forward(np.asfortranarray(idx), wte, wpe)
    with pytest.raises(ValueError, match="idx must have shape"):
        embedding_backward(dx, idx[:, :2].copy(), 5, 6)
    with pytest.raises(ValueError, match="max_t is"):
        embedding_backward(dx, idx, 5, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        embedding_backward(dx, idx, 0, 6)
    with pytest.raises(ValueError, match="wpe's shape"):
        embedding_backward(dx, idx, 5, (6, 3))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bt", [(1, 1), (4, 7), (2, 64)])
@pytest.mark.parametrize("c", [1, 7, 33, 768])
@pytest.mark.parametrize("v", [7, 1000, 50257])
def test_gpu_matches_reference(cp, rng, dtype, method, bt, c, v):
    b, t = bt
    idx, wte, wpe, dx = _inputs(rng, b, t, c, v, max_t=t + 5, dtype=dtype, idx_dtype=np.int32 if c % 2 else np.int64)
    ref_x = embedding_forward(idx, wte, wpe)
    ref_dwte, ref_dwpe = embedding_backward(dx, idx, v, t + 5)
    idd, wted, wped, dxd = (cp.asarray(a) for a in (idx, wte, wpe, dx))
    x = embedding_forward(idd, wted, wped, out=poisoned((b, t, c), dtype, cp), method=method)
    assert_close(x, ref_x, dtype, name="x")
    dwte, dwpe = embedding_backward(
        dxd, idd, v, t + 5, method=method,
        dwte_out=poisoned((v, c), dtype, cp), dwpe_out=poisoned((t + 5, c), dtype, cp),
    )
    assert_close(dwte, ref_dwte, dtype, name="dwte")
    assert_close(dwpe, ref_dwpe, dtype, name="dwpe")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_backward_bitwise_deterministic(cp, rng, dtype):
    b, t, c, v = 8, 256, 768, 50  # 2048 positions on 50 tokens: long runs per token
    idx, _, _, dx = (cp.asarray(a) for a in _inputs(rng, b, t, c, v, max_t=t, dtype=dtype))
    first = [backend.to_numpy(a).tobytes() for a in embedding_backward(dx, idx, v, t)]
    for _ in range(2):
        assert [backend.to_numpy(a).tobytes() for a in embedding_backward(dx, idx, v, t)] == first


@pytest.mark.gpu
def test_gpu_out_of_range_ids_are_loud(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 4, 8, 10)
    idx[0, 1], idx[1, 3] = 10, -3
    good = idx.copy()
    good[0, 1] = good[1, 3] = 0
    x = backend.to_numpy(embedding_forward(cp.asarray(idx), cp.asarray(wte), cp.asarray(wpe)))
    assert np.isnan(x[0, 1]).all() and np.isnan(x[1, 3]).all()
    ref_x = embedding_forward(good, wte, wpe)
    mask = np.ones((2, 4), bool)
    mask[0, 1] = mask[1, 3] = False
    np.testing.assert_allclose(x[mask], ref_x[mask], rtol=1e-6)
    # backward: the bad positions are dropped from dwte, kept in dwpe
    dx_ok = dx.copy()
    dx_ok[0, 1] = dx_ok[1, 3] = 0.0
    ref_dwte, _ = embedding_backward(dx_ok, good, 10, wpe.shape[0])
    _, ref_dwpe = embedding_backward(dx, good, 10, wpe.shape[0])
    for method in METHODS:
        dwte, dwpe = embedding_backward(cp.asarray(dx), cp.asarray(idx), 10, wpe.shape[0], method=method)
        assert_close(dwte, ref_dwte, "fp32")
        assert_close(dwpe, ref_dwpe, "fp32")


@pytest.mark.gpu
def test_gpu_misaligned_rows(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 5, 64, 9)
    buf = cp.empty(wte.size + 1, dtype=cp.float32)
    buf[1:] = cp.asarray(wte).ravel()
    wted = buf[1:].reshape(wte.shape)
    assert wted.data.ptr % 16 != 0
    x = embedding_forward(cp.asarray(idx), wted, cp.asarray(wpe))
    assert_close(x, embedding_forward(idx, wte, wpe), "fp32")


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5)
    with pytest.raises(TypeError, match="idx=ndarray|idx=numpy"):
        embedding_forward(idx, cp.asarray(wte), cp.asarray(wpe))
    with pytest.raises(TypeError, match="idx has dtype float32"):
        embedding_backward(cp.asarray(dx), cp.asarray(idx, dtype=cp.float32), 5, 6)
    with pytest.raises(TypeError, match="float64"):
        embedding_forward(cp.asarray(idx), cp.asarray(wte, dtype=cp.float64), cp.asarray(wpe, dtype=cp.float64))
