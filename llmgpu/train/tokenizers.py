"""Tokenizers: UTF-8 bytes (vocabulary 256, nothing to install) and GPT-2's BPE through ``tiktoken``.

Both encode bytes of text to token ids (``encode_bytes``, what ``llmgpu prepare`` calls on each piece of a
file), text to ids (``encode``) and ids back to text (``decode``). A run records the name of its tokenizer
in its checkpoint (``meta.json``), and ``llmgpu sample`` decodes with it.

GPT-2's vocabulary (``vocab.bpe``, ``encoder.json``) is not part of the ``tiktoken`` wheel: the first use
downloads it into ``TIKTOKEN_CACHE_DIR`` (else a temporary directory). Offline, the same ranks in tiktoken's
own file format (one ``base64-token rank`` per line; ``openai-whisper`` ships one as ``assets/gpt2.tiktoken``)
can be named by ``LLMGPU_GPT2_RANKS``. Without either, the GPT-2 tokenizer is unavailable, and whatever needs
it says so in one line (``DataError``). Tests build a
small ``tiktoken.Encoding`` in-process and pass it as ``GPT2Tokenizer(encoding=...)``.
"""

from __future__ import annotations

import os

import numpy as np

BYTE_VOCAB = 256
GPT2_VOCAB = 50257
GPT2_EOT = 50256  # <|endoftext|>


class DataError(ValueError):
    """Bad training data (missing file, bad shard header, token ids the model cannot embed...).

    The message is one line meant for the user; the CLI prints it without a traceback.
    """


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, needs nothing installed."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    eot = None  # no token is free to mark a document boundary

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_gpt2_encoding():
    """``tiktoken``'s GPT-2 encoding, or a one-line ``DataError`` saying what is missing."""
    try:
        import tiktoken
    except ImportError:
        raise DataError("the GPT-2 tokenizer needs tiktoken: pip install 'llmgpu[bpe]'") from None
    ranks_file = os.environ.get("LLMGPU_GPT2_RANKS")
    if ranks_file:
        return _encoding_from_ranks(tiktoken, ranks_file)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network to fetch the vocabulary files, a damaged cache, ...
        raise DataError("tiktoken's GPT-2 vocabulary is not cached here and cannot be downloaded "
                        f"({type(e).__name__}): run once with network access, point TIKTOKEN_CACHE_DIR at a copied "
                        "tiktoken cache, or LLMGPU_GPT2_RANKS at a gpt2.tiktoken ranks file") from None


def _encoding_from_ranks(tiktoken, path: str):
    """GPT-2's encoding from a ranks file: GPT-2's split pattern and <|endoftext|> after the 50256 ranks."""
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer pattern, defined once there

    try:
        ranks = load_tiktoken_bpe(path)
    except Exception as e:
        raise DataError(f"LLMGPU_GPT2_RANKS={path}: not a tiktoken ranks file ({type(e).__name__}: {e})") from None
    if len(ranks) != GPT2_EOT or sorted(ranks.values()) != list(range(GPT2_EOT)):
        raise DataError(f"LLMGPU_GPT2_RANKS={path}: {len(ranks)} ranks, GPT-2's vocabulary has {GPT2_EOT} "
                        "(plus <|endoftext|>)")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB)


class GPT2Tokenizer:
    """GPT-2 BPE through ``tiktoken`` (``encoding``: a ``tiktoken.Encoding``; default GPT-2's).

    ``required=False``: when the encoding cannot be loaded, ``encode`` raises the reason and ``decode`` shows
    token ids as numbers (a GPT-2 run can still be sampled on a machine without the vocabulary)."""

    name = "gpt2"

    def __init__(self, encoding=None, *, required: bool = False):
        self.reason = None
        if encoding is None:
            try:
                encoding = load_gpt2_encoding()
            except DataError as e:
                if required:
                    raise
                self.reason = str(e)
        self._enc = encoding

    @property
    def available(self) -> bool:
        return self._enc is not None

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab if self._enc is not None else GPT2_VOCAB

    @property
    def eot(self) -> int | None:
        return self._enc.eot_token if self._enc is not None else GPT2_EOT

    def _need(self):
        if self._enc is None:
            raise DataError(f"{self.reason}; or give a prompt as token ids (--prompt ids:50256,464)")
        return self._enc

    def encode(self, text: str) -> list[int]:
        return self._need().encode(text, allowed_special={"<|endoftext|>"})

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Ids of UTF-8 text; special-token strings in it are ordinary text (as llm.c's data scripts do)."""
        ids = self._need().encode_ordinary(data.decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint16)

    def decode(self, ids) -> str:
        if self._enc is None:
            return " ".join(str(int(i)) for i in ids)
        return self._enc.decode([int(i) for i in ids])


TOKENIZERS = ("gpt2", "bytes")


def get_tokenizer(name: str, *, required: bool = False):
    """The tokenizer called ``name`` ('bytes' or 'gpt2'); ``required``: fail now if it cannot encode."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(required=required)
    raise DataError(f"unknown tokenizer {name!r} ({' or '.join(TOKENIZERS)})")


__all__ = ["BYTE_VOCAB", "GPT2_EOT", "GPT2_VOCAB", "TOKENIZERS", "ByteTokenizer", "DataError", "GPT2Tokenizer",
           "get_tokenizer", "load_gpt2_encoding"]
