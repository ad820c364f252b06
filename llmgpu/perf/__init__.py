"""Measuring (chapter 8, and the measurements every chapter makes).

* ``timing``: CUDA-event timing, the copy and GEMM ceilings, MFU, result files.
* ``profile``: per-op tables of a step (``OpTimer``), launch cost, whether a step waits for the GPU.
* ``occupancy``: blocks per SM by the calculator's formula and by the CUDA API.
* ``graphs``: capturing a step into a CUDA graph and replaying it.
* ``fusion``: the chapter 8 fusions, separate vs fused, checked and timed.
* ``sweeps``: the chapters' kernel and model sweeps (GEMM variants, linear layer, attention stages, checkpointing).

Submodules are imported on their own (``from llmgpu.perf import timing``). The package sits above the
model (``sweeps`` and ``fusion`` measure it); nothing below it imports it, so the model and the ops
carry no measurement code (they only call the ``llmgpu.instrument`` hooks).
"""
