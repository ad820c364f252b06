"""One module per layer: forward and backward, the CUDA path and the NumPy reference.

Arrays choose the path: CuPy arrays run the kernels in ``llmgpu/kernels``, NumPy arrays the
reference implementation (float32/float64), which is also the chapter's math.

    introduction   vector_add, matmul
    chapter 1      linear_forward, linear_backward
    chapter 2      softmax_forward, softmax_backward, attention_forward, attention_backward
    chapter 3      layernorm_*, gelu_*, cross_entropy_*, embedding_*
    Llama          rmsnorm_*, rope_* (rotary position embedding), swiglu_* (the gated MLP activation)
    chapter 5      cast (fp32 / bf16 / fp16), fp8 (FP8 formats, scaled casts with amax): imported as modules
    chapter 8      add_layernorm_forward (residual add fused into LayerNorm); flash_attention (cuDNN, optional)
"""

from .attention import attention_backward, attention_forward
from .cross_entropy import cross_entropy_backward, cross_entropy_forward
from .embedding import embedding_backward, embedding_forward
from .gelu import gelu_backward, gelu_forward
from .layernorm import add_layernorm_forward, layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .matmul import matmul
from .rmsnorm import add_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward
from .rope import rope_backward, rope_forward, rope_tables
from .softmax import softmax_backward, softmax_forward
from .swiglu import swiglu_backward, swiglu_forward
from .vector_add import vector_add

__all__ = [
    "add_layernorm_forward",
    "add_rmsnorm_forward",
    "attention_backward",
    "attention_forward",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "embedding_backward",
    "embedding_forward",
    "gelu_backward",
    "gelu_forward",
    "layernorm_backward",
    "layernorm_forward",
    "linear_backward",
    "linear_forward",
    "matmul",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rope_backward",
    "rope_forward",
    "rope_tables",
    "softmax_backward",
    "softmax_forward",
    "swiglu_backward",
    "swiglu_forward",
    "vector_add",
]
