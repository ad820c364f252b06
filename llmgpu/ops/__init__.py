"""One module per layer: forward and backward, the CUDA path and the NumPy reference.

Arrays choose the path: CuPy arrays run the kernels in ``llmgpu/kernels``, NumPy arrays the
reference implementation (float32/float64), which is also the chapter's math.
"""

from .matmul import matmul
from .vector_add import vector_add

__all__ = ["matmul", "vector_add"]
