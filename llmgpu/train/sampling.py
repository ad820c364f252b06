"""Text from a checkpoint: prompts, the sampling settings, and a model loaded only from sound weights.

``load_for_sampling(path)`` reads a checkpoint (``train --resume``'s reader, without the optimizer state) or
a Hugging Face GPT-2 directory, and refuses, in one line naming the file, weights that hold inf/nan (a
diverged run) or do not fit the model configuration stored with them; ``sampling_settings`` refuses a
temperature or top-k that cannot work.
"""

from __future__ import annotations

import math

import numpy as np

from .checkpoint import CheckpointError
from .config import ConfigError
from .pretrained import build_model, load_pretrained
from .tokenizers import get_tokenizer


def prompt_ids(tokenizer, prompt: str | None) -> list[int]:
    """Token ids of a prompt. ``None``: a default ('def ' for bytes, <|endoftext|> for GPT-2).
    A GPT-2 prompt may also be given as comma-separated ids ('ids:50256,464')."""
    if prompt is None:
        return tokenizer.encode("def ") if tokenizer.name == "bytes" else [50256]
    if prompt.startswith("ids:"):
        try:
            return [int(t) for t in prompt[4:].split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt ids:... must be comma-separated integers, got {prompt!r}") from None
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty")
    return ids


def sampling_settings(temperature: float, top_k: int | None):
    """ConfigError for a temperature that is not a number >= 0 (nan included) or a top-k below 1."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")


def load_for_sampling(path, xp=np, dtype: str | None = None):
    """(model, tokenizer, meta) of an llmgpu run or checkpoint, or a Hugging Face GPT-2 directory, at ``path``
    (``pretrained.load_pretrained``: weights with inf/nan refused); ``dtype`` default: fp32 on the CPU, else the
    run's (bf16 for a Hugging Face model)."""
    pre = load_pretrained(path)
    if pre.tokenizer is None:
        raise CheckpointError(f"{pre.path} does not say which tokenizer its vocabulary of {pre.config.vocab_size} "
                              "belongs to (GPT-2's has 50257 tokens), so its samples cannot be decoded")
    model = build_model(pre, dtype=dtype or ("fp32" if xp is np else pre.meta.get("dtype", "bf16")), xp=xp)
    return model, get_tokenizer(pre.tokenizer), pre.meta


__all__ = ["load_for_sampling", "prompt_ids", "sampling_settings"]
