"""Checkpoints on disk: ``.npz`` arrays plus a JSON file, written atomically.

A checkpoint is a directory::

    model.npz    fp32 weights under nanoGPT's names (np.load(...) is a state_dict PyTorch can take)
    optim.npz    AdamW's moments, keys 'm/<name>' and 'v/<name>'
    meta.json    everything else: model config, step, optimizer step count and hyperparameters,
                 loss-scaler state, data-loader position, RNG state, the training configuration

Why ``.npz`` and not safetensors: NumPy already writes and reads it (no new dependency), it memory-
maps nothing we need, and every array here is a plain fp32 tensor; ``np.load`` gives a name → array
dict that ``torch.from_numpy`` turns into a PyTorch state_dict in one line.

Writes go to ``<dir>.tmp`` first and replace ``<dir>`` with one rename, so an interrupted save never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMAT = "llmgpu-checkpoint-1"
MODEL_FILE, OPTIM_FILE, META_FILE = "model.npz", "optim.npz", "meta.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read (one-line message for the CLI)."""


def _savez(path: Path, arrays: dict):
    with open(path, "wb") as f:  # a file object: np.savez would append '.npz' to a str path
        np.savez(f, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})


def save_checkpoint(directory, *, model: dict, meta: dict, optim: dict | None = None) -> Path:
    """Write a checkpoint directory atomically. ``model``/``optim``: name → NumPy array."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _savez(tmp / MODEL_FILE, model)
    if optim is not None:
        _savez(tmp / OPTIM_FILE, optim)
    (tmp / META_FILE).write_text(json.dumps({"format": FORMAT, **meta}, indent=1, default=_json_default) + "\n")
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    return final


def find_checkpoint(path) -> Path:
    """The checkpoint directory for ``path``: the directory itself, or its ``checkpoint/`` subdirectory
    (a run's output directory)."""
    p = Path(path).expanduser()
    for cand in (p, p / "checkpoint"):
        if (cand / META_FILE).is_file() and (cand / MODEL_FILE).is_file():
            return cand
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    raise CheckpointError(f"{p} holds no llmgpu checkpoint ({META_FILE} + {MODEL_FILE}, or a checkpoint/ "
                          "directory with them)")


def load_checkpoint(path, *, with_optim: bool = True) -> tuple[dict, dict, dict | None]:
    """(model arrays, meta, optim arrays or None) of the checkpoint at ``path``."""
    d = find_checkpoint(path)
    try:
        meta = json.loads((d / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{d / META_FILE} is not readable JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{d} has format {meta.get('format')!r}, expected {FORMAT!r}")
    model = _load_npz(d / MODEL_FILE)
    optim = _load_npz(d / OPTIM_FILE) if with_optim and (d / OPTIM_FILE).is_file() else None
    return model, meta, optim


def _load_npz(path: Path) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable .npz file ({e})") from None


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
