"""Training data: an embedded corpus, text files, llm.c token shards, and a loader that overlaps copies.

Three sources, one shape (a list of 1-D token arrays):

* the **embedded corpus**: the Python standard library's own source files, found through
  ``sysconfig.get_paths()['stdlib']`` and read in sorted path order, so every machine with Python has
  the same ~10 MB of real text without a download (byte-level tokens, vocabulary 256);
* **plain text files** (UTF-8 bytes, vocabulary 256);
* **llm.c token shards** (``.bin``): a header of 256 int32 (magic 20240520, version 1, token count)
  followed by that many uint16 tokens (GPT-2 ids), so shards prepared for llm.c load unchanged; shards
  written by ``llmgpu prepare`` (``prepare.py``) have a ``prepare.json`` beside them naming their tokenizer.

The token stream is cut into windows of ``seq + 1`` tokens (inputs and next-token targets). Each epoch
visits the windows in an order drawn from a generator seeded with ``(seed, epoch)``; the loader's
position is two integers (epoch, cursor), saved in checkpoints so a resumed run sees the same batches.

On the GPU, the next batch is copied host → device from pinned memory on a side stream while the
current step runs (``GPUPrefetcher``); the compute stream waits on an event, never the host.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import backend
from .stream import DataStream, GPUPrefetcher  # noqa: F401  (moved to stream.py; still importable from here)
from .tokenizers import BYTE_VOCAB, GPT2_VOCAB, ByteTokenizer, DataError, GPT2Tokenizer, get_tokenizer

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
PREPARE_INFO = "prepare.json"  # written by llmgpu prepare next to its shards: their tokenizer, counts, inputs

# Directories of the standard library that are not "prose-like" source: test suites, vendored
# packages, generated codec tables.
_STDLIB_EXCLUDE = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
                             "encodings", "ensurepip"})
EMBEDDED = "stdlib"  # the --data name of the embedded corpus
FULL_SCAN_TOKENS = 2_000_000_000  # above this, load_corpus scans only some files for the largest token id


# --------------------------------------------------------------------------- sources


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The embedded corpus' files: ``*.py`` under the stdlib directory, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library directory {root} does not exist")
    rel = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _STDLIB_EXCLUDE)
        rel += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    rel.sort(key=lambda p: Path(p).as_posix())
    return [root / p for p in rel]


def embedded_corpus(max_bytes: int | None = None, root=None) -> bytes:
    """The standard library's sources concatenated (a header line per file), as bytes."""
    chunks, total = [], 0
    base = Path(root or sysconfig.get_paths()["stdlib"])
    for p in stdlib_files(base):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        piece = b"# file: " + p.relative_to(base).as_posix().encode() + b"\n" + data + b"\n"
        chunks.append(piece)
        total += len(piece)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    if not corpus:
        raise DataError(f"no Python source files found under {base}")
    return corpus


def write_shard(path, tokens) -> Path:
    """Write tokens as an llm.c shard (header 256 int32: magic, version, count; then uint16)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("llm.c version-1 shards hold uint16 tokens (0..65535)")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    path = Path(path)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        tokens.astype("<u2", copy=False).tofile(f)
    return path


def need_file(path: Path, what: str, fix: str = "give a text file, a .bin shard, a directory of them or a glob"):
    """A DataError unless ``path`` is a regular file, saying what it is instead: missing, a directory, or not a file
    (/dev/null, a pipe: no data, or data without end)."""
    if path.is_file():
        return
    if not path.exists():
        raise DataError(f"{what} {path} does not exist")
    raise DataError(f"{what} {path} is {'a directory' if path.is_dir() else 'not a regular file'}: {fix}")


def is_shard(path) -> bool:
    """Whether the file ``path`` starts with an llm.c shard's magic number (its other checks: ``read_shard``)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == int(SHARD_MAGIC).to_bytes(4, "little")
    except OSError:
        return False


def read_shard(path) -> np.ndarray:
    """An llm.c shard's tokens as a read-only uint16 memmap, after checking its header."""
    path = Path(path)
    need_file(path, "token shard")
    size = path.stat().st_size
    if size < SHARD_HEADER_BYTES:
        raise DataError(f"{path} is {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte llm.c shard header")
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path} is not an llm.c token shard: magic {int(header[0])}, expected {SHARD_MAGIC}")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {int(header[1])} (llmgpu reads version {SHARD_VERSION},"
                        " uint16 GPT-2 tokens)")
    n = int(header[2])
    if n <= 0:
        raise DataError(f"{path}: its header says it holds {n} tokens: an empty or damaged shard")
    if size != SHARD_HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: header says {n} tokens but the file holds {(size - SHARD_HEADER_BYTES) / 2:g}")
    return np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER_BYTES, shape=(n,))


def read_text(path) -> np.ndarray:
    path = Path(path)
    need_file(path, "text file")
    data = path.read_bytes()
    if not data:
        raise DataError(f"text file {path} is empty")
    return np.frombuffer(data, dtype=np.uint8)


# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Train and validation token streams (lists of 1-D arrays), their vocabulary and tokenizer."""

    train: list
    val: list
    vocab_size: int  # the smallest vocabulary that covers every token id present
    tokenizer: str  # 'bytes' or 'gpt2'
    description: str
    max_token: int = field(default=-1)
    notes: list = field(default_factory=list)  # what loading chose that the user may not expect (one line each)

    @property
    def n_train(self) -> int:
        return int(sum(a.size for a in self.train))

    @property
    def n_val(self) -> int:
        return int(sum(a.size for a in self.val))

    def fingerprint(self) -> dict:
        """What ranks compare before the first step (``ranks.check_agreement``): the tokenizer, each array's length
        and a hash of its first and last 64 Ki tokens. Several ranks that read "the same" path may not read the same
        tokens (another node's copy, a file rewritten in between), and would then train on different data."""
        def digest(a):
            ends = (a[:65536], a[-65536:]) if a.size > 65536 else (a,)
            return hashlib.sha256(b"".join(np.ascontiguousarray(e).tobytes() for e in ends)).hexdigest()[:16]

        return {"tokenizer": self.tokenizer, "train": [[a.size, digest(a)] for a in self.train],
                "val": [[a.size, digest(a)] for a in self.val]}

    def check_vocab(self, model_vocab: int):
        """DataError when a token id does not fit the model's vocabulary."""
        if self.max_token >= model_vocab:
            raise DataError(f"the data has token id {self.max_token} but the model's vocabulary is {model_vocab}: "
                            f"use a model with --vocab-size >= {self.max_token + 1}")


def data_files(spec: str, notes: list | None = None) -> list[Path]:
    """A file, a directory (its .bin shards, else its text files: a note says so), or a glob pattern."""
    if any(ch in spec for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec))
        if not paths:
            raise DataError(f"no files match {spec!r}")
        if dirs := [q for q in paths if q.is_dir()]:
            raise DataError(f"{spec!r} matches the directory {dirs[0]}: give a pattern that matches files only, or "
                            "the directory itself")
        return paths
    p = Path(spec).expanduser()
    if p.is_dir():
        shards = sorted(p.glob("*.bin"))
        texts = sorted(q for q in p.iterdir() if q.is_file() and q.suffix in (".txt", ".md", ".py", ".rst"))
        if shards:
            if texts and notes is not None:
                notes.append(f"{p} holds .bin shards and text files: training on its {len(shards)} .bin file(s) "
                             f"only, not on its {len(texts)} text file(s) ({texts[0].name}, ...)")
            return shards
        if not texts:
            raise DataError(f"directory {p} holds no .bin shards and no .txt/.md/.py/.rst files")
        return texts
    need_file(p, "data file")
    return [p]


def _read_any(paths: list[Path]) -> tuple[list, str]:
    kinds = {"shard" if p.suffix == ".bin" else "text" for p in paths}
    if len(kinds) > 1:
        raise DataError("mixing token shards (.bin) and text files in one data set is not supported")
    if kinds == {"shard"}:
        return [read_shard(p) for p in paths], shard_tokenizer(paths)
    return [read_text(p) for p in paths], "bytes"


def shard_tokenizer(paths: list[Path]) -> str:
    """The tokenizer of shards: what ``prepare.json`` next to them says (llmgpu prepare), else GPT-2 (llm.c's)."""
    names = set()
    for d in {p.parent for p in paths}:
        try:
            names.add(json.loads((d / PREPARE_INFO).read_text()).get("tokenizer", "gpt2"))
        except FileNotFoundError:
            names.add("gpt2")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{d / PREPARE_INFO} is not readable JSON ({type(e).__name__}: {e})") from None
    if len(names) > 1:
        raise DataError(f"the shards hold tokens of different tokenizers ({', '.join(sorted(names))})")
    return names.pop()


def _tail_split(arrays: list, frac: float) -> tuple[list, list]:
    """Hold out the last ``frac`` of the concatenated stream (views, no copies)."""
    total = sum(a.size for a in arrays)
    n_val = int(round(total * frac))
    train, val, need = list(arrays), [], n_val
    while need > 0 and train:
        last = train.pop()
        if last.size <= need:
            val.insert(0, last)
            need -= last.size
        else:
            cut = last.size - need
            train.append(last[:cut])
            val.insert(0, last[cut:])
            need = 0
    return train, val


def load_corpus(data: str | None = None, *, val_data: str | None = None, val_fraction: float = 0.05,
                max_bytes: int | None = None) -> Corpus:
    """Load the training data named by ``data`` (None or 'stdlib': the embedded corpus).

    Validation data: ``val_data`` if given; else shard files whose name contains 'val' (llm.c's
    ``*_val_*.bin`` convention); else the last ``val_fraction`` of the stream.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    notes: list[str] = []
    if data in (None, "", EMBEDDED, "embedded"):
        raw = embedded_corpus(max_bytes)
        arrays, tok = [np.frombuffer(raw, dtype=np.uint8)], "bytes"
        digest = hashlib.sha1(raw).hexdigest()[:10]
        desc = (f"embedded corpus: Python {sysconfig.get_python_version()} standard library sources "
                f"({len(raw) / 1e6:.1f} MB, sha1 {digest})")
    else:
        paths = data_files(data, notes)
        arrays, tok = _read_any(paths)
        desc = f"{data} ({len(paths)} file{'s' if len(paths) > 1 else ''})"
        if val_data is None and paths[0].suffix == ".bin" and len(paths) > 1:
            is_val = ["val" in p.name for p in paths]
            if any(is_val) and not all(is_val):
                val = [a for a, v in zip(arrays, is_val) if v]
                train = [a for a, v in zip(arrays, is_val) if not v]
                return _finish(train, val, tok, desc, notes)
    if val_data is not None:
        val_arrays, val_tok = _read_any(data_files(val_data, notes))
        if val_tok != tok:
            raise DataError(f"--val-data holds {val_tok} tokens but --data holds {tok} tokens")
        return _finish(arrays, val_arrays, tok, desc, notes)
    train, val = _tail_split(arrays, val_fraction)
    return _finish(train, val, tok, desc, notes)


def _finish(train, val, tok, desc, notes: list) -> Corpus:
    train = [a for a in train if a.size]
    val = [a for a in val if a.size]
    if not train:
        raise DataError(f"{desc}: no training tokens")
    every = train + val
    if sum(a.size for a in every) > FULL_SCAN_TOKENS:  # a large shard set: first and last file here,
        every = [train[0], train[-1], *val[:1]]  # every batch is checked again as it is read
    mx = max(int(a.max()) for a in every)
    vocab = BYTE_VOCAB if tok == "bytes" else max(GPT2_VOCAB, mx + 1)
    if tok == "gpt2" and mx >= GPT2_VOCAB:  # llm.c's shards say no tokenizer: another one's ids are read as GPT-2's
        notes.append(f"the data holds token id {mx}, beyond GPT-2's {GPT2_VOCAB} tokens: these are not GPT-2 tokens "
                     f"(shards without a {PREPARE_INFO} are read as GPT-2's); the model trains on them, samples show "
                     "such ids as numbers")
    return Corpus(train, val, vocab_size=vocab, tokenizer=tok, description=desc, max_token=mx, notes=list(notes))


# --------------------------------------------------------------------------- batches


class BatchLoader:
    """Batches of ``[batch, seq]`` inputs and next-token targets from windows of ``seq + 1`` tokens.

    Windows start every ``seq`` tokens and never cross a file boundary. ``shuffle=True`` visits them
    in a fresh seeded order each epoch; ``shuffle=False`` walks them in order (validation).
    ``next_host()`` returns an int32 array ``[2, batch, seq]`` (inputs, targets).
    Data parallelism (chapter 9): every rank walks the same order, takes the ``rank``-th of ``world``
    consecutive batches and skips the others; the cursor (the checkpointed position) is the global one.
    """

    def __init__(self, arrays: list, batch: int, seq: int, *, seed: int = 0, shuffle: bool = True,
                 name: str = "train", vocab_size: int | None = None, rank: int = 0, world: int = 1):
        if batch < 1 or seq < 1:
            raise DataError(f"batch and sequence length must be >= 1, got batch={batch}, seq={seq}")
        self.arrays = [a for a in arrays if a.size > seq]
        counts = np.array([(a.size - 1) // seq for a in self.arrays], dtype=np.int64)
        self.n_windows = int(counts.sum())
        if self.n_windows < batch * world:
            total = sum(a.size for a in arrays)
            raise DataError(f"the {name} data has {total} tokens: too few for one batch of {batch} x {seq + 1} "
                            f"tokens{f' on each of {world} ranks' if world > 1 else ''} (lower --batch/--seq or "
                            "give more data)")
        self.rank, self.world = rank, world
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.batch, self.seq, self.seed, self.shuffle, self.name = batch, seq, seed, shuffle, name
        self.vocab_size = vocab_size  # when given, every batch is checked against it
        self.epoch, self.cursor = 0, 0
        self._perm = None
        self._perm_epoch = None

    # --- position (checkpointable)
    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "cursor": int(self.cursor), "seed": int(self.seed),
                "n_windows": self.n_windows, "batch": self.batch, "seq": self.seq}

    def load_state_dict(self, state: dict):
        if (state.get("n_windows", self.n_windows), state.get("seq", self.seq)) != (self.n_windows, self.seq):
            raise DataError(f"the checkpoint's data position is for {state.get('n_windows')} windows of "
                            f"{state.get('seq')} tokens, this data has {self.n_windows} of {self.seq}: "
                            "resume with the same data and --seq")
        self.epoch, self.cursor, self.seed = int(state["epoch"]), int(state["cursor"]), int(state["seed"])

    def reset(self):
        self.epoch, self.cursor = 0, 0

    def _order(self):
        if not self.shuffle:
            return None
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def _window(self, w: int) -> np.ndarray:
        f = int(np.searchsorted(self._starts, w, side="right")) - 1
        off = (w - int(self._starts[f])) * self.seq
        return self.arrays[f][off:off + self.seq + 1]

    def next_host(self, out: np.ndarray | None = None) -> np.ndarray:
        """The next batch as int32 ``[2, batch, seq]``; advances the position (epochs wrap)."""
        if self.cursor + self.batch * self.world > self.n_windows:
            self.epoch += 1
            self.cursor = 0
        order = self._order()
        first = self.cursor + self.rank * self.batch
        ids = range(first, first + self.batch)
        if out is None:
            out = np.empty((2, self.batch, self.seq), dtype=np.int32)
        for r, i in enumerate(ids):
            win = self._window(int(order[i]) if order is not None else i)
            out[0, r] = win[:-1]
            out[1, r] = win[1:]
        if self.vocab_size is not None and int(out.max()) >= self.vocab_size:
            raise DataError(f"the {self.name} data has token id {int(out.max())} but the model's vocabulary is "
                            f"{self.vocab_size}")
        self.cursor += self.batch * self.world
        return out

    def batches_per_epoch(self) -> int:
        return self.n_windows // self.batch


def validation_loader(val_arrays, batch, seq, vocab_size):
    """The in-order loader of the validation data (batches of up to ``batch``), or None when it makes no sequence."""
    if not val_arrays:
        return None
    n = sum(max(0, (a.size - 1) // seq) for a in val_arrays if a.size > seq)
    if n == 0:
        return None
    return BatchLoader(val_arrays, min(batch, n), seq, shuffle=False, name="validation", vocab_size=vocab_size)


class ValidationSplit:
    """The sequences one evaluation reads, the same however the ranks split the batch (chapter 9).

    The first ``count`` windows of the validation data, in order, cut into chunks of ``batch`` rows (the last
    may be shorter); chunk i is rank ``i mod world``'s. Each rank adds up ``mean loss × rows`` of its chunks, and
    the sums over the ranks, divided by ``count``, give the mean loss per sequence: one number that depends only
    on ``count``, never on the number of ranks, the batch or the micro-batches (to fp32 rounding).
    """

    def __init__(self, loader: BatchLoader, count: int, *, rank: int = 0, world: int = 1):
        self.loader, self.rank, self.world = loader, rank, world
        self.count = min(int(count), loader.n_windows)

    def chunks(self):
        """This rank's chunks, each an int32 ``[2, rows, seq]`` host array (inputs, targets)."""
        b, seq = self.loader.batch, self.loader.seq
        for i, lo in enumerate(range(0, self.count, b)):
            if i % self.world != self.rank:
                continue
            rows = min(b, self.count - lo)
            out = np.empty((2, rows, seq), dtype=np.int32)
            for r in range(rows):
                win = self.loader._window(lo + r)
                out[0, r], out[1, r] = win[:-1], win[1:]
            vocab = self.loader.vocab_size
            if vocab is not None and int(out.max()) >= vocab:
                raise DataError(f"the validation data has token id {int(out.max())} but the model's vocabulary is "
                                f"{vocab}")
            yield out

    def loss_sums(self, model):
        """``[Σ mean loss × rows, rows]`` over this rank's chunks, summed on the device (no host sync): a float32
        array whose sum over the ranks, first over second, is the mean loss per sequence."""
        xp = model.xp
        total = xp.zeros(2, dtype=np.float32)
        for chunk in self.chunks():
            b = backend.to_device(chunk, xp)
            total[0:1] += model.loss(b[0], b[1]).astype(np.float32) * np.float32(chunk.shape[1])
            total[1:2] += np.float32(chunk.shape[1])
        return total


# the tokenizers and DataError live in tokenizers.py; they are still importable from here
__all__ = ["BYTE_VOCAB", "EMBEDDED", "GPT2_VOCAB", "PREPARE_INFO", "SHARD_MAGIC", "BatchLoader", "ByteTokenizer",
           "Corpus", "DataError", "DataStream", "GPT2Tokenizer", "GPUPrefetcher", "data_files", "embedded_corpus",
           "get_tokenizer", "is_shard", "load_corpus", "need_file", "read_shard", "read_text", "shard_tokenizer",
           "stdlib_files", "ValidationSplit", "validation_loader", "write_shard"]
