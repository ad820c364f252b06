"""A model from an llmgpu run of any family (``--arch``): what ``llmgpu sample`` and ``llmgpu eval`` load.

``pretrained.load_pretrained`` / ``build_model`` read GPT-2 runs and Hugging Face GPT-2 directories. A run of another
family (its checkpoint's ``model_config`` names its ``"arch"``) is read here the same way: the checkpoint without its
optimizer state, weights with inf/nan refused in one line naming the file, the configuration of its family
(``model.family.config_from_dict``), the vocabulary's padded rows dropped, and the family's book-step model.

The seam for the Hugging Face Llama interop (``pretrained.py``): once ``load_pretrained`` reads the configuration
with ``config_from_dict`` and ``build_model`` builds ``model_class(config)``, ``load_run_or_pretrained`` and
``build_run_model`` become those two calls.
"""

from __future__ import annotations

import json

from ..model.family import config_from_dict, model_class
from .checkpoint import META_FILE, CheckpointError, find_checkpoint, load_checkpoint, model_file, non_finite
from .pretrained import Pretrained, build_model, load_pretrained


def run_arch(path) -> str | None:
    """The family of the llmgpu run or checkpoint at ``path`` ("gpt2" for a checkpoint from before --arch), or None
    where ``path`` holds no readable llmgpu checkpoint (a Hugging Face directory: ``load_pretrained``'s business)."""
    try:
        meta = json.loads((find_checkpoint(path) / META_FILE).read_text())
        return meta["model_config"].get("arch", "gpt2")
    except (CheckpointError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_run_or_pretrained(path) -> Pretrained:
    """``pretrained.load_pretrained(path)``, also for the runs of families other than GPT-2."""
    if run_arch(path) in (None, "gpt2"):
        return load_pretrained(path)
    weights, meta, _ = load_checkpoint(path, with_optim=False)
    d = find_checkpoint(path)
    bad = non_finite(weights)
    if bad:
        raise CheckpointError(f"{model_file(d)} holds inf/nan weights ({bad}): the run diverged; use an earlier "
                              "checkpoint")
    try:
        cfg = config_from_dict(meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d} has no usable model configuration ({type(e).__name__}: {e})") \
            from None
    embedding = model_class(cfg).embedding_name  # its padded rows are zeros (and the untied head's): a model of
    for name in {embedding, "lm_head.weight"} & set(weights):  # another padding adds its own
        weights[name] = weights[name][: cfg.vocab_size]
    return Pretrained(cfg, weights, meta.get("tokenizer", "bytes"), "llmgpu", d,
                      f"llmgpu {cfg.arch} run {d} (step {meta['step']})", meta)


def build_run_model(pre: Pretrained, *, dtype="fp32", xp=None):
    """``pretrained.build_model(pre)`` (the book step), for a configuration of any family."""
    if pre.config.arch == "gpt2":
        return build_model(pre, dtype=dtype, xp=xp)
    model = model_class(pre.config)(pre.config, dtype=dtype, xp=xp, init=False)
    try:
        model.load_state_dict(pre.weights)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{pre.path}: the weights do not fit their model configuration ({type(e).__name__}: "
                              f"{e})") from None
    return model


__all__ = ["build_run_model", "load_run_or_pretrained", "run_arch"]
