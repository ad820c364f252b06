"""``llmgpu prepare``: text files -> llm.c token shards, in parallel over files, streaming.

Each input file is one document. A pool of worker processes tokenizes the files (GPT-2's BPE through
``tiktoken``, or UTF-8 bytes); each worker reads its file in pieces of about ``piece_bytes`` and writes the
tokens to a temporary file as it goes, so no process ever holds more than a piece of text and no file's
tokens are kept in memory. The main process then concatenates the token files in input order into shards
of ``shard_tokens`` (``train_000000.bin``, ..., ``data.write_shard``: llm.c's format, header magic 20240520,
uint16 tokens), the last ``val_fraction`` of the stream into ``val_000000.bin``, ..., and writes
``prepare.json`` (tokenizer, counts, inputs), which also tells ``load_corpus`` the shards' tokenizer.

Nothing old is lost: the token files and the new shards are made in ``OUT/.prepare-tmp``, and only once they
are complete do they replace the shards already there (``--overwrite``); a failure or Ctrl-C leaves the old
output as it was and no staging directory. The output's own files are never inputs, also when ``--out`` lies
inside an input directory.

GPT-2 documents start with ``<|endoftext|>`` (50256), as in llm.c's data scripts; text that spells a special
token is encoded as ordinary text. Pieces end after a newline that is followed by a printable ASCII
character: GPT-2's pre-tokenizer never joins a newline to a following non-space character, so encoding the
pieces one by one gives exactly the tokens of the whole file (``tests/test_prepare.py`` checks it). A file
with no such place in 64 pieces' worth of text is cut at a newline (or anywhere) instead.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from ..checks import is_integer
from ..version import __version__
from .config import TrainConfig
from .data import PREPARE_INFO, DataError, is_shard, need_file, write_shard
from .report import Progress
from .staging import move_in
from .tokenizers import get_tokenizer

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text", ".json", ".jsonl", ".csv", ".html", ".tex")
SHARD_TOKENS = 100_000_000  # llm.c's FineWeb shards: 100M tokens (200 MB)
PIECE_BYTES = 1 << 20
VAL_FRACTION = {f.name: f.default for f in fields(TrainConfig)}["val_fraction"]  # train's default held-out share


def safe_cut(buf: bytes) -> int:
    """Where to end a piece of ``buf``: just after the last newline followed by a printable ASCII character
    (0 when there is none)."""
    end = len(buf) - 1
    while True:
        i = buf.rfind(b"\n", 0, end)
        if i < 0:
            return 0
        if 0x21 <= buf[i + 1] <= 0x7E:
            return i + 1
        end = i


def text_pieces(path, piece_bytes: int = PIECE_BYTES):
    """The bytes of the file ``path`` in pieces of about ``piece_bytes`` (see the module docstring)."""
    buf = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(piece_bytes)
            if not block:
                if buf:
                    yield buf
                return
            buf += block
            if len(buf) < piece_bytes:
                continue
            cut = safe_cut(buf)
            if cut == 0 and len(buf) >= 64 * piece_bytes:  # one enormous line: cut where it does least harm
                cut = buf.rfind(b"\n") + 1 or _utf8_boundary(buf)
            if cut:
                yield buf[:cut]
                buf = buf[cut:]


def _utf8_boundary(buf: bytes) -> int:
    """The start of the last UTF-8 character of ``buf`` (a place to cut that splits no character)."""
    i = len(buf) - 1
    while i > 0 and (buf[i] & 0xC0) == 0x80:  # continuation bytes
        i -= 1
    return i or len(buf)


def encode_file(path, tokenizer, piece_bytes: int = PIECE_BYTES) -> np.ndarray:
    """The tokens of one file as a document (``<|endoftext|>`` first for GPT-2), uint16, in memory."""
    parts = [np.asarray([tokenizer.eot], np.uint16)] if tokenizer.eot is not None else []
    parts += [tokenizer.encode_bytes(p) for p in text_pieces(path, piece_bytes)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _tokenize_to_file(task) -> tuple[int, int]:
    """Worker: tokenize one file into a raw uint16 file; (tokens, bytes)."""
    path, dst, tokenizer, piece_bytes = task
    n = 0
    with open(dst, "wb") as f:
        if tokenizer.eot is not None:
            np.asarray([tokenizer.eot], "<u2").tofile(f)
            n += 1
        for piece in text_pieces(path, piece_bytes):
            ids = tokenizer.encode_bytes(piece).astype("<u2", copy=False)
            ids.tofile(f)
            n += ids.size
    return n, os.path.getsize(path)


STAGING = ".prepare-tmp"  # in --out: the token files and the new shards until they replace the old ones


def input_files(inputs, out=None, notes: list | None = None) -> list[Path]:
    """Files named by ``inputs``: files, directories (their text files, recursively, sorted) and glob patterns,
    each once (where two name one file, its first place; ``notes`` gets a line saying so). The output directory
    ``out``'s own files (its shards, ``prepare.json``, the staging directory) are never inputs, also where ``out``
    lies inside an input directory."""
    own = _output_files(out)
    out_files: list[Path] = []
    for spec in inputs:
        spec = str(spec)
        if any(ch in spec for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file() and not own(Path(p)))
            if not found:
                raise DataError(f"no files match {spec!r}")
            out_files += found
            continue
        p = Path(spec).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in TEXT_SUFFIXES and not own(q))
            if not found:
                raise DataError(f"directory {p} holds no text files ({', '.join(TEXT_SUFFIXES)})")
            out_files += found
        else:
            need_file(p, "input", "give text files, directories or globs")
            out_files.append(p)
    for p in out_files:
        _need_text(p)
    first: dict[Path, Path] = {}
    again = [p for p in out_files if first.setdefault(p.resolve(), p) is not p]  # named before, in order
    if again and notes is not None:
        notes.append(f"{len(again)} input file(s) named more than once ({again[0]}, ...): each is tokenized once")
    return list(first.values())


def _need_text(p: Path):
    """A DataError for a file that is not text: a NUL byte in its first 8 KiB (an llm.c shard, a model's weights, an
    archive, UTF-16) would be tokenized as if it were, silently."""
    try:
        with open(p, "rb") as f:
            head = f.read(8192)
    except OSError as e:
        raise DataError(f"input {p} cannot be read: {e.strerror or e}") from None
    if b"\0" in head:
        what = "like an llm.c token shard (train --data reads it as it is)" if is_shard(p) else "binary"
        raise DataError(f"input {p} is not text (a NUL byte in its first 8 KiB): it looks {what}; prepare tokenizes "
                        "UTF-8 text files")


def _output_files(out):
    """A test: is a path one of the files ``prepare`` writes in ``out``?"""
    if out is None:
        return lambda p: False
    root = Path(out).expanduser().resolve()

    def own(p: Path) -> bool:
        p = p.resolve()
        if p.parent == root:
            return p.name == PREPARE_INFO or p.suffix == ".bin"
        return root / STAGING in p.parents

    return own


class _ShardWriter:
    """Tokens in, shards of ``size`` tokens out (``<split>_000000.bin``, ...), one buffer of ``size`` tokens."""

    def __init__(self, out: Path, split: str, size: int, total: int):
        self.out, self.split, self.size = out, split, size
        self.buf = np.empty(min(size, max(total, 1)), np.uint16)
        self.n, self.paths = 0, []

    def add(self, tokens: np.ndarray):
        while tokens.size:
            k = min(tokens.size, self.buf.size - self.n)
            self.buf[self.n:self.n + k] = tokens[:k]
            self.n, tokens = self.n + k, tokens[k:]
            if self.n == self.buf.size:
                self.flush()

    def flush(self):
        if self.n:
            self.paths.append(write_shard(self.out / f"{self.split}_{len(self.paths):06d}.bin", self.buf[: self.n]))
            self.n = 0


def prepare(inputs, out, *, tokenizer="gpt2", val_fraction: float = VAL_FRACTION, shard_tokens: int = SHARD_TOKENS,
            workers: int | None = None, piece_bytes: int = PIECE_BYTES, overwrite: bool = False,
            progress: bool = True, stream=None) -> dict:
    """Tokenize the text files ``inputs`` into shards in ``out`` (see the module docstring); returns the summary
    written to ``prepare.json``. ``tokenizer``: 'gpt2', 'bytes' or a tokenizer object (``tokenizers.py``)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    for name, v in (("--shard-tokens", shard_tokens), ("piece_bytes", piece_bytes), ("--workers", workers)):
        if (v is not None or name != "--workers") and (not is_integer(v) or v < 1):
            raise DataError(f"{name} must be an integer >= 1, got {v!r}")
    out = Path(out).expanduser()
    notes = []
    files = input_files(inputs, out, notes)
    tok = get_tokenizer(tokenizer, required=True) if isinstance(tokenizer, str) else tokenizer
    if tok.vocab_size > 2**16:
        raise DataError(f"the {tok.name} tokenizer has {tok.vocab_size} tokens: llm.c shards hold uint16 ids")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    bins = sorted(out.glob("*.bin"))
    foreign = [p for p in bins if not is_shard(p)]
    if foreign:  # a directory of shards is read whole (every .bin): never ours to remove, and in the way
        raise DataError(f"--out {out} holds {foreign[0].name}, which is no token shard: train would read it with the "
                        "shards (every .bin in the directory); give another directory")
    old = bins + ([out / PREPARE_INFO] if (out / PREPARE_INFO).exists() else [])
    if old and not overwrite:
        raise DataError(f"--out {out} already holds shards ({old[0].name}, ...): give another directory or --overwrite")
    made = [d for d in (out, *out.parents) if not d.exists()]  # directories this call creates (removed on failure)
    out.mkdir(parents=True, exist_ok=True)
    stage = out / STAGING  # everything new is made here; the old output stays until the new one is complete
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "tokens").mkdir(parents=True)
    (stage / "shards").mkdir()
    workers = max(1, min(workers or os.cpu_count() or 1, len(files)))
    tasks = [(p, stage / "tokens" / f"{i:06d}.u16", tok, piece_bytes) for i, p in enumerate(files)]
    total_bytes = sum(p.stat().st_size for p in files) or 1
    bar = Progress(len(files), enabled=progress, stream=stream)
    bar.message(f"llmgpu prepare: {len(files)} file(s), {total_bytes / 1e6:.1f} MB, {tok.name} tokens, "
                f"{workers} worker(s) -> {out}")
    for note in notes:
        bar.warn(f"llmgpu: note: {note}")
    counts, done_bytes, t0 = [], 0, time.perf_counter()
    try:
        pool = multiprocessing.get_context().Pool(workers) if workers > 1 else None
        try:
            results = pool.imap(_tokenize_to_file, tasks) if pool else map(_tokenize_to_file, tasks)
            for i, (n, nbytes) in enumerate(results, 1):
                counts.append(n)
                done_bytes += nbytes
                el = time.perf_counter() - t0
                bar.update(i, tok_s=sum(counts) / max(el, 1e-9), elapsed=el,
                           eta=el / done_bytes * (total_bytes - done_bytes) if done_bytes else None)
        finally:
            if pool:
                pool.close()
                pool.join()
        bar.close()
        summary = _write_shards(stage / "shards", [t[1] for t in tasks], counts, val_fraction, shard_tokens)
        summary = {"format": "llmgpu-prepare-1", "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
                   "files": len(files), "bytes": sum(p.stat().st_size for p in files), **summary,
                   "val_fraction": val_fraction, "shard_tokens": shard_tokens, "inputs": [str(p) for p in files],
                   "seconds": time.perf_counter() - t0, "llmgpu": __version__}
        (stage / "shards" / PREPARE_INFO).write_text(json.dumps(summary, indent=1) + "\n")
        move_in(list((stage / "shards").iterdir()), out, PREPARE_INFO, stage / "old", old)  # prepare.json last
    except BaseException:  # Ctrl-C, a full disk, a bad file: the old output as it was, no staging left
        shutil.rmtree(stage, ignore_errors=True)
        for d in made:  # deepest first, while empty
            if any(d.iterdir()):
                break
            d.rmdir()
        raise
    shutil.rmtree(stage, ignore_errors=True)
    bar.message(f"done: {summary['train_tokens']:,} training tokens in {len(summary['train_shards'])} shard(s), "
                f"{summary['val_tokens']:,} validation tokens in {len(summary['val_shards'])}, "
                f"{summary['seconds']:.1f} s")
    return summary


def _write_shards(out: Path, token_files: list, counts: list, val_fraction: float, shard_tokens: int) -> dict:
    total = sum(counts)
    n_val = int(round(total * val_fraction))
    if total - n_val <= 0:
        raise DataError(f"the inputs hold {total} tokens: nothing left to train on after the validation share")
    train = _ShardWriter(out, "train", shard_tokens, total - n_val)
    val = _ShardWriter(out, "val", shard_tokens, n_val)
    left = total - n_val  # training tokens still to write; the rest of the stream is validation
    for f, n in zip(token_files, counts):
        if n == 0:
            continue
        tokens = np.memmap(f, dtype="<u2", mode="r", shape=(n,))
        k = min(left, n)
        train.add(tokens[:k])
        val.add(tokens[k:])
        left -= k
        del tokens
    train.flush()
    val.flush()
    return {"tokens": total, "train_tokens": total - n_val, "val_tokens": n_val,
            "train_shards": [p.name for p in train.paths], "val_shards": [p.name for p in val.paths]}


__all__ = ["PIECE_BYTES", "SHARD_TOKENS", "TEXT_SUFFIXES", "encode_file", "input_files", "prepare", "safe_cut",
           "text_pieces"]
