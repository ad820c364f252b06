"""Introduction chapter: vector add and the naive → tiled → blocked GEMM, against NumPy."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.ops import matmul, vector_add
from llmgpu.ops.matmul import METHODS
from llmgpu.testing import assert_close, poisoned, random_array

pytestmark = pytest.mark.intro


def test_vector_add_numpy(rng):
    a, b = random_array(rng, 1001), random_array(rng, 1001)
    np.testing.assert_array_equal(vector_add(a, b), a + b)


def test_vector_add_bad_input(rng):
    a = random_array(rng, 10)
    with pytest.raises(ValueError, match="b must have shape"):
        vector_add(a, random_array(rng, 11))
    with pytest.raises(TypeError, match="dtypes must match"):
        vector_add(a, random_array(rng, 10, dtype=np.float16))
    with pytest.raises(ValueError, match="a must be 1-D"):
        vector_add(random_array(rng, (2, 5)), random_array(rng, (2, 5)))
    with pytest.raises(ValueError, match="contiguous"):
        vector_add(random_array(rng, 20)[::2], a)
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        vector_add([1.0, 2.0], a)


@pytest.mark.parametrize("method", METHODS)
def test_matmul_numpy_path_matches_float64(rng, method):
    a, b = random_array(rng, (37, 53)), random_array(rng, (53, 29))
    assert_close(matmul(a, b, method=method), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5)


def test_matmul_bad_input(rng):
    a = random_array(rng, (4, 5))
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(a, random_array(rng, (4, 5)))
    with pytest.raises(TypeError, match="b must be fp32"):
        matmul(a, random_array(rng, (5, 3), dtype=backend.bfloat16))
    with pytest.raises(ValueError, match="method must be"):
        matmul(a, random_array(rng, (5, 3)), method="fast")
    with pytest.raises(ValueError, match="a must be 2-D"):
        matmul(random_array(rng, 5), random_array(rng, (5, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 7, 1000, 1 << 20, (1 << 20) + 3])
def test_vector_add_gpu(cp, rng, dtype, n):
    a, b = random_array(rng, n, dtype, cp), random_array(rng, n, dtype, cp)
    out = poisoned(n, dtype, cp)
    vector_add(a, b, out=out)
    ref = vector_add(backend.to_numpy(a), backend.to_numpy(b))
    assert_close(out, ref.astype(np.float64), dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 5, 3), (33, 65, 17), (100, 257, 130), (513, 300, 1029), (64, 64, 64)])
def test_matmul_gpu_against_float64(cp, rng, method, shape):
    m, n, k = shape
    a, b = random_array(rng, (m, k), xp=cp), random_array(rng, (k, n), xp=cp)
    out = poisoned((m, n), np.float32, cp)
    matmul(a, b, method=method, out=out)
    ref = backend.to_numpy(a).astype(np.float64) @ backend.to_numpy(b).astype(np.float64)
    assert_close(out, ref, rtol=1e-5, name=f"{method} {shape}")
