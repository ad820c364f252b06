"""Hugging Face model directories in and out: ``load_hf`` and ``export_hf`` for GPT-2 and Llama; GPT-2's mapping.

``load_hf`` reads the directory's files (``hf_files.py``: ``config.json``, one safetensors file or shards with an
index, or a PyTorch pickle) and dispatches on config.json's ``model_type``: 'llama' goes to ``hf_llama.py``
(``LlamaForCausalLM``: a ``LlamaConfig``, names as they are), anything else to GPT-2's mapping here. ``export_hf``
dispatches on the configuration's type.

A GPT-2 directory's tensors are nanoGPT's, with three differences:

* the four projection matrices of a block (``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``)
  are ``Conv1D`` weights ``[in, out]`` (``y = x W + b``) where nanoGPT's ``nn.Linear`` and llmgpu keep
  ``[out, in]``: they are transposed on the way in and on the way out;
* the causal-mask buffers ``attn.bias`` and ``attn.masked_bias`` (saved by older versions) are not
  weights, and ``lm_head.weight`` is the token embedding (tied) when it is there at all;
* ``GPT2LMHeadModel`` files prefix the names with ``transformer.``; ``GPT2Model`` files (the hub's
  ``openai-community/gpt2``) do not.

The configuration maps one to one (``n_positions`` is the block size) once the architecture is checked
to be the one llmgpu computes: tanh-approximated GELU (``gelu_new``), an MLP of width 4C, LayerNorm
epsilon 1e-5, attention scaled by 1/sqrt(head dim), a tied LM head. Anything else is refused with one
line (``InteropError``) rather than imported into a model that computes something different. Nothing is
ever downloaded: a path that is not a local directory says so.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..model.config import WTE, GPTConfig, param_shapes
from ..model.llama_config import LlamaConfig
from . import safetensors as st
from .hf_files import (
    CONFIG_FILE,
    GPT2_EOT,
    INDEX_FILE,
    INFO_FILE,
    TORCH_FILE,
    WEIGHTS_FILE,
    InteropError,
    as_float32,
    check_hf_dir,
    config_with_defaults,
    eot_token_id,
    is_hf_dir,
    publish,
    read_hf_config,
    read_info,
    read_weights,
    where_weights,
    write_config_and_info,
)
from .hf_llama import export_llama_hf, hf_to_llama, llama_config_from_hf, llama_config_to_hf

NANOGPT_FILE = "nanogpt.safetensors"  # the export's second copy: nanoGPT names and nn.Linear layout
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = (".attn.bias", ".attn.masked_bias")
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation our GELU computes
LAYER_NORM_EPSILON = 1e-5  # ops.layernorm_forward's default, which both models use
# GPT2Config's defaults: what a config.json that leaves a key out means
HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                   activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                   scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True)


# --------------------------------------------------------------------------- configuration


def config_from_hf(hf: dict, where="config.json") -> GPTConfig:
    """The ``GPTConfig`` of a Hugging Face GPT-2 ``config.json`` (a dict), after checking that llmgpu's model
    computes the same function; an ``InteropError`` naming ``where`` and the key otherwise."""
    def bad(msg):
        raise InteropError(f"{where}: {msg}")

    c = config_with_defaults(hf, where, HF_DEFAULTS, "gpt2", ARCHITECTURES,
                             type_hint=": llmgpu imports GPT-2 ('gpt2') and Llama ('llama') models")
    if c["activation_function"] not in ACTIVATIONS:
        bad(f"activation_function {c['activation_function']!r}: llmgpu's GELU is the tanh approximation "
            f"({' or '.join(ACTIVATIONS)})")
    if c["n_inner"] not in (None, 4 * c["n_embd"]) or isinstance(c["n_inner"], bool):
        bad(f"n_inner {c['n_inner']!r}: llmgpu's MLP is 4 * n_embd = {4 * c['n_embd']!r} wide")
    eps = c["layer_norm_epsilon"]
    if not isinstance(eps, (int, float)) or not math.isclose(eps, LAYER_NORM_EPSILON, rel_tol=1e-6):
        bad(f"layer_norm_epsilon {eps!r}: llmgpu's LayerNorm uses {LAYER_NORM_EPSILON}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", None)):
        if not isinstance(c[key], bool):  # "false" would read as true
            bad(f"{key} must be true or false, got {c[key]!r}")
        if want is not None and c[key] != want:
            bad(f"{key} {c[key]}: llmgpu's attention has {key} {want}")
    try:
        return GPTConfig(n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], vocab_size=c["vocab_size"],
                         block_size=c["n_positions"])
    except (TypeError, ValueError) as e:
        bad(f"not a usable GPT-2 shape ({e})")


def config_to_hf(cfg: GPTConfig, *, tokenizer: str | None = None) -> dict:
    """``config.json`` of ``cfg`` for ``transformers.GPT2LMHeadModel`` (the unpadded vocabulary; no dropout,
    as llmgpu trains without it; GPT-2's <|endoftext|> as BOS/EOS when the vocabulary has it)."""
    eot = eot_token_id(tokenizer, cfg.vocab_size)
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "bos_token_id": eot, "eos_token_id": eot,
        "torch_dtype": "float32",
    }  # fmt: skip


# --------------------------------------------------------------------------- tensors


def _is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


def hf_to_nanogpt(tensors: dict, cfg: GPTConfig, *, tied: bool = True, where="model.safetensors") -> dict:
    """nanoGPT-named fp32 NumPy weights (``[out, in]`` matrices, no ``lm_head.weight``) from a Hugging Face
    GPT-2 state dict: names normalized, Conv1D weights transposed, buffers dropped, the LM head checked to be
    the token embedding. Unknown, missing or misshapen tensors are an ``InteropError`` naming one of them."""
    want = param_shapes(cfg)
    out, head = {}, None
    for k, v in tensors.items():
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        if name.endswith(BUFFERS):  # the causal mask, not a weight
            continue
        if name == "lm_head.weight":
            head = v
            continue
        name = "transformer." + name
        if name not in want:
            raise InteropError(f"{where}: unknown tensor {k!r} (not a weight of a GPT-2 LM with {cfg.n_layer} layers)")
        a = as_float32(v, k, where)
        if _is_conv1d(name):
            a = np.ascontiguousarray(a.T)  # Conv1D [in, out] -> nn.Linear [out, in]
        if a.shape != want[name]:
            shown = want[name][::-1] if _is_conv1d(name) else want[name]
            raise InteropError(f"{where}: {k!r} has shape {tuple(v.shape)}, the config makes it {shown}")
        out[name] = a
    missing = [n for n in want if n not in out]
    if missing:
        raise InteropError(f"{where}: {len(missing)} weight(s) missing, e.g. {missing[0]!r}")
    if head is not None:
        if not np.array_equal(as_float32(head, "lm_head.weight", where), out[WTE]):
            raise InteropError(f"{where}: lm_head.weight differs from the token embedding (an untied LM head): "
                               "llmgpu's GPT-2 ties them")
    elif not tied:
        raise InteropError(f"{where}: tie_word_embeddings is false and there is no lm_head.weight: llmgpu's GPT-2 "
                           "ties the LM head to the token embedding")
    return out


def nanogpt_to_hf(weights: dict, cfg: GPTConfig) -> dict:
    """Hugging Face ``GPT2LMHeadModel`` tensors (``transformer.`` names, Conv1D layout, the unpadded vocabulary,
    the tied ``lm_head.weight`` left out as ``save_pretrained`` does) from nanoGPT-named fp32 weights."""
    want = param_shapes(GPTConfig.from_dict({**cfg.as_dict(), "pad_vocab_to": 0}))
    out = {}
    for name, shape in want.items():
        if name not in weights:
            raise InteropError(f"the weights lack {name!r}")
        a = np.asarray(weights[name], dtype=np.float32)
        if name == WTE:
            a = a[: cfg.vocab_size]
        if a.shape != shape:
            raise InteropError(f"{name!r} has shape {a.shape}, the configuration makes it {shape}")
        out[name] = np.ascontiguousarray(a.T if _is_conv1d(name) else a)
    return out


# --------------------------------------------------------------------------- directories


def load_hf(path) -> tuple[GPTConfig | LlamaConfig, dict, dict]:
    """(configuration, fp32 NumPy weights, info) of a local Hugging Face GPT-2 or Llama directory: for GPT-2 a
    ``GPTConfig`` and nanoGPT-named weights, for Llama (``model_type`` 'llama') a ``LlamaConfig`` and its own
    names (``hf_llama.py``); the vocabulary unpadded.

    ``info``: ``tokenizer`` ('gpt2' for GPT-2's 50257-token vocabulary or what an llmgpu export recorded, else
    None), ``weights_file``, a Llama's ``bos_token_id``/``eos_token_id`` where config.json names them, and what
    ``llmgpu.json`` holds when llmgpu wrote the directory."""
    d = check_hf_dir(path)
    hf = read_hf_config(d)
    llama = isinstance(hf, dict) and hf.get("model_type") == "llama"
    cfg = llama_config_from_hf(hf, d / CONFIG_FILE) if llama else config_from_hf(hf, d / CONFIG_FILE)
    tensors, files = read_weights(d)
    where = where_weights(d, files)
    info = {"weights_file": str(files[0]), "tokenizer": None}
    if llama:
        weights = hf_to_llama(tensors, cfg, where=where)
        info.update({k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None})
    else:
        weights = hf_to_nanogpt(tensors, cfg, tied=hf.get("tie_word_embeddings", True), where=where)  # a bool: checked
        info["tokenizer"] = "gpt2" if cfg.vocab_size == 50257 else None
    info.update(read_info(d))
    return cfg, weights, info


def export_hf(directory, cfg: GPTConfig | LlamaConfig, weights: dict, *, tokenizer: str | None = None,
              info: dict | None = None):
    """Write a directory ``transformers``' ``from_pretrained`` loads. GPT-2 (``GPT2LMHeadModel``): ``config.json``
    and ``model.safetensors`` (Hugging Face names, Conv1D layout, fp32, unpadded vocabulary), plus
    ``nanogpt.safetensors`` (nanoGPT names, ``[out, in]`` matrices) and ``llmgpu.json`` (the tokenizer and
    ``info``). Llama (``LlamaForCausalLM``): the same without the nanoGPT copy (``hf_llama.export_llama_hf``). Each
    file is written to a temporary name and renamed into place."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(cfg, LlamaConfig):
        return export_llama_hf(d, cfg, weights, tokenizer=tokenizer, info=info)
    hf = nanogpt_to_hf(weights, cfg)
    raw = {n: (a.T if _is_conv1d(n) else a) for n, a in hf.items()}  # back to [out, in] (views)
    publish(d / WEIGHTS_FILE, lambda p: st.save_file(p, hf, {"format": "pt"}))
    publish(d / NANOGPT_FILE, lambda p: st.save_file(p, raw, {"format": "pt", "layout": "nanoGPT [out, in]"}))
    write_config_and_info(d, config_to_hf(cfg, tokenizer=tokenizer), {"tokenizer": tokenizer, **(info or {})})
    return d


__all__ = ["ACTIVATIONS", "ARCHITECTURES", "CONFIG_FILE", "CONV1D", "GPT2_EOT", "HF_DEFAULTS", "INDEX_FILE",
           "INFO_FILE", "LAYER_NORM_EPSILON", "NANOGPT_FILE", "TORCH_FILE", "WEIGHTS_FILE", "InteropError",
           "config_from_hf", "config_to_hf", "export_hf", "hf_to_nanogpt", "is_hf_dir", "llama_config_from_hf",
           "llama_config_to_hf", "load_hf", "nanogpt_to_hf", "read_hf_config"]
