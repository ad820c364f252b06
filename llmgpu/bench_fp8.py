"""The FP8 rows of ``llmgpu bench`` (issue 37, chapter 5b): whether each FP8 mode can run here, and their ratios.

``llmgpu-fp8-graph`` is ``llmgpu-fast-graph`` with the QKV and MLP GEMMs in FP8 (``FastOptions(fp8=--fp8-recipe)``);
``torch-compile-fp8`` is PyTorch's strongest FP8 training on the same config: torchao's float8 training (tensorwise
recipe: per-tensor current scaling) on the same layers, then ``torch.compile`` (``torch_reference.convert_to_float8``).
Neither is a default mode. The table gives each FP8 row's ratio to the bf16 ``torch-compile`` and, in its "vs fp8"
column, to ``torch-compile-fp8``; ``fp8_ratios`` prints the comparisons the issue sets targets for. An FP8 row's MFU
has the same denominator as the others (the bf16 GEMM ceiling), so MFUs stay comparable across rows.
"""

from __future__ import annotations

import numpy as np

from .model.options import fp8_setting_reason
from .torch_reference import float8_unavailable_reason
from .train.config import FP8_RECIPES, fp8_unavailable_reason

FP8_BENCH_MODES = ("llmgpu-fp8-graph", "torch-compile-fp8")


def fp8_recipe(given: str | None, modes) -> str:
    """The scaling recipe of the run's llmgpu-fp8-graph rows: ``--fp8-recipe`` or the default ("current"). Given where
    no such row runs, it is ignored, and a note says so."""
    if given and "llmgpu-fp8-graph" not in modes:
        print(f"note: --fp8-recipe {given} is ignored: it scales llmgpu-fp8-graph, which is not among the modes")
    return given or FP8_RECIPES[0]


def fp8_skip_reason(mode: str, arch: str, dtype: str, xp, torch) -> str | None:
    """Why the FP8 ``mode`` cannot run here (one line for its row), or None (also for a mode that is not FP8's).
    ``torch``: the module, for torchao's checks."""
    if mode not in FP8_BENCH_MODES:
        return None
    if mode.startswith("llmgpu"):  # a GPU with FP8 tensor cores (the first thing to say where none is), GPT-2 in bf16
        return fp8_unavailable_reason(xp) or fp8_setting_reason(arch, dtype)
    return float8_unavailable_reason(torch, "cpu" if xp is np else "cuda", dtype=dtype, arch=arch)


def fp8_ratios(rows) -> dict:
    """``{mode: ratio}``: llmgpu-fp8-graph's tokens/s over torch-compile-fp8's (the fair FP8 comparison), over
    torch-compile's (bf16) and over llmgpu-fast-graph's (what FP8 gains our step), where both rows ran; each printed."""
    done = {r["mode"]: r for r in rows if r.get("tokens_per_s")}
    ours = done.get("llmgpu-fp8-graph")
    out = {}
    for other in ("torch-compile-fp8", "torch-compile", "llmgpu-fast-graph") if ours else ():
        if other in done:
            out[other] = x = ours["tokens_per_s"] / done[other]["tokens_per_s"]
            print(f"llmgpu-fp8-graph (fp8 {ours['fp8_recipe']}) / {other} "
                  f"({done[other].get('fp8_recipe') or done[other]['dtype']}) tokens/s: {x:.3f}"
                  + ("  <- the fair FP8 comparison" if other == "torch-compile-fp8" else ""))
    return out


__all__ = ["FP8_BENCH_MODES", "fp8_ratios", "fp8_skip_reason"]
