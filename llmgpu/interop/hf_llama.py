"""Hugging Face ``LlamaForCausalLM`` directories in and out: the configuration and the tensors (chapter 10).

The tensors need no translation: llmgpu's ``Llama`` uses Hugging Face's names and ``nn.Linear`` layouts
(``model/llama_config.py``), so a file maps one to one. What is checked: every weight is there with the shape
``config.json`` gives it, nothing else is (the ``rotary_emb.inv_freq`` buffers older versions saved are not
weights: skipped), and a tied LM head (``tie_word_embeddings``) is the token embedding when the file carries
``lm_head.weight`` at all (``save_pretrained`` leaves it out).

The configuration maps one to one (``max_position_embeddings`` is the block size) once it is checked to be the
function ``Llama`` computes: SiLU-gated MLP, plain RoPE (no ``rope_scaling``: Llama 3.1's "llama3" scaling,
linear, dynamic NTK, YaRN ... change the rotation angles), no biases, head dimension hidden_size / heads, full
causal attention (no sliding window). ``pretraining_tp`` is accepted whatever its value: transformers 4.3x
used it to split the projections into slices whose products are summed (the same function, other rounding);
later versions ignore it. transformers 5 writes the RoPE settings as ``rope_parameters`` (``rope_type``,
``rope_theta``), 4.x as ``rope_theta`` and ``rope_scaling``: both are read.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..checks import is_integer
from ..model.llama_config import BUFFERS, EMBED, LM_HEAD, LlamaConfig, llama_param_shapes
from . import safetensors as st
from .hf_files import (
    WEIGHTS_FILE,
    InteropError,
    as_float32,
    config_with_defaults,
    eot_token_id,
    publish,
    write_config_and_info,
)

ARCHITECTURES = ("LlamaForCausalLM",)
ACTIVATIONS = ("silu", "swish")  # both SiLU in transformers' ACT2FN
# transformers' LlamaConfig defaults (configuration_llama.py, 4.4x and 5.x): what a config.json that leaves a key
# out means. num_key_value_heads None: one K/V head per query head; rope_theta: PreTrainedConfig.default_theta.
HF_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
                   rope_parameters=None, attention_bias=False, mlp_bias=False, head_dim=None, pretraining_tp=1)


def llama_config_from_hf(hf: dict, where="config.json") -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face Llama ``config.json`` (a dict), after checking that llmgpu's ``Llama``
    computes the same function; an ``InteropError`` naming ``where`` and the key otherwise."""
    def bad(msg):
        raise InteropError(f"{where}: {msg}")

    c = config_with_defaults(hf, where, HF_DEFAULTS, "llama", ARCHITECTURES, arch_hint=" for Llama")
    if c["hidden_act"] not in ACTIVATIONS:
        bad(f"hidden_act {c['hidden_act']!r}: llmgpu's Llama MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if c[key] is not None and not isinstance(c[key], bool):  # "false" is a true value to Python
            bad(f"{key} {c[key]!r} is not true or false")
        if c[key]:
            bad(f"{key} true: llmgpu's Llama has no biases")
    if c.get("sliding_window") is not None:
        bad(f"sliding_window {c['sliding_window']}: llmgpu's Llama attends to every earlier position")
    heads, width = c["num_attention_heads"], c["hidden_size"]
    if c["head_dim"] is not None and not is_integer(c["head_dim"]):
        bad(f"head_dim {c['head_dim']!r} is not a whole number")
    if c["head_dim"] is not None and isinstance(heads, int) and heads > 0 and c["head_dim"] != width // heads:
        bad(f"head_dim {c['head_dim']!r}: llmgpu's Llama has head_dim hidden_size / num_attention_heads = "
            f"{width // heads}")
    theta = _rope_theta(c, bad)
    eps = c["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        bad(f"rms_norm_eps {eps!r} is not a positive number")
    try:
        return LlamaConfig(n_layer=c["num_hidden_layers"], n_head=heads,
                           n_kv_head=heads if c["num_key_value_heads"] is None else c["num_key_value_heads"],
                           n_embd=width, ffn_dim=c["intermediate_size"], vocab_size=c["vocab_size"],
                           block_size=c["max_position_embeddings"], rope_theta=theta, norm_eps=eps,
                           tie_embeddings=c["tie_word_embeddings"], pad_vocab_to=0)
    except (TypeError, ValueError) as e:
        bad(f"not a usable Llama shape ({e})")


def _rope_theta(c: dict, bad) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5; its theta wins, as there) or ``rope_theta``; any
    rope type but 'default' (plain RoPE) is refused, and so is rotating part of each head only."""
    theta = c["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        p = c[key]
        if p is None:
            continue
        if not isinstance(p, dict):
            bad(f"{key} {p!r} is not a JSON object")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            bad(f"{key} of rope_type {kind!r}: llmgpu's Llama rotates by plain RoPE (rope_scaling null)")
        theta = p.get("rope_theta", theta)
    factor = c.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        bad(f"partial_rotary_factor {factor!r} is not a number")
    if factor != 1.0:
        bad(f"partial_rotary_factor {factor!r}: llmgpu's Llama rotates the whole head")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        bad(f"rope_theta {theta!r} is not a positive number")
    return float(theta)


def llama_config_to_hf(cfg: LlamaConfig, *, tokenizer: str | None = None, bos_token_id=None,
                       eos_token_id=None) -> dict:
    """``config.json`` of ``cfg`` for ``transformers.LlamaForCausalLM`` (the unpadded vocabulary; no dropout, as
    llmgpu trains without it). BOS/EOS: those given (a Hugging Face source's), else the tokenizer's
    end-of-text token where it has one (``hf_files.eot_token_id``), else null."""
    eot = eot_token_id(tokenizer, cfg.vocab_size)
    return {
        "model_type": "llama", "architectures": list(ARCHITECTURES),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.block_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": 0.02, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "bos_token_id": eot if bos_token_id is None else bos_token_id,
        "eos_token_id": eot if eos_token_id is None else eos_token_id,
        "torch_dtype": "float32",
    }  # fmt: skip


def hf_to_llama(tensors: dict, cfg: LlamaConfig, *, where="model.safetensors") -> dict:
    """fp32 NumPy weights of ``Llama`` (Hugging Face names: the same; the vocabulary unpadded; no
    ``lm_head.weight`` when tied) from a Hugging Face Llama state dict. Unknown, missing or misshapen tensors are an
    ``InteropError`` naming one of them."""
    want = llama_param_shapes(replace(cfg, pad_vocab_to=0))
    out, head = {}, None
    for k, v in tensors.items():
        if k.endswith(BUFFERS):
            continue
        if k == LM_HEAD and cfg.tie_embeddings:
            head = v
            continue
        if k not in want:
            raise InteropError(f"{where}: unknown tensor {k!r} (not a weight of a Llama with {cfg.n_layer} layers, "
                               f"{'a tied' if cfg.tie_embeddings else 'an untied'} LM head)")
        a = as_float32(v, k, where)
        if a.shape != want[k]:
            raise InteropError(f"{where}: {k!r} has shape {tuple(a.shape)}, the config makes it {want[k]}")
        out[k] = a
    missing = [n for n in want if n not in out]
    if missing == [LM_HEAD]:
        raise InteropError(f"{where}: tie_word_embeddings is false and there is no {LM_HEAD!r}")
    if missing:
        raise InteropError(f"{where}: {len(missing)} weight(s) missing, e.g. {missing[0]!r}")
    if head is not None and not np.array_equal(as_float32(head, LM_HEAD, where), out[EMBED]):
        raise InteropError(f"{where}: {LM_HEAD!r} differs from {EMBED!r}, which tie_word_embeddings true makes it")
    return out


def llama_to_hf(weights: dict, cfg: LlamaConfig) -> dict:
    """Hugging Face ``LlamaForCausalLM`` tensors (fp32, the unpadded vocabulary, a tied ``lm_head.weight`` left out
    as ``save_pretrained`` does) from ``Llama`` weights (``state_dict()``, padded or not)."""
    want = llama_param_shapes(replace(cfg, pad_vocab_to=0))
    out = {}
    for name, shape in want.items():
        if name not in weights:
            raise InteropError(f"the weights lack {name!r}")
        a = np.asarray(weights[name], dtype=np.float32)
        if name in (EMBED, LM_HEAD):
            a = a[: cfg.vocab_size]
        if a.shape != shape:
            raise InteropError(f"{name!r} has shape {a.shape}, the configuration makes it {shape}")
        out[name] = np.ascontiguousarray(a)
    return out


def export_llama_hf(d: Path, cfg: LlamaConfig, weights: dict, *, tokenizer: str | None = None,
                    info: dict | None = None):
    """Write ``config.json``, ``model.safetensors`` and ``llmgpu.json`` (the tokenizer and ``info``) of a Llama
    into the directory ``d`` (``hf.export_hf``). ``info``'s ``bos_token_id``/``eos_token_id`` go to config.json."""
    info = info or {}
    tensors = llama_to_hf(weights, cfg)
    config = llama_config_to_hf(cfg, tokenizer=tokenizer, bos_token_id=info.get("bos_token_id"),
                                eos_token_id=info.get("eos_token_id"))
    publish(d / WEIGHTS_FILE, lambda p: st.save_file(p, tensors, {"format": "pt"}))
    write_config_and_info(d, config, {"tokenizer": tokenizer, **info})
    return d


__all__ = ["ACTIVATIONS", "ARCHITECTURES", "HF_DEFAULTS", "export_llama_hf", "hf_to_llama", "llama_config_from_hf",
           "llama_config_to_hf", "llama_to_hf"]
