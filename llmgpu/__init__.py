"""llmgpu: LLM backpropagation and the training loop on GPUs, from first principles.

CUDA C kernels (compiled through CuPy), cuBLAS GEMMs and a NumPy reference for every op. Arrays
decide the path: CuPy arrays run the kernels, NumPy arrays the reference. CuPy is optional
(``pip install 'llmgpu[cuda13]'``); without it everything runs on NumPy.

The package tree is the book's table of contents:

    backend, checks, testing, plotting, instrument, results   the ground floor: dispatch, argument checks,
                test helpers, plots, hooks, the measured results the notebooks read
    kernels/    every CUDA C source, the NVRTC loader, launch arithmetic       (all chapters)
    ops/        one module per layer, forward + backward + NumPy reference    introduction, chapters 1-3
    gemm/       row-major cuBLAS (chapter 1) and cuBLASLt with epilogues (chapter 8)
    optim/      flat parameters, fused AdamW, clipping, schedules             chapter 4
    amp         casts, the loss scaler, precision policies                    chapter 5
    model/      GPT-2: configuration, the book step with checkpointing, the fast step   chapters 6, 8
    perf/       timing, profiling, occupancy, CUDA graphs, fusion, sweeps     chapter 8 (and the measurements of all)
    dist/       several GPUs: launchers, NCCL / MPI, data parallelism, ZeRO-1/2, our ring all-reduce   chapter 9
    interop/    safetensors, Hugging Face GPT-2 and Llama directories in and out
    train/      the configuration, THE training step, the trainer, data, checkpoints   chapter 7 (9: ranks)
    bench, cli  ``llmgpu bench`` and the ``llmgpu`` command

``llmgpu.from_pretrained(path)``: a model from a local Hugging Face GPT-2 or Llama directory or an llmgpu run.
"""

import importlib

from .version import __version__

_SUBMODULES = ("backend", "ops", "plotting", "testing")
_FROM_BACKEND = ("default_xp", "device_info", "get_array_module", "gpu_available", "on_gpu")


def __getattr__(name):
    # imported on first use, not by `import llmgpu`: the `llmgpu` command imports this package before its Ctrl-C
    # handler is in place (cli.main), and backend's NumPy + ml_dtypes take about a second to import
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _FROM_BACKEND:
        return getattr(importlib.import_module(".backend", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_pretrained(path, *, dtype="fp32", xp=None, fast: bool = False):
    """A ``GPT`` or a ``Llama`` (``FastGPT``, ``FastLlama`` with ``fast``) from a local Hugging Face GPT-2 or
    Llama directory (``config.json`` + ``model.safetensors``, as ``save_pretrained`` writes it) or an llmgpu run or
    checkpoint, in ``dtype`` on ``xp`` (default: the active backend). Never downloads (``train/pretrained.py``)."""
    from .train.pretrained import from_pretrained as load

    return load(path, dtype=dtype, xp=xp, fast=fast)


__all__ = [
    "backend",
    "ops",
    "plotting",
    "testing",
    "default_xp",
    "from_pretrained",
    "device_info",
    "get_array_module",
    "gpu_available",
    "on_gpu",
    "__version__",
]
