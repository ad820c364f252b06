"""GPT-2, two ways (chapters 1–6 and 8), on one shared base.

* ``config.py``: ``GPTConfig``, the presets, parameter names and shapes, FLOPs per token, activation bytes.
* ``base.py``: ``GPTBase``: parameters, initialization, state dict, input checks, loss, sampling.
* ``gpt.py``: ``GPT``, the book's step from the chapter 1–3 ops, with activation checkpointing (chapter 6).
* ``fast.py``: ``FastGPT``, the chapter 8 step: cuBLASLt epilogues, fused residual + LayerNorm, flash attention.
* ``options.py``: ``FastOptions``, every choice of that step (attention kernel, fusions, LM-head rows), one value.
* ``llama_config.py`` and ``llama.py`` (chapter 10): ``LlamaConfig`` and ``Llama``, the book's step with RMSNorm,
  RoPE, SwiGLU and grouped-query attention, on ``GPT``'s loop.
* ``fast_llama.py`` (chapter 10): ``FastLlama``, the Llama model on ``FastGPT``'s step.
* ``family.py``: the families ``llmgpu train --arch`` names (configuration, presets, model classes), one table.
"""

from .base import PAD_LOGIT, GPTBase, sample_token
from .config import (
                     PRESETS,
                     GPTConfig,
                     activation_bytes,
                     block_activation_bytes,
                     block_param_names,
                     gpt2_param_shapes,
                     training_flops,
)
from .family import ARCHS, config_from_dict, fast_model_class, model_class
from .fast import FastGPT
from .fast_llama import FastLlama
from .gpt import GPT
from .llama import Llama
from .llama_config import LlamaConfig
from .options import FastOptions

__all__ = ["ARCHS", "GPT", "PAD_LOGIT", "PRESETS", "FastGPT", "FastLlama", "FastOptions", "GPTBase", "GPTConfig",
           "Llama", "LlamaConfig", "activation_bytes", "block_activation_bytes", "block_param_names",
           "config_from_dict", "fast_model_class", "gpt2_param_shapes", "model_class", "sample_token",
           "training_flops"]
