"""``FastOptions``: every choice of the chapter 8 step (``model/fast.py``), one frozen value per model.

A choice that lives in a module switch is hidden state: a model built here behaves differently from one built
there, a captured CUDA graph keeps whichever setting was on while it was captured, and a checkpoint does not
record it. So ``FastGPT(..., options=FastOptions(...))`` takes them as one value, checked when it is made, fixed
for the model's life (to compare two settings, build two models); ``llmgpu train --attention-kernel`` and
``llmgpu bench --attention-kernel`` set its attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..ops import cross_entropy, embedding, layernorm
from ..ops.flash_attention import AUTO_RESOLVES_TO
from ..ops.fp8 import RECIPES as FP8_RECIPES

FLASH_KERNELS = ("auto", *AUTO_RESOLVES_TO)  # flash attention, both directions: a run's choices (TrainConfig, bench)
ATTENTION_KERNELS = (*FLASH_KERNELS, "math")  # FastOptions.attention_kernel: also chapter 2's kernels
FP8_MODES = ("off", *FP8_RECIPES)  # FastOptions.fp8: bf16 GEMMs, or FP8 ones with this scaling recipe
FP8_EPILOGUES = ("bias", "gelu_bias", "dgelu")  # what the FP8 linear layers may fuse (FastOptions.fp8_fused_epilogues)
# where FastOptions.fp8 applies (dev/cuda/fp8_plan.md): the linear layers whose GEMMs run in FP8, by nanoGPT's module
# names (QKV, MLP in, MLP out; the attention out-projection attn.c_proj and the LM head stay in the model's dtype),
# the families whose fast step has them, and the GPUs with FP8 tensor cores (Ada sm_89, Hopper sm_90 and later)
FP8_LINEARS = ("attn.c_attn", "mlp.c_fc", "mlp.c_proj")
FP8_ARCHS = ("gpt2",)
FP8_ONLY_GPT2 = "FP8 is implemented for the GPT-2 family's fast step only"
FP8_MIN_SM = (8, 9)


def fp8_setting_reason(arch: str, dtype: str) -> str | None:
    """Why a run of family ``arch`` computing in ``dtype`` ('bf16') has no FP8 GEMMs (one line), or None."""
    if arch not in FP8_ARCHS:
        return f"{FP8_ONLY_GPT2}, not --arch {arch}'s"
    return None if dtype == "bf16" else f"FP8 GEMMs run inside bf16 training (--dtype bf16), not {dtype}"


def fp8_hardware_reason(capability: str | None, gpu: str = "this GPU") -> str | None:
    """Why FP8 GEMMs cannot run on a GPU of compute ``capability`` ('9.0'; None: no GPU), one line; None if they can."""
    need = f"FP8 GEMMs need a GPU with FP8 tensor cores (sm_{FP8_MIN_SM[0]}{FP8_MIN_SM[1]}+: Ada, Hopper and later)"
    if capability is None:
        return f"{need}; none is in use"
    major, minor = (int(v) for v in str(capability).split("."))
    return f"{need}; {gpu} is sm_{major}{minor}" if (major, minor) < FP8_MIN_SM else None


@dataclass(frozen=True)
class FastOptions:
    """The choices of the chapter 8 step, one frozen value per model (``FastGPT(..., options=...)``); the defaults
    are what measured best on the H200. A bad value is a ValueError naming the field."""

    # flash attention: "auto" (per shape the faster of ours and cuDNN, recorded in FastGPT.kernel_choices), "ours"
    # (chapter 2b's kernels) or "cudnn"; "math": chapter 2's attention instead (the B·H·T·T probabilities written;
    # CuPy's cuBLAS GEMMs, so no CUDA graph; what fp32 on the GPU always runs)
    attention_kernel: str = "auto"
    # False: the attention backward may run cuDNN's default algorithm (dQ summed with atomics; faster, not bitwise
    # repeatable, what PyTorch's SDPA runs); True keeps every step's gradients the same bits run to run
    deterministic_attention: bool = True
    # issue 19, both on by default (False: the step before, for A/B benchmarks)
    fused_cross_entropy: bool = True  # the LM head's cross-entropy forward + backward as one pass over the logits
    embedding_grad_into_fp32: bool = True  # the embedding backward adds its fp32 row sums into the fp32 gradients
    # rows of logits alive at a time in the training step (module docstring): [8192, 50304] bf16 is 0.8 GB,
    # against 6.6 GB for the whole [65536, 50304] at B = 64, T = 1024; large enough for full-speed GEMMs
    lm_head_rows: int = 8192
    # issue 36 (the Llama family; GPT-2 has no RoPE): RoPE's backward on dq, dk folded into the flash attention
    # backward's stores (False: a separate pass after it, the step before, for A/B benchmarks)
    rope_in_attention_backward: bool = True
    # kernel variants of chapter 3 (verified on the H200; see benchmarks/bench_ch3_layernorm_gelu_ce.py)
    embedding_backward_method: str = "counting"  # deterministic, no host sync, fixed launch shapes (capturable)
    layernorm_backward_method: str = "fast"  # two rows in flight per warp; residual gradient, fp32 accumulation fused
    cross_entropy_method: str = "fast"  # the unfused head's forward (fused_cross_entropy=False)
    # issue 37 (chapter 5b): "current" or "delayed" runs the QKV, MLP-in and MLP-out GEMMs in FP8 (E4M3 weights and
    # activations, E5M2 gradients) with that scaling recipe (ops/fp8.py); "off": every GEMM in the model's dtype
    fp8: str = "off"
    fp8_history: int = 16  # steps of amax the delayed recipe keeps per tensor (Transformer Engine's default is 1024)
    # the epilogues cuBLASLt fuses into the FP8 GEMMs; the others run as separate passes. On an H100 (GPT-2, B=32;
    # chapter 5b's profiles) the fused DGELU was 2.4x slower than GEMM + pass, the fused GELU_AUX_BIAS 1.26x faster,
    # the fused BIAS faster for QKV and slower for MLP-out. With fp8_fused_casts (the default) only "bias" is ever
    # asked for (QKV and MLP-out's forward), and at d36 (H100, B=8, one process) fusing it made the step 1.9 % faster
    # (QKV's alone 1.4 %), so the sizes FP8 pays at fuse it by default
    fp8_fused_epilogues: tuple = ("gelu_bias", "bias")
    # the FP8 casts also apply the MLP's GELU (+ MLP-in's bias) and its derivative, and sum the FP8 layers' bias
    # gradients, so GELU's output and the pre-activation's gradient are never written in bf16 and no pass reads a
    # gradient for its bias (model/fp8_linear.py); False: cuBLASLt's epilogues and separate passes, as above. On the
    # H200 (d48, B=8) the step was 4 % faster with delayed scaling, 1 % with current (d36: the same within noise).
    # Like the other fp8_* fields, it means nothing with fp8="off"
    fp8_fused_casts: bool = True
    # under delayed scaling, the residual add + LayerNorm before QKV and MLP-in writes its output as the layer's FP8
    # bytes and amax (ops/fp8_layernorm.py), never in bf16; False: a bf16 output, then the layer's cast
    fp8_layernorm_casts: bool = True
    # the delayed recipe also casts the weights with the scale from their amax history, recorded by the cast itself
    # (Transformer Engine's DelayedScaling does), instead of measuring each weight first: one launch a weight instead
    # of three and a memset, one read instead of two (model/fp8_linear.py says why that is safe); False: current
    # scaling for the weights, always
    fp8_delayed_weights: bool = True

    def __post_init__(self):
        allowed = {"attention_kernel": ATTENTION_KERNELS, "embedding_backward_method": embedding.METHODS,
                   "layernorm_backward_method": layernorm.METHODS, "cross_entropy_method": cross_entropy.METHODS,
                   "fp8": FP8_MODES}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in allowed and v not in allowed[f.name]:
                raise ValueError(f"FastOptions.{f.name} must be one of {', '.join(allowed[f.name])}, got {v!r}")
            if f.type == "bool" and not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"FastOptions.{f.name} must be True or False, got {v!r}")
        fused = self.fp8_fused_epilogues
        if not isinstance(fused, tuple) or not set(fused) <= set(FP8_EPILOGUES):
            raise ValueError(f"FastOptions.fp8_fused_epilogues must be a tuple of {', '.join(FP8_EPILOGUES)}, "
                             f"got {fused!r}")
        for name in ("lm_head_rows", "fp8_history"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"FastOptions.{name} must be an int >= 1, got {v!r}")
        if self.embedding_grad_into_fp32 and self.embedding_backward_method != "counting":
            raise ValueError("FastOptions.embedding_grad_into_fp32 adds into the fp32 gradients with the 'counting' "
                             f"embedding backward; got embedding_backward_method={self.embedding_backward_method!r}")


__all__ = ["ATTENTION_KERNELS", "FLASH_KERNELS", "FP8_ARCHS", "FP8_LINEARS", "FP8_MIN_SM", "FP8_MODES", "FP8_ONLY_GPT2",
           "FastOptions", "fp8_hardware_reason", "fp8_setting_reason"]
