"""launch.vector_width: the 16-byte vector width the GPU kernels pick, or their scalar fallback."""

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.kernels.launch import vector_width


@pytest.mark.parametrize("dtype,c,expected", [
    (np.float32, 768, 4), (np.float32, 6, 1), (backend.bfloat16, 768, 8), (backend.bfloat16, 12, 1),
    (np.float16, 8, 8), (np.float16, 1, 1),
])
def test_vector_width_by_row_length(dtype, c, expected):
    assert vector_width(dtype, c) == expected


@pytest.mark.gpu
def test_gpu_vector_width_unaligned_pointer(cp):
    buf = cp.zeros(1024 + 8, dtype=cp.float32)
    assert vector_width(np.float32, 256, buf[:1024]) == 4
    assert vector_width(np.float32, 256, buf[:1024], buf[1:1025]) == 1  # 4 bytes past a 16-byte boundary
    assert vector_width(np.float32, 256, buf[4:1028]) == 4  # 16 bytes past: aligned again
