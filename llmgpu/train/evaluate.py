"""``llmgpu eval``: the mean loss and perplexity of a model on held-out data.

The model comes from an llmgpu run or a Hugging Face GPT-2 or Llama directory (``pretrained.py``); the data is
token shards, text or the embedded corpus (``data.py``'s sources; 'stdlib': its validation split, at most
``EMBEDDED_EVAL_BATCHES`` batches by default). Text is tokenized with the model's tokenizer (in memory: an
evaluation set, not a training corpus; ``llmgpu prepare`` makes shards of large ones); a directory or glob
that holds ``*val*`` shards next to training shards is evaluated on the validation shards only.

The data is cut into windows of ``seq + 1`` tokens, walked in order (as the trainer's validation does);
the loss is the mean next-token cross-entropy over every position of ``batches`` full batches (a last
partial batch is left out), and the perplexity is ``exp(loss)``. The sum stays on the device; the host
reads it at each progress update, not after every batch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .. import backend
from ..checks import is_integer
from .config import CPU_DEFAULTS, GPU_DEFAULTS, ConfigError, TrainConfig, select_xp
from .data import EMBEDDED, BatchLoader, DataError, load_corpus
from .pretrained import build_model, load_pretrained
from .report import Progress
from .tokenizers import get_tokenizer

EMBEDDED_NAMES = (EMBEDDED, "embedded")  # --data names of the embedded corpus
EMBEDDED_EVAL_BATCHES = 100  # its validation split's default bound: ~0.1M tokens on a CPU, all of it on a GPU
VAL_FRACTION = TrainConfig().val_fraction  # the share train holds out by default


def eval_tokens(data: str, tokenizer: str | None, val_fraction: float = VAL_FRACTION) -> tuple[list, str, list[str]]:
    """(token arrays, their tokenizer, notes) of the evaluation data ``data`` for a model reading
    ``tokenizer`` tokens (None: unknown, the data's are taken as they are). The embedded corpus ('stdlib'):
    its validation split, the last ``val_fraction`` of it, as ``train`` holds it out."""
    embedded = data in EMBEDDED_NAMES
    corpus = load_corpus(data, val_fraction=val_fraction if embedded else 0.0)
    notes = list(corpus.notes)
    arrays = corpus.train
    if embedded:
        arrays = corpus.val
        notes.append(f"--data {data}: the embedded corpus' validation split (its last {val_fraction:g}, "
                     f"{corpus.n_val:,} tokens), which training holds out")
    elif corpus.val:
        arrays = corpus.val
        notes.append(f"{data} holds training and validation shards: evaluating on the {len(arrays)} validation "
                     "shard(s)")
    if tokenizer is None or corpus.tokenizer == tokenizer:
        return arrays, corpus.tokenizer, notes
    if corpus.tokenizer == "bytes" and tokenizer == "gpt2":  # text: tokenize it as prepare does, one document a file
        tok = get_tokenizer("gpt2", required=True)
        arrays = [np.concatenate([[tok.eot], tok.encode_bytes(_as_bytes(a, data))]).astype(np.uint16) for a in arrays]
        return arrays, "gpt2", notes
    raise DataError(f"{data} holds {corpus.tokenizer} tokens but the model reads {tokenizer} tokens")


def _as_bytes(a, data) -> bytes:
    """The text of an array of byte tokens, whatever its integer type (prepare's byte shards are uint16: their raw
    memory would read as every byte followed by a zero)."""
    if a.size and int(a.max()) > 255:
        raise DataError(f"{data} claims byte tokens but holds ids up to {int(a.max())}")
    return a.astype(np.uint8).tobytes()


def evaluate(model, arrays: list, *, batch: int, seq: int, max_batches: int | None = None, progress: bool = True,
             stream=None) -> dict:
    """Mean loss and perplexity of ``model`` on the windows of ``arrays`` (see the module docstring)."""
    for name, v in (("--batch", batch), ("--seq", seq), ("--max-batches", max_batches)):
        if (v is not None or name != "--max-batches") and (not is_integer(v) or v < 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if seq > model.config.block_size:
        raise ConfigError(f"--seq {seq} exceeds the model's block size {model.config.block_size}")
    windows = sum((a.size - 1) // seq for a in arrays if a.size > seq)
    if windows == 0:
        total = sum(a.size for a in arrays)
        raise DataError(f"the evaluation data has {total} tokens: no sequence of {seq} + 1 (lower --seq)")
    loader = BatchLoader(arrays, min(batch, windows), seq, shuffle=False, name="evaluation",
                         vocab_size=model.config.vocab_size)
    n = loader.batches_per_epoch() if max_batches is None else min(max_batches, loader.batches_per_epoch())
    bar = Progress(n, enabled=progress, stream=stream)
    every = max(1, n // 50)  # progress updates (host syncs)
    xp, total, t0 = model.xp, None, time.perf_counter()
    for i in range(1, n + 1):
        b = backend.to_device(loader.next_host(), xp)
        loss = model.loss(b[0], b[1])
        total = loss if total is None else total + loss
        if i % every == 0 or i == n:
            now = time.perf_counter() - t0
            bar.update(i, loss=float(backend.to_numpy(total)) / i, tok_s=i * loader.batch * seq / max(now, 1e-9),
                       elapsed=now, eta=now / i * (n - i))
    bar.close()
    mean = float(backend.to_numpy(total)) / n
    return {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else math.inf, "batches": n,
            "batch": loader.batch, "seq": seq, "tokens": n * loader.batch * seq, "seconds": time.perf_counter() - t0}


def run_eval(src: str, data: str, *, batch: int | None = None, seq: int | None = None,
             max_batches: int | None = None, device: str = "auto", dtype: str = "fp32", progress: bool = True) -> dict:
    """``llmgpu eval``: the model at ``src`` (llmgpu run or Hugging Face directory) on ``data``; a JSON-able dict."""
    xp = select_xp(device)
    d = CPU_DEFAULTS if xp is np else GPU_DEFAULTS
    pre = load_pretrained(src)  # a run of any --arch
    model = build_model(pre, dtype=dtype, xp=xp)
    arrays, tok, notes = eval_tokens(data, pre.tokenizer, _held_out_share(pre))
    backend.use_cpu(xp, device, None, notes.append)  # on NumPy: one BLAS thread, as train (small GEMMs)
    if data in EMBEDDED_NAMES and max_batches is None:
        max_batches = EMBEDDED_EVAL_BATCHES
        notes.append(f"at most {max_batches} batches of it by default (--max-batches N sets another bound)")
    seq = seq or min(d["seq"], pre.config.block_size)
    out = evaluate(model, arrays, batch=batch or d["batch"], seq=seq, max_batches=max_batches, progress=progress)
    return {**out, "model": pre.source, "data": data, "tokenizer": tok, "dtype": dtype,
            "device": backend.device_info(xp).summary(), "notes": notes}


def _held_out_share(pre) -> float:
    """The share of the embedded corpus a run trained on it held out (its --val-fraction), else train's default."""
    cfg = pre.meta.get("train_config") if pre.kind == "llmgpu" else None
    if isinstance(cfg, dict) and cfg.get("data") in (None, "", *EMBEDDED_NAMES) and cfg.get("val_data") is None \
            and isinstance(cfg.get("val_fraction"), float) and 0 < cfg["val_fraction"] < 1:
        return cfg["val_fraction"]
    return VAL_FRACTION


__all__ = ["EMBEDDED_EVAL_BATCHES", "eval_tokens", "evaluate", "run_eval"]
