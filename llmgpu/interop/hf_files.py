"""A Hugging Face model directory as files, whatever the architecture: ``config.json``, the weights, ``llmgpu.json``.

A directory as ``transformers``' ``save_pretrained`` writes it holds ``config.json`` and ``model.safetensors``
(older ones ``pytorch_model.bin``; large ones ``model-0000k-of-0000n.safetensors`` with an index,
``model.safetensors.index.json``, whose ``weight_map`` names the shard of each tensor). This module reads those
files into one dict of tensors and writes files atomically; what the names and the configuration mean is the
architecture's (``hf.py``: GPT-2, ``hf_llama.py``: Llama). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from . import safetensors as st

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, TORCH_FILE = ("config.json", "model.safetensors", "model.safetensors.index.json",
                                                     "pytorch_model.bin")
INFO_FILE = "llmgpu.json"  # what an export knows that config.json cannot say (the tokenizer, the run)
GPT2_EOT = 50256  # <|endoftext|>: the BOS and EOS token of GPT-2's tokenizer (llmgpu's 'gpt2')


class InteropError(ValueError):
    """A model directory llmgpu cannot import or write (one-line message naming the file)."""


def is_hf_dir(path) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory: a ``config.json`` with a ``model_type`` or
    next to weights (an llmgpu run directory has a ``config.json`` too: its configuration record)."""
    p = Path(path)
    if not (p / CONFIG_FILE).exists() or (p / "meta.json").is_file():
        return False
    if any((p / f).is_file() for f in (WEIGHTS_FILE, INDEX_FILE, TORCH_FILE)):
        return True  # check_hf_dir then says what is wrong with a config.json that is not a file
    try:
        return "model_type" in json.loads((p / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_hf_dir(path) -> Path:
    """``path`` as a local directory holding a ``config.json``, or an ``InteropError`` saying what it is."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise InteropError(f"{d} is not a directory: llmgpu reads local model directories and never downloads "
                           "(fetch one first, e.g. huggingface-cli download openai-community/gpt2 --local-dir gpt2)")
    if not (d / CONFIG_FILE).is_file():
        raise InteropError(f"{d / CONFIG_FILE} is not a file: not a Hugging Face model directory" if
                           (d / CONFIG_FILE).exists() else f"{d} holds no {CONFIG_FILE}: not a Hugging Face model "
                           "directory")
    return d


def read_hf_config(path) -> dict:
    f = Path(path) / CONFIG_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{f} is not readable JSON ({type(e).__name__}: {e})") from None


def read_info(d: Path) -> dict:
    """What ``llmgpu.json`` holds (an llmgpu export), else {}."""
    if not (d / INFO_FILE).is_file():
        return {}
    try:
        info = json.loads((d / INFO_FILE).read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{d / INFO_FILE} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(info, dict):
        raise InteropError(f"{d / INFO_FILE} is not a JSON object (it holds a {type(info).__name__})")
    return info


def read_weights(d: Path) -> tuple[dict, list[Path]]:
    """(every tensor of the directory by its name, as stored; the files read): ``model.safetensors``, else the
    shards an index names, else ``pytorch_model.bin``."""
    if (d / WEIGHTS_FILE).is_file():
        files = [d / WEIGHTS_FILE]
    elif (d / INDEX_FILE).is_file():
        return _read_shards(d / INDEX_FILE)
    elif (d / TORCH_FILE).is_file():
        files = [d / TORCH_FILE]
    else:
        raise InteropError(f"{d} holds no weights ({WEIGHTS_FILE}, {INDEX_FILE} or {TORCH_FILE})")
    tensors = {}
    for f in files:
        tensors.update(_read_torch(f) if f.suffix == ".bin" else _read_st(f))
    return tensors, files


def where_weights(d: Path, files: list[Path]):
    """How an error names the weights: their file, or the directory of a sharded model (read as one)."""
    return files[0] if len(files) == 1 else d


def config_with_defaults(hf, where, defaults: dict, model_type: str, architectures: tuple, *, type_hint: str = "",
                         arch_hint: str = "") -> dict:
    """A ``config.json`` dict with the family's ``transformers`` defaults filled in, once it is a JSON object of
    ``model_type`` whose ``architectures`` are among ours (what every family checks first); an ``InteropError``
    naming ``where`` otherwise (``type_hint``, ``arch_hint``: what each message adds)."""
    if not isinstance(hf, dict):
        raise InteropError(f"{where}: is not a JSON object")
    c = {**defaults, **hf}
    if c.get("model_type") != model_type:
        raise InteropError(f"{where}: model_type {c.get('model_type')!r} is not {model_type!r}{type_hint}")
    names = c.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):  # a string would read as letters
        raise InteropError(f"{where}: architectures {names!r} is not a list of strings: write it as "
                           f'["{architectures[0]}"]')
    other = [a for a in names if a not in architectures]
    if other:
        raise InteropError(f"{where}: architecture {other[0]} is not supported (llmgpu imports "
                           f"{' or '.join(architectures)}{arch_hint})")
    return c


def as_float32(v, key, where) -> np.ndarray:
    """A stored tensor as fp32 NumPy (bf16 and fp16 widened exactly); integer or bool tensors are refused."""
    if hasattr(v, "detach") and hasattr(v, "cpu"):  # a torch tensor, without importing torch
        if not v.is_floating_point():
            raise InteropError(f"{where}: {key!r} holds {v.dtype}, not floating-point weights")
        return v.detach().float().cpu().numpy()
    a = np.asarray(v)
    if a.dtype.kind != "f" and a.dtype != st.DTYPES["BF16"]:
        raise InteropError(f"{where}: {key!r} holds {a.dtype}, not floating-point weights")
    return a.astype(np.float32)


def eot_token_id(tokenizer: str | None, vocab_size: int) -> int | None:
    """The BOS/EOS token id a ``config.json`` names for llmgpu's tokenizer: GPT-2's <|endoftext|> when the
    vocabulary has it; None where llmgpu's tokenizer has none (bytes)."""
    return GPT2_EOT if tokenizer == "gpt2" and vocab_size > GPT2_EOT else None


def _read_st(f: Path) -> dict:
    try:
        return st.load_file(f)
    except st.SafetensorsError as e:
        raise InteropError(str(e)) from None


def _read_shards(index: Path) -> tuple[dict, list[Path]]:
    """``read_weights`` of a sharded model: every shard its index names, each tensor where the index puts it and
    in no other shard (a copy in a second shard would win or lose by the order of reading, silently)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InteropError(f"{index} is not a readable safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
        raise InteropError(f"{index}: its weight_map must be a non-empty JSON object from each tensor's name to the "
                           "file name of its shard in this directory")
    files = [index.parent / n for n in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise InteropError(f"{index} names {f.name}, which is missing")
    tensors, found_in = {}, {}
    for f in files:
        for name, t in _read_st(f).items():
            if name in found_in:
                raise InteropError(f"{name!r} is stored twice, in {found_in[name].name} and in {f.name}: a damaged "
                                   "or mixed sharded model")
            tensors[name], found_in[name] = t, f
    for name, f in found_in.items():
        if weight_map.get(name, f.name) != f.name:
            raise InteropError(f"{index} puts {name!r} in {weight_map[name]}, but {f.name} holds it")
    absent = [n for n in weight_map if n not in found_in]
    if absent:
        raise InteropError(f"{index} names {len(absent)} tensor(s) that no shard holds ({absent[0]!r} in "
                           f"{weight_map[absent[0]]}, ...)")
    return tensors, files


def _read_torch(f: Path) -> dict:
    try:
        import torch
    except ImportError:
        raise InteropError(f"{f} is a PyTorch pickle, which needs PyTorch to read (pip install torch), or save the "
                           "model as model.safetensors (save_pretrained(..., safe_serialization=True))") from None
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign pickle
        raise InteropError(f"{f} cannot be read by torch.load ({type(e).__name__}: {e})") from None


def publish(path: Path, write):
    """``write(tmp)`` to a temporary name beside ``path``, then rename it into place (no half-written file); an
    OSError names ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a full disk's error names no file: this one
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        if tmp.exists():
            tmp.unlink()


def write_config_and_info(d: Path, config: dict, info: dict):
    """``llmgpu.json`` then ``config.json`` (last: a directory with a config.json is a model directory)."""
    publish(d / INFO_FILE, lambda p: p.write_text(json.dumps(info, indent=1)))
    publish(d / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2)))


__all__ = ["CONFIG_FILE", "GPT2_EOT", "INDEX_FILE", "INFO_FILE", "TORCH_FILE", "WEIGHTS_FILE", "InteropError",
           "as_float32", "check_hf_dir", "eot_token_id", "is_hf_dir", "publish", "read_hf_config", "read_info",
           "read_weights", "where_weights", "write_config_and_info"]
