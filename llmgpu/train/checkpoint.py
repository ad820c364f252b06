"""Checkpoints on disk: safetensors weights, ``.npz`` optimizer state and a JSON file, written atomically.

A checkpoint is a directory::

    model.safetensors    fp32 weights under nanoGPT's names and layouts (``[out, in]`` matrices): what
                         ``safetensors.numpy.load_file`` or ``safetensors.torch.load_file`` reads as a state dict
    optim.npz            AdamW's moments, keys 'm/<name>' and 'v/<name>'
    meta.json            everything else: model config, step, optimizer step count and hyperparameters,
                         loss-scaler state, data-loader position, RNG state, the tokenizer, the training configuration,
                         the attention kernels flash attention's "auto" resolved to (``attention_kernels_of``;
                         ``pin_attention_kernels`` puts them back, so a resumed run runs the same kernels) and
                         the delayed FP8 recipe's amax histories and scales (``fp8_scaling_of``)

Weights are safetensors, the format the models people share use (``interop/safetensors.py`` writes it with
NumPy); the optimizer state is only ever read back by llmgpu, so it stays in NumPy's ``.npz``. Checkpoints of
earlier versions (weights in ``model.npz``) still load.

Writes go to ``<dir>.tmp`` first (every file flushed to disk), then ``<dir>`` moves to ``<dir>.old``, the
new one takes its place and ``.old`` goes: a save that fails or is killed at any point leaves the last
complete checkpoint readable (``find_checkpoint`` falls back to ``<dir>.old`` when the swap was cut short).
Anything unreadable (a truncated file, a missing file, another format, a value of the wrong type in
``meta.json``) is a ``CheckpointError`` whose one-line message names the file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .. import backend
from ..checks import is_integer
from ..interop import safetensors
from ..ops.flash_attention import KernelChoices, choices_unavailable

FORMAT = "llmgpu-checkpoint-2"  # -1: the same with the weights in model.npz
FORMATS = ("llmgpu-checkpoint-1", FORMAT)  # what load_checkpoint reads
MODEL_FILE, OPTIM_FILE, META_FILE = "model.safetensors", "optim.npz", "meta.json"
LEGACY_MODEL_FILE = "model.npz"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read (one-line message for the CLI)."""


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _savez(path: Path, arrays: dict):
    with open(path, "wb") as f:  # a file object: np.savez would append '.npz' to a str path
        np.savez(f, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename that publishes it


def _save_weights(path: Path, arrays: dict):
    safetensors.save_file(path, arrays, {"format": "pt"})  # fsynced; "pt": what safetensors.torch expects


def _write_json(path: Path, obj: dict):
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1, default=json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(directory, *, model: dict, meta: dict, optim: dict | None = None) -> Path:
    """Write a checkpoint directory atomically. ``model``/``optim``: name → NumPy array.

    On any failure the previous checkpoint at ``directory`` is left as it was (and the partial one removed)."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = _sibling(final, ".tmp"), _sibling(final, ".old")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        _save_weights(tmp / MODEL_FILE, model)
        if optim is not None:
            _savez(tmp / OPTIM_FILE, optim)
        _write_json(tmp / META_FILE, {"format": FORMAT, **meta})  # last: a meta.json means the files are whole
        _fsync(tmp)
    except BaseException as e:  # a full disk, Ctrl-C: drop the partial copy, keep the last good one
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # say which save failed and what is left
            kept = f"the checkpoint already in {final} is kept" if _complete(final) else "no earlier checkpoint exists"
            raise CheckpointError(f"saving a checkpoint to {final} failed ({e.strerror or e}"
                                  f"{f': {e.filename}' if e.filename else ''}); {kept}") from e
        raise
    if _complete(final):
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    elif final.exists():  # a damaged checkpoint: nothing worth keeping
        shutil.rmtree(final)
    os.replace(tmp, final)  # killed between the two renames: find_checkpoint reads <dir>.old
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def _sibling(d: Path, suffix: str) -> Path:
    return d.with_name(d.name + suffix)


def model_file(d: Path) -> Path:
    """The weights file of checkpoint directory ``d``: ``model.safetensors``, or an older checkpoint's ``model.npz``."""
    d = Path(d)
    return d / LEGACY_MODEL_FILE if not (d / MODEL_FILE).exists() and (d / LEGACY_MODEL_FILE).exists() \
        else d / MODEL_FILE


def _complete(d: Path) -> bool:
    return (d / META_FILE).is_file() and model_file(d).is_file()


def find_checkpoint(path) -> Path:
    """The checkpoint directory for ``path``: the directory itself, or its ``checkpoint/`` subdirectory
    (a run's output directory); where a save was killed mid-swap, the previous one (``<dir>.old``)."""
    p = Path(path).expanduser()
    for cand in (p, p / "checkpoint"):
        if _complete(cand):
            return cand
    for cand in (p, p / "checkpoint"):
        if not cand.exists() and _complete(_sibling(cand, ".old")):
            return _sibling(cand, ".old")
    for cand in (p, p / "checkpoint"):
        if (cand / META_FILE).is_file() or model_file(cand).is_file():
            missing = cand / (MODEL_FILE if (cand / META_FILE).is_file() else META_FILE)
            raise CheckpointError(f"checkpoint {cand} is incomplete: {missing} "
                                  + ("is not a file" if missing.exists() else "is missing"))
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    raise CheckpointError(f"{p} holds no llmgpu checkpoint ({META_FILE} + {MODEL_FILE}, or a checkpoint/ "
                          "directory with them)")


# what every reader of a checkpoint relies on
REQUIRED_META = ("model_config", "step")
# the type of each value meta.json may hold (a key that is absent is the reader's business; older checkpoints
# lack some): a hand-edited or damaged file is refused here, in one line naming it, not deep inside a resume
_COUNT = ("a whole number >= 0", lambda v: is_integer(v) and v >= 0)
_OBJECT = ("a JSON object", lambda v: isinstance(v, dict))
META_TYPES = {
    "step": _COUNT, "world_size": ("a whole number >= 1", lambda v: is_integer(v) and v >= 1),
    "total_steps": ("null or a whole number >= 1", lambda v: v is None or (is_integer(v) and v >= 1)),
    "budget_fitted": ("true or false", lambda v: isinstance(v, bool)),
    "dtype": ("a string", lambda v: isinstance(v, str)), "tokenizer": ("a string", lambda v: isinstance(v, str)),
    "model_config": _OBJECT, "train_config": _OBJECT, "optimizer": _OBJECT, "scaler": _OBJECT, "data": _OBJECT,
    "rng": _OBJECT, "attention_kernels": _OBJECT, "fp8_scaling": _OBJECT,
}  # fmt: skip


def check_meta(meta: dict, path) -> dict:
    """``meta`` (a checkpoint's meta.json, read from ``path``) when every value has its type (``META_TYPES``),
    else a CheckpointError naming the file, the key and what it holds."""
    for key, (want, ok) in META_TYPES.items():
        if key in meta and not ok(meta[key]):
            raise CheckpointError(f"{path}: {key!r} must be {want}, got {type(meta[key]).__name__} {meta[key]!r} "
                                  "(a damaged or edited file)")
    return meta


def load_checkpoint(path, *, with_optim: bool = True) -> tuple[dict, dict, dict | None]:
    """(model arrays, meta, optim arrays or None) of the checkpoint at ``path``."""
    d = find_checkpoint(path)
    try:
        meta = json.loads((d / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{d / META_FILE} is not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{d / META_FILE} has format {fmt!r}, expected {FORMAT!r}")
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise CheckpointError(f"{d / META_FILE} lacks {', '.join(missing)}")
    check_meta(meta, d / META_FILE)
    weights = model_file(d)
    model = _load_npz(weights) if weights.suffix == ".npz" else _load_weights(weights)
    optim = _load_npz(d / OPTIM_FILE) if with_optim and (d / OPTIM_FILE).is_file() else None
    return model, meta, optim


def _load_npz(path: Path) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}  # reads every array: a truncated file fails here, not later
    except Exception as e:  # BadZipFile, zlib.error, EOFError, ValueError, OSError: all mean "damaged"
        raise CheckpointError(f"{path} is damaged or not an .npz file ({type(e).__name__}: {e})") from None


def _load_weights(path: Path) -> dict:
    try:
        return safetensors.load_file(path)
    except safetensors.SafetensorsError as e:  # already one line naming the file
        raise CheckpointError(str(e)) from None


def non_finite(arrays: dict) -> str | None:
    """The name of the first array holding an inf or nan, or None (bf16 included: ml_dtypes' type is no NumPy
    floating type, and its NaNs passed)."""
    for k, v in arrays.items():
        if (np.issubdtype(v.dtype, np.floating) or v.dtype == backend.bfloat16) and not np.isfinite(v).all():
            return k
    return None


def json_default(o):
    """JSON for the NumPy scalars, arrays and paths a checkpoint's metadata holds."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# --------------------------------------------------------------------------- the kernels a run resolved to

ATTENTION_KERNELS_KEY = "attention_kernels"  # meta.json's entry


def attention_kernels_of(model) -> dict:
    """What the model's flash attention ``kernel="auto"`` resolved to, per call shape, in JSON form
    (``KernelChoices.as_dict``; {} for a model without flash attention): what a checkpoint keeps under
    ``ATTENTION_KERNELS_KEY``."""
    record = getattr(model, "kernel_choices", None)
    return record.as_dict() if record is not None else {}


def pin_attention_kernels(model, meta: dict, *, note=None) -> list[str]:
    """Put a checkpoint's attention kernels back into the model's record before its first step: "auto" then runs
    them as the interrupted run did, nothing is timed, and the resumed steps are the uninterrupted run's bit for
    bit. Returns notes, one line each (and hands each to ``note``, when given): a kernel this machine cannot run
    (cuDNN missing) is left out, its shapes are decided anew, and the losses then differ from the uninterrupted
    run's in the last bits. A malformed record is a ValueError."""
    record = getattr(model, "kernel_choices", None)
    pinned = KernelChoices.from_dict(meta.get(ATTENTION_KERNELS_KEY) or {})  # checked also where nothing is pinned
    if record is None or not len(pinned):
        return []
    missing = choices_unavailable(pinned)
    for key, choice in pinned.items():
        if choice not in missing:
            record.record(key, choice)
    notes = [f"the checkpointed run's attention ran {kernel} for {sum(c == kernel for _, c in pinned.items())} "
             f"shape(s), unavailable here ({why}): they are decided anew, so the losses will differ from an "
             "uninterrupted run's in the last bits" for kernel, why in missing.items()]
    for text in notes if note else ():
        note(text)
    return notes


# --------------------------------------------------------------------------- the FP8 scaling state

FP8_SCALING_KEY = "fp8_scaling"  # meta.json's entry: Fp8Linears.state_dict() ({} without the delayed recipe)


def fp8_scaling_of(model) -> dict:
    """The delayed FP8 recipe's scaling state of the model (``Fp8Linears.state_dict``; {} for any other model)."""
    fp8 = getattr(model, "fp8", None)
    return fp8.state_dict() if fp8 is not None else {}


def model_state_of(model) -> dict:
    """What a checkpoint keeps of a model besides its weights, by meta.json key: the attention kernels "auto"
    resolved to and the FP8 scaling state."""
    return {ATTENTION_KERNELS_KEY: attention_kernels_of(model), FP8_SCALING_KEY: fp8_scaling_of(model)}


def restore_model_state(model, meta: dict, *, note=None) -> list[str]:
    """``model_state_of``'s entries put back before the first resumed step (``pin_attention_kernels``'s notes
    returned). An FP8 state that does not fit the model is a ValueError; a checkpoint without one (made before it
    was kept) leaves a delayed run to scale its first resumed step like a first step."""
    notes = pin_attention_kernels(model, meta, note=note)
    state = meta.get(FP8_SCALING_KEY) or {}
    fp8 = getattr(model, "fp8", None)
    if state and fp8 is None:
        raise ValueError("the checkpoint holds FP8 scaling state, but this model runs no FP8 GEMMs")
    if fp8 is not None:
        fp8.load_state_dict(state)
    return notes

