"""llmgpu: LLM backpropagation and the training loop on GPUs, from first principles.

CUDA C kernels (compiled through CuPy), cuBLAS GEMMs and a NumPy reference for every op. Arrays
decide the path: CuPy arrays run the kernels, NumPy arrays the reference. CuPy is optional
(``pip install 'llmgpu[cuda13]'``); without it everything runs on NumPy.
"""

from . import backend, ops, plotting, testing, timing
from .backend import default_xp, device_info, get_array_module, gpu_available, on_gpu

__version__ = "0.1.0"

__all__ = [
    "backend",
    "ops",
    "plotting",
    "testing",
    "timing",
    "default_xp",
    "device_info",
    "get_array_module",
    "gpu_available",
    "on_gpu",
    "__version__",
]
