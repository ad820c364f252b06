"""Text from a checkpoint: prompts, the sampling settings, and a model loaded only from sound weights.

``load_for_sampling(path)`` reads a checkpoint of any ``--arch`` (``train --resume``'s reader, without the
optimizer state; ``pretrained.py``) or a Hugging Face GPT-2 or Llama directory, and refuses, in one line naming the
file, weights that hold inf/nan (a damaged file or a diverged run) or do not fit the model configuration stored with
them; ``sampling_settings`` refuses a temperature, top-k or seed that cannot work and ``prompt_ids`` a prompt that
cannot (``train`` checks both for its end-of-run sample before it trains: ``check_run_sample``).
"""

from __future__ import annotations

import math

import numpy as np

from ..checks import check_token_ids, is_integer
from .checkpoint import CheckpointError
from .config import ConfigError
from .pretrained import build_model, load_pretrained
from .tokenizers import get_tokenizer

# below this, softmax(logits / temperature) is one token in effect (a logit gap of 1e-4 becomes e^-100), and
# further down logits / temperature overflows to inf and the probabilities to nan: 0 is greedy sampling
MIN_TEMPERATURE = 1e-6


def prompt_ids(tokenizer, prompt: str | None, vocab_size: int | None = None) -> list[int]:
    """Token ids of a prompt. ``None``: a default ('def ' for bytes, <|endoftext|> for GPT-2).
    A GPT-2 prompt may also be given as comma-separated ids ('ids:50256,464'). A ConfigError for text that is
    not UTF-8 (a shell passes other bytes through), no token, or an id outside ``[0, vocab_size)`` (default: the
    tokenizer's vocabulary)."""
    vocab_size = vocab_size or tokenizer.vocab_size
    if prompt is None:
        return tokenizer.encode("def ") if tokenizer.name == "bytes" else [50256]
    if prompt.startswith("ids:"):
        try:
            ids = [int(t) for t in prompt[4:].split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt ids:... must be comma-separated integers, got {prompt!r}") from None
        if not ids:
            raise ConfigError("--prompt ids: holds no token id (e.g. ids:50256,464)")
    else:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
            ch = ord(prompt[e.start])
            what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"U+{ch:04X}"
            raise ConfigError(f"--prompt is not valid UTF-8 text ({what} at character {e.start}); give UTF-8 text "
                              "or token ids (ids:...)") from None
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("--prompt is empty: give some text, or token ids (ids:...)")
    try:
        return check_token_ids(ids, vocab_size, "--prompt")
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def sampling_settings(temperature: float, top_k: int | None, seed: int | None = None):
    """ConfigError for a temperature that is not 0 or a number >= MIN_TEMPERATURE (nan, inf and underflow
    included), a top-k below 1, or a seed that is not an integer >= 0."""
    ok = isinstance(temperature, (int, float)) and math.isfinite(temperature)
    if not ok or temperature < 0:
        raise ConfigError(f"--temperature must be a number >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ConfigError(f"--temperature {temperature:g} is below {MIN_TEMPERATURE:g}, where the probabilities "
                          "underflow to a single token (or to nan): give 0 for greedy sampling")
    if top_k is not None and (not is_integer(top_k) or top_k < 1):
        raise ConfigError(f"--top-k must be an integer >= 1, got {top_k}")
    if seed is not None and (not is_integer(seed) or seed < 0):
        raise ConfigError(f"--seed must be an integer >= 0, got {seed}")


def check_run_sample(cfg, tokenizer, vocab_size: int):
    """The settings of the sample a run writes at its end (``TrainConfig``: prompt, temperature, top-k, seed),
    checked before it trains: a bad prompt must not wait for a finished run to be refused."""
    if cfg.sample_tokens:
        sampling_settings(cfg.temperature, cfg.top_k, cfg.seed)
        prompt_ids(tokenizer, cfg.prompt, vocab_size)


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


__all__ = ["MIN_TEMPERATURE", "check_run_sample", "load_for_sampling", "prompt_ids", "sampling_settings"]
