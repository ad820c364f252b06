"""The model families ``llmgpu train --arch`` names, one table: each family's configuration, presets, book-step
class and fast-step class. What the trainer, the checkpoint readers and the command line look up instead of naming
GPT-2.

A configuration dict (a checkpoint's ``model_config``) says its family under ``"arch"``; one without it is GPT-2's
(every checkpoint written before the Llama family).
"""

from __future__ import annotations

from .config import PRESETS as GPT2_PRESETS
from .config import GPTConfig
from .fast import FastGPT
from .fast_llama import FastLlama
from .gpt import GPT
from .llama import Llama
from .llama_config import PRESETS as LLAMA_PRESETS
from .llama_config import LlamaConfig

# arch → (configuration class, presets, the book step's model class, the fast step's: chapters 8 and 10); the first
# is the default
FAMILIES = {
    "gpt2": (GPTConfig, GPT2_PRESETS, GPT, FastGPT),
    "llama": (LlamaConfig, LLAMA_PRESETS, Llama, FastLlama),
}
ARCHS = tuple(FAMILIES)
ALL_PRESETS = tuple(name for _, presets, *_ in FAMILIES.values() for name in presets)


def _family(arch: str):
    try:
        return FAMILIES[arch]
    except KeyError:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}") from None


def presets(arch: str) -> dict:
    """The presets of family ``arch`` (name → configuration)."""
    return _family(arch)[1]


def arch_of_preset(name: str) -> str | None:
    """The family a preset belongs to, or None for no preset of any."""
    return next((a for a, (_, p, *_) in FAMILIES.items() if name in p), None)


def config_from_dict(d: dict):
    """The configuration a dict describes (``as_dict``'s form), of the family its ``"arch"`` names (GPT-2 without
    one). A ValueError/TypeError for an unknown family or bad values."""
    if not isinstance(d, dict):
        raise TypeError(f"a model configuration is a dict, got {type(d).__name__}")
    return _family(d.get("arch", "gpt2"))[0].from_dict(d)


def model_class(config):
    """The book step's model class of a configuration (``GPT`` for a ``GPTConfig``, ``Llama`` for a
    ``LlamaConfig``)."""
    return _family(config.arch)[2]


def fast_model_class(config):
    """The fast step's model class of a configuration (``FastGPT`` for a ``GPTConfig``, ``FastLlama`` for a
    ``LlamaConfig``)."""
    return _family(config.arch)[3]


__all__ = ["ALL_PRESETS", "ARCHS", "FAMILIES", "arch_of_preset", "config_from_dict", "fast_model_class", "model_class",
           "presets"]
