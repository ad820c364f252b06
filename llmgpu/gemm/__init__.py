"""Row-major GEMMs: cuBLAS through CuPy (chapter 1) and cuBLASLt with fused epilogues (chapter 8).

* ``llmgpu.gemm.cublas``: ``gemm(a, b, trans_a=, trans_b=)``, the row-major ↔ column-major identity,
  fp32 accumulation; what the book's layers call.
* ``llmgpu.gemm.cublaslt``: ``lt_gemm(..., epilogue=)``, the same identity through cuBLASLt
  (``nvmath-python``, the ``fast`` extra): bias, GELU and bias-gradient epilogues, and capturable in a
  CUDA graph. Imported on its own (``from llmgpu.gemm.cublaslt import lt_gemm``): it sits above the
  chapter 3 ops whose GELU its NumPy reference reuses.
* ``llmgpu.gemm.fp8``: ``fp8_gemm``, FP8 operands (Hopper) through the same cuBLASLt path, per-tensor scales
  read on the device (chapter 5); ``llmgpu.gemm.lt_plan`` is the cuBLASLt plan both build on.
"""

from .cublas import CUDA_DATA_TYPES, check_operands, gemm, gemm_flops, prepare_out

__all__ = ["CUDA_DATA_TYPES", "check_operands", "gemm", "gemm_flops", "prepare_out"]
