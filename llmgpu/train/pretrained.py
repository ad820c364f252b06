"""Trained weights as a model, from wherever they are: a Hugging Face GPT-2 or Llama directory, or an llmgpu run.

* ``load_pretrained(path)``: the configuration (``GPTConfig`` or ``LlamaConfig``), fp32 weights (nanoGPT's names
  for GPT-2, Hugging Face's for Llama), tokenizer and provenance of a local Hugging Face directory
  (``interop/hf.py``) or an llmgpu run/checkpoint (``checkpoint.py``); weights holding inf/nan are refused. What
  ``train --init``, ``eval``, ``sample`` and ``export`` read.
* ``from_pretrained(path, dtype=, xp=, fast=)``: that, as a ``GPT`` or a ``Llama`` ready to run (``FastGPT`` or
  ``FastLlama`` with ``fast=True``; ``llmgpu.from_pretrained``).
* ``export(src, dst)``: ``llmgpu export``: a directory ``transformers``' ``GPT2LMHeadModel`` or
  ``LlamaForCausalLM`` loads, never written over the model it reads, a run or a checkpoint
  (``check_export_target``).
* ``init_run(cfg)``: a new run's configuration and weights from ``--init PATH``; ``check_tokenizer``.

Nothing is downloaded: a path that does not exist (a hub name such as ``gpt2``) says how to fetch it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import backend
from ..checks import check_bool
from ..interop import InteropError, hf
from ..model import GPTConfig, LlamaConfig, family
from ..model.llama_config import LM_HEAD
from ..version import __version__
from . import rundir
from .checkpoint import META_FILE, CheckpointError, find_checkpoint, load_checkpoint, model_file, non_finite
from .config import FINETUNE_DEFAULTS, ConfigError, TrainConfig, explicit_fields, flag_of
from .rundir import RUN_FILES
from .staging import move_in


@dataclass
class Pretrained:
    """Weights from a model directory: ``config`` (``GPTConfig`` or ``LlamaConfig``), ``weights`` (the model's
    names: nanoGPT's or Llama's; fp32 NumPy, the vocabulary unpadded), ``tokenizer`` ('gpt2', 'bytes' or None:
    unknown), ``kind`` ('hf' or 'llmgpu')."""

    config: GPTConfig | LlamaConfig
    weights: dict
    tokenizer: str | None
    kind: str
    path: Path
    source: str  # one line for logs and JSON: what the weights are
    meta: dict = field(default_factory=dict)

    def run_model_config(self, data_tokenizer: str, cfg: TrainConfig) -> GPTConfig | LlamaConfig:
        """The model of a run that starts from these weights (``train --init``): their configuration with the
        run's vocabulary padding, after checking that the data holds the tokens the weights were trained on."""
        check_tokenizer(self, data_tokenizer, cfg.data)
        return replace(self.config, pad_vocab_to=cfg.pad_vocab)


def load_pretrained(path) -> Pretrained:
    """The weights at ``path``: a Hugging Face GPT-2 or Llama directory (``config.json`` + weights) or an llmgpu
    run or checkpoint directory (of either family: its ``model_config``'s ``arch``). One-line ``InteropError`` /
    ``CheckpointError`` for anything unusable."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = (" (a Hugging Face hub name? fetch it first, e.g. huggingface-cli download openai-community/gpt2 "
                f"--local-dir {p.name or 'gpt2'})") if len(p.parts) <= 2 and not p.suffix else ""
        raise CheckpointError(f"{p} does not exist: llmgpu reads local model directories and never downloads{hint}")
    if hf.is_hf_dir(p):
        cfg, weights, info = hf.load_hf(p)
        bad = non_finite(weights)
        if bad:  # named by its file (a sharded model's index: the shards are read as one)
            where = info["weights_file"] if Path(info["weights_file"]).name in (hf.WEIGHTS_FILE, hf.TORCH_FILE) \
                else p / hf.INDEX_FILE
            raise CheckpointError(f"{where} holds inf/nan weights ({bad}): a damaged or diverged model")
        return Pretrained(cfg, weights, info.get("tokenizer"), "hf", p, f"Hugging Face {family_name(cfg)} {p}", info)
    try:
        d = find_checkpoint(p)
    except CheckpointError:
        who = rundir.writer(p)
        if who:  # a run's directory exists from its start, its checkpoint from its first save
            raise CheckpointError(f"{p} holds no checkpoint yet: another llmgpu process writes that run ({who}), "
                                  "and saves its first at --save-every steps or at its end") from None
        raise
    weights, meta, _ = load_checkpoint(d, with_optim=False)
    bad = non_finite(weights)
    if bad:
        raise CheckpointError(f"{model_file(d)} holds inf/nan weights ({bad}): the file is damaged, or the run that "
                              "wrote it had diverged; use an earlier checkpoint")
    try:
        cfg = family.config_from_dict(meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d} has no usable model configuration ({type(e).__name__}: {e})") \
            from None
    for name in {model_class(cfg).embedding_name, LM_HEAD} & set(weights):  # the padded vocabulary rows are
        if np.any(weights[name][cfg.vocab_size:]):  # zeros (an untied head's too): another padding adds its own
            raise CheckpointError(f"{model_file(d)}: {name} holds trained rows beyond the {cfg.vocab_size} tokens of "
                                  f"the vocabulary its {META_FILE} names: the weights do not fit their model "
                                  "configuration")
        weights[name] = weights[name][: cfg.vocab_size]
    return Pretrained(cfg, weights, meta.get("tokenizer", "bytes"), "llmgpu", d, f"llmgpu run {d} ({cfg.arch}, step "
                      f"{meta['step']})", meta)


def model_class(cfg: GPTConfig | LlamaConfig, fast: bool = False):
    """The model of a configuration: its family's book step (``GPT``, ``Llama``), or with ``fast`` its fast step
    (``FastGPT``, ``FastLlama``)."""
    return family.fast_model_class(cfg) if fast else family.model_class(cfg)


def family_name(cfg: GPTConfig | LlamaConfig) -> str:
    return "Llama" if isinstance(cfg, LlamaConfig) else "GPT-2"


def build_model(pre: Pretrained, *, dtype="fp32", xp=None, fast: bool = False, pad_vocab_to: int | None = None):
    """A ``GPT`` or a ``Llama`` (``FastGPT``, ``FastLlama`` with ``fast``) holding ``pre``'s weights;
    ``pad_vocab_to``: None keeps ``pre``'s."""
    cfg = pre.config if pad_vocab_to is None else replace(pre.config, pad_vocab_to=pad_vocab_to)
    model = model_class(cfg, fast)(cfg, dtype=dtype, xp=xp, init=False)
    try:
        model.load_state_dict(pre.weights)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{pre.path}: the weights do not fit their model configuration ({type(e).__name__}: "
                              f"{e})") from None
    return model


def from_pretrained(path, *, dtype="fp32", xp=None, fast: bool = False):
    """A model from a local Hugging Face GPT-2 or Llama directory or an llmgpu run: ``GPT`` or ``Llama`` (``FastGPT``,
    ``FastLlama`` with ``fast``; bf16/fp16 on a GPU) in ``dtype`` on
    ``xp``: None (the active backend), ``numpy``/``cupy``, or 'auto', 'cpu', 'gpu' (``backend.resolve_xp``).
    Never downloads."""
    xp = backend.resolve_xp(xp)  # before reading the weights: a bad xp= (or fast=) says so at once
    check_bool("fast", fast)
    return build_model(load_pretrained(path), dtype=dtype, xp=xp, fast=fast)


def export(src, dst, *, overwrite: bool = False) -> dict:
    """``llmgpu export``: the weights at ``src`` (an llmgpu run, or a Hugging Face directory) as a directory
    ``transformers`` loads (``interop.hf.export_hf``), GPT-2 or Llama as the weights are; a Hugging Face Llama's
    BOS/EOS token ids go along. Refuses a ``dst`` holding files unless ``overwrite``, which replaces the model
    there (``OLD_MODEL_FILES`` too). Written beside ``dst`` first (``_staged``): a failure leaves ``dst`` as it was."""
    out = Path(dst).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--to {out} exists and is not a directory")
    rundir.check_parents(out, "--to")
    pre = load_pretrained(src)
    check_export_target(out, pre, overwrite)
    info = {"source": pre.source, "step": pre.meta.get("step"), "llmgpu": __version__,
            **{k: pre.meta[k] for k in ("bos_token_id", "eos_token_id") if pre.meta.get(k) is not None}}

    def write(stage):
        try:
            hf.export_hf(stage, pre.config, pre.weights, tokenizer=pre.tokenizer, info=info)
        except InteropError as e:  # a weight of another shape than the configuration's (an edited meta.json)
            raise InteropError(f"{pre.path}: the weights do not fit their model configuration ({e})") from None

    _staged(out, write)
    return {"to": str(out), "from": pre.source, "architecture": family_name(pre.config),
            "tokenizer": pre.tokenizer, "vocab_size": pre.config.vocab_size,
            "n_layer": pre.config.n_layer, "n_embd": pre.config.n_embd, "block_size": pre.config.block_size}


# An earlier model's files that an export with --overwrite removes too: kept, they would sit beside the new
# config.json as if they belonged to it (a sharded model's index and shards, a PyTorch pickle, a GPT-2 export's
# nanoGPT copy under a Llama).
OLD_MODEL_FILES = (hf.INDEX_FILE, "model-*-of-*.safetensors", "pytorch_model*.bin*", hf.NANOGPT_FILE)


def _staged(out: Path, write):
    """``write(stage)`` into a new directory beside ``out``, then moved into place: a failure (a full disk) leaves
    ``out`` as it was, not a half-written export that blocks a retry (not empty) or reads as a model. A new or
    empty ``out``: one rename; one that holds files (--overwrite): ``staging.move_in``, config.json last."""
    real = out.resolve()  # '.' has no name to stage beside, and a link is replaced by what it points to, not itself
    real.parent.mkdir(parents=True, exist_ok=True)
    stage = real.with_name(f".{real.name}.export-tmp")  # beside it: the same file system, so moving is renaming
    shutil.rmtree(stage, ignore_errors=True)  # a killed export's
    try:
        (stage / "new").mkdir(parents=True)
        what = "writing {} failed"
        try:
            write(stage / "new")
            what = "moving {} into place failed"
            if real.is_dir() and any(real.iterdir()):
                old = sorted({f for pattern in OLD_MODEL_FILES for f in real.glob(pattern) if f.is_file()})
                move_in(list((stage / "new").iterdir()), real, hf.CONFIG_FILE, stage / "old", old)
            else:
                os.replace(stage / "new", real)  # over an empty directory too
        except OSError as e:  # a full disk's error names no file: interop's publish() names the one being written
            name = out / Path(e.filename).name if e.filename else out
            raise InteropError(f"{what.format(name)}: {e.strerror or e}; --to {out} was left as it was (export "
                               "again once that is fixed)") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def check_export_target(out: Path, pre: Pretrained, overwrite: bool):
    """A ConfigError unless ``export`` may write ``out``: never the model it reads (``pre``: its directory, the run
    it belongs to), a run or a checkpoint (their ``config.json`` and ``model.safetensors`` would be replaced, also
    with ``--overwrite``), and a directory holding files only with ``overwrite``."""
    if not out.is_dir():
        return
    sources = {pre.path.resolve(), pre.path.resolve().parent} if pre.kind == "llmgpu" else {pre.path.resolve()}
    if out.resolve() in sources:
        raise ConfigError(f"--to {out} is where the model comes from ({pre.source}): its files would be replaced; "
                          "give another directory")
    if any((out / f).exists() for f in RUN_FILES if f != hf.CONFIG_FILE) or (out / META_FILE).is_file():
        raise ConfigError(f"--to {out} holds an llmgpu run or checkpoint, whose config.json and weights the export "
                          "would replace (also with --overwrite): give another directory")
    if any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--to {out} is not empty: give an empty or new directory, or --overwrite")


# --------------------------------------------------------------------------- train --init


def init_run(cfg: TrainConfig, note=print, explicit=None) -> tuple[TrainConfig, Pretrained]:
    """(the configuration of a new run that starts from the weights at ``cfg.init``, those weights); ``note``
    is called with what the run takes from them (one line).

    The model's shape, vocabulary and block size are the weights'; ``--preset`` is an error (it would name
    another shape), and so are a ``--block-size``/``--vocab-size`` other than the weights', and an ``--arch`` of
    another family (``explicit``: the fields the user set, as the CLI knows them; None: ``explicit_fields``, those
    that differ from the defaults). Fine-tuning defaults (``config.FINETUNE_DEFAULTS``) apply to what the user did
    not set (``resolve``)."""
    if cfg.resume:
        raise ConfigError(f"--init {cfg.init} starts a new run from pretrained weights; --resume continues a run: "
                          "give one of them")
    if cfg.preset is not None:
        raise ConfigError(f"--init {cfg.init} takes the model's shape from its weights: drop --preset {cfg.preset}")
    pre = load_pretrained(cfg.init)
    m = pre.config
    explicit = explicit_fields(cfg) if explicit is None else explicit
    if "arch" in explicit and cfg.arch != m.arch:  # an --arch of another family contradicts the weights
        raise ConfigError(f"--init {cfg.init} holds a {family_name(m)} model: drop --arch {cfg.arch}")
    cfg = replace(cfg, arch=m.arch)  # before resolve(): a Llama then runs the book step, with its note
    for name, value in (("block_size", m.block_size), ("vocab_size", m.vocab_size)):
        given = getattr(cfg, name)
        if given is not None and given != value:
            raise ConfigError(f"{flag_of(name)} {given}: the weights in {cfg.init} have {name} {value}, which "
                              "--init keeps")
    cfg = replace(cfg, block_size=m.block_size, vocab_size=m.vocab_size)
    unset = [k for k in FINETUNE_DEFAULTS if getattr(cfg, k) is None]  # resolve() fills them in
    note(f"fine-tuning {pre.source}"
         + (": " + ", ".join(f"{flag_of(k)} {FINETUNE_DEFAULTS[k]:g}" for k in unset) + " (fine-tuning defaults)"
            if unset else ""))
    return cfg, pre


def check_tokenizer(pre: Pretrained, data_tokenizer: str, data: str | None):
    """ConfigError when the data's tokens are not the ones the pretrained weights were trained on."""
    if pre.tokenizer is not None and data_tokenizer != pre.tokenizer:
        fix = (f"prepare text for it with: llmgpu prepare FILE... --out DIR --tokenizer {pre.tokenizer}, then --data "
               "DIR")
        raise ConfigError(f"the weights in {pre.path} read {pre.tokenizer} tokens but the data "
                          f"({data or 'the embedded corpus'}) holds {data_tokenizer} tokens: {fix}")


__all__ = ["Pretrained", "build_model", "check_export_target", "check_tokenizer", "export",
           "family_name", "from_pretrained", "init_run", "load_pretrained", "model_class"]
