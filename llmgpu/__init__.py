"""llmgpu: LLM backpropagation and the training loop on GPUs, from first principles.

CUDA C kernels (compiled through CuPy), cuBLAS GEMMs and a NumPy reference for every op. Arrays
decide the path: CuPy arrays run the kernels, NumPy arrays the reference. CuPy is optional
(``pip install 'llmgpu[cuda13]'``); without it everything runs on NumPy.

The package tree is the book's table of contents:

    backend, checks, testing, plotting, instrument   the ground floor: dispatch, argument checks, hooks
    kernels/    every CUDA C source, the NVRTC loader, launch arithmetic       (all chapters)
    ops/        one module per layer, forward + backward + NumPy reference    introduction, chapters 1-3
    gemm/       row-major cuBLAS (chapter 1) and cuBLASLt with epilogues (chapter 8)
    optim/      flat parameters, fused AdamW, clipping, schedules             chapter 4
    amp         casts, the loss scaler, precision policies                    chapter 5
    model/      GPT-2: configuration, the book step with checkpointing, the fast step   chapters 6, 8
    perf/       timing, profiling, occupancy, CUDA graphs, fusion, sweeps     chapter 8 (and the measurements of all)
    train/      the configuration, THE training step, the trainer, data, checkpoints   chapter 7
    bench, cli  ``llmgpu bench`` and the ``llmgpu`` command
"""

from . import backend, ops, plotting, testing
from .backend import default_xp, device_info, get_array_module, gpu_available, on_gpu
from .version import __version__

__all__ = [
    "backend",
    "ops",
    "plotting",
    "testing",
    "default_xp",
    "device_info",
    "get_array_module",
    "gpu_available",
    "on_gpu",
    "__version__",
]
