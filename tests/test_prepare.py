"""``llmgpu prepare`` (text -> llm.c shards, parallel, streaming), the tokenizers it uses, and ``llmgpu eval``.

The GPT-2 BPE path runs on a tiny ``tiktoken.Encoding`` built here (GPT-2's pre-tokenizer pattern, the 256
bytes and a few merges), so no vocabulary is downloaded; the offline path of the real one is checked with
tiktoken's download made to fail.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from llmgpu.cli import main
from llmgpu.interop import hf
from llmgpu.model import GPT, GPTConfig
from llmgpu.train import ConfigError, TrainConfig, Trainer, evaluate
from llmgpu.train import prepare as prep
from llmgpu.train.data import SHARD_HEADER_INTS, SHARD_MAGIC, BatchLoader, load_corpus, read_shard
from llmgpu.train.pretrained import from_pretrained
from llmgpu.train.tokenizers import ByteTokenizer, DataError, GPT2Tokenizer, get_tokenizer

pytestmark = pytest.mark.ch7

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEXT = ("def f(x):\n    return x  # the end\n\n\nclass A:\n  pass\r\nwörld ✓ héllo\n \n\tthe them then\n"
        "<|endoftext|> is plain text here\n") * 7


@pytest.fixture(scope="module")
def tiny_bpe():
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed (the 'bpe' extra)")
    ranks = {bytes([i]): i for i in range(256)}
    for m in (b"th", b"the", b" t", b" the", b"  ", b"    ", b"\n\n", b"re", b"turn", b"en"):
        ranks.setdefault(m, len(ranks))
    enc = tiktoken.Encoding("tiny-gpt2-like", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    return GPT2Tokenizer(encoding=enc)


# --------------------------------------------------------------------------- streaming pieces


def test_safe_cut_ends_after_a_newline_before_a_printable_character():
    assert prep.safe_cut(b"ab\ncd\n ef") == 3  # not before the space: a newline joins following whitespace
    assert prep.safe_cut(b"abc") == 0 and prep.safe_cut(b"a\n") == 0 and prep.safe_cut(b"a\n\nb") == 3


@pytest.mark.parametrize("piece", [1, 5, 17, 1 << 20])
def test_pieces_give_the_tokens_of_the_whole_file(tmp_path, tiny_bpe, piece):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    pieces = list(prep.text_pieces(f, piece))
    assert b"".join(pieces) == f.read_bytes() and (len(pieces) > 5) == (piece < 100)
    whole = [tiny_bpe.eot] + tiny_bpe._enc.encode_ordinary(TEXT)
    assert prep.encode_file(f, tiny_bpe, piece).tolist() == whole
    assert prep.encode_file(f, ByteTokenizer(), piece).tolist() == list(f.read_bytes())  # no separator token


def test_a_file_without_newlines_is_still_read_in_pieces(tmp_path):
    f = tmp_path / "one-line.txt"
    f.write_text("ö" * 1000, encoding="utf-8")
    pieces = list(prep.text_pieces(f, 4))
    assert len(pieces) > 1 and max(len(p) for p in pieces) <= 64 * 4 + 4
    assert all(p.decode("utf-8") for p in pieces)  # never inside a character
    assert b"".join(pieces) == f.read_bytes()


# --------------------------------------------------------------------------- prepare


def _inputs(tmp_path, n=5):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(n):
        (d / f"doc{i}.txt").write_text(TEXT[: 150 + 97 * i] + f"\ndocument {i}\n", encoding="utf-8")
    return d


@pytest.mark.parametrize("workers", [1, 3])
def test_prepare_writes_llmc_shards_in_input_order(tmp_path, tiny_bpe, workers):
    src = _inputs(tmp_path)
    out = tmp_path / f"out{workers}"
    s = prep.prepare([src], out, tokenizer=tiny_bpe, val_fraction=0.1, shard_tokens=500, workers=workers,
                     piece_bytes=64, progress=False)
    files = sorted(src.glob("*.txt"))
    stream = np.concatenate([prep.encode_file(f, tiny_bpe) for f in files])
    n_val = round(stream.size * 0.1)
    assert s["tokens"] == stream.size and s["val_tokens"] == n_val and len(s["train_shards"]) > 1
    for name in s["train_shards"] + s["val_shards"]:
        header = np.fromfile(out / name, dtype="<i4", count=SHARD_HEADER_INTS)
        assert header[0] == SHARD_MAGIC and header[1] == 1 and header[2] <= 500
    train = np.concatenate([read_shard(out / n) for n in s["train_shards"]])
    val = np.concatenate([read_shard(out / n) for n in s["val_shards"]])
    assert np.array_equal(np.concatenate([train, val]), stream) and val.size == n_val  # the end is validation
    info = json.loads((out / "prepare.json").read_text())
    assert info["tokenizer"] == "gpt2" and info["files"] == 5 and info["inputs"] == [str(f) for f in files]
    c = load_corpus(str(out))
    assert c.tokenizer == "gpt2" and c.n_train == train.size and c.n_val == val.size
    assert not (out / ".prepare-tmp").exists()


def test_worker_count_does_not_change_the_shards(tmp_path, tiny_bpe):
    src = _inputs(tmp_path, 7)
    a = prep.prepare([src], tmp_path / "a", tokenizer=tiny_bpe, workers=1, shard_tokens=300, progress=False)
    b = prep.prepare([str(src / "*.txt")], tmp_path / "b", tokenizer=tiny_bpe, workers=4, shard_tokens=300,
                     progress=False)
    assert a["train_shards"] == b["train_shards"]
    for n in a["train_shards"] + a["val_shards"]:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()


def test_prepared_byte_shards_train_and_sample_as_bytes(tmp_path, capsys):
    src = _inputs(tmp_path, 3)
    assert main(["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", "bytes", "--quiet"]) == 0
    c = load_corpus(str(tmp_path / "s"))
    assert c.tokenizer == "bytes" and c.vocab_size == 256 and c.n_val > 0
    run = ["train", "--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "2", "--quiet",
           "--no-plot", "--sample-tokens", "0", "--eval-every", "0", "--data", str(tmp_path / "s"), "--out",
           str(tmp_path / "r")]
    assert main(run) == 0
    assert json.loads((tmp_path / "r" / "checkpoint" / "meta.json").read_text())["tokenizer"] == "bytes"
    capsys.readouterr()
    assert main(["sample", "--from", str(tmp_path / "r"), "--prompt", "class", "--tokens", "8", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out.startswith("class")  # decoded as bytes, not shown as GPT-2 ids


def test_prepare_shows_progress_and_refuses_to_write_over_shards(tmp_path, capsys, one_error_line):
    src = _inputs(tmp_path, 2)
    assert main(["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", "bytes", "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "llmgpu prepare: 2 file(s)" in err and "2/2" in err and "done:" in err
    one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", "bytes"]),
                   "already holds shards", "--overwrite")
    assert main(["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", "bytes", "--overwrite",
                 "--quiet", "--val-fraction", "0"]) == 0
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["prepare.json", "train_000000.bin"]
    # a .bin that is no shard (a model's pickle) is in the way, --overwrite or not, and never removed
    (tmp_path / "s" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a zip archive")
    for more in ([], ["--overwrite"]):
        one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", "bytes", *more]),
                       "holds pytorch_model.bin, which is no token shard")
    assert (tmp_path / "s" / "pytorch_model.bin").read_bytes() == b"PK\x03\x04 a zip archive"
    # binary inputs (a shard, weights) are not tokenized as text
    (src / "z.txt").write_bytes((tmp_path / "s" / "train_000000.bin").read_bytes())
    one_error_line(main(["prepare", str(src / "z.txt"), "--out", str(tmp_path / "u"), "--tokenizer", "bytes"]),
                   "z.txt is not text", "like an llm.c token shard")
    (src / "z.txt").write_bytes(b"text, then \0\x01\x02 bytes")
    one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "u"), "--tokenizer", "bytes"]),
                   "z.txt is not text", "it looks binary")
    assert not (tmp_path / "u").exists()
    (src / "z.txt").unlink()
    capsys.readouterr()
    one_error_line(main(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "t"), "--tokenizer",
                         "bytes"]), "nope.txt does not exist")
    one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "t"), "--tokenizer", "bytes",
                         "--val-fraction", "1.5"]), "--val-fraction")


def test_prepare_input_that_is_not_a_file_says_so(tmp_path, one_error_line):
    one_error_line(main(["prepare", os.devnull, "--out", str(tmp_path / "s"), "--tokenizer", "bytes"]),
                   f"input {os.devnull} is not a regular file")
    assert not (tmp_path / "s").exists()


def test_gpt2_offline_without_a_cached_vocabulary_is_one_line(tmp_path, monkeypatch, capsys, one_error_line):
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (the 'bpe' extra)")
    import tiktoken.load
    import tiktoken.registry

    def no_network(url):
        raise ConnectionError(f"Failed to resolve {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing loaded in this process yet
    src = _inputs(tmp_path, 1)
    one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "s")]), "TIKTOKEN_CACHE_DIR", "not cached")
    with pytest.raises(DataError) as e:
        get_tokenizer("gpt2", required=True)
    assert "pip install tiktoken" not in str(e.value)
    assert not GPT2Tokenizer().available and GPT2Tokenizer().decode([1, 2]) == "1 2"  # samples still show ids
    # and eval on text with a GPT-2-vocabulary model needs the same vocabulary
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=50257, block_size=16)
    d = hf.export_hf(tmp_path / "hf", cfg, GPT(cfg, xp=np).state_dict(), tokenizer="gpt2")
    capsys.readouterr()
    one_error_line(main(["eval", "--from", str(d), "--data", str(src / "doc0.txt"), "--device", "cpu"]),
                   "TIKTOKEN_CACHE_DIR")


def test_gpt2_ranks_file_loads_offline_and_a_wrong_file_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (the 'bpe' extra)")
    import base64
    # a ranks file in tiktoken's format with GPT-2's count: the 256 bytes, then two-byte merges
    tokens = [bytes([i]) for i in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    good = tmp_path / "gpt2.tiktoken"
    good.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens[:50256])))
    monkeypatch.setenv("LLMGPU_GPT2_RANKS", str(good))
    tok = get_tokenizer("gpt2", required=True)
    assert tok.vocab_size == 50257 and tok.eot == 50256
    assert tok.encode("ab<|endoftext|>")[-1] == 50256 and tok.decode(tok.encode("ab ba")) == "ab ba"
    assert 50256 not in tok.encode_bytes(b"ab<|endoftext|>")  # in data files it is plain text
    short = tmp_path / "short.tiktoken"
    short.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens[:300])))
    for path, words in ((short, "300 ranks"), (tmp_path / "missing.tiktoken", "not a tiktoken ranks file")):
        monkeypatch.setenv("LLMGPU_GPT2_RANKS", str(path))
        with pytest.raises(DataError, match=words):
            get_tokenizer("gpt2", required=True)


def test_without_tiktoken_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match=r"needs tiktoken: pip install 'llmgpu\[bpe\]'"):
        get_tokenizer("gpt2", required=True)


# --------------------------------------------------------------------------- eval


def _run(tmp_path):
    out = tmp_path / "r"
    Trainer(TrainConfig(preset="tiny", device="cpu", batch=2, seq=16, steps=2, eval_every=0, progress=False,
                        sample_tokens=0, plot=False, out=str(out))).run()
    return out


def test_eval_is_the_mean_loss_and_its_perplexity(tmp_path, capsys):
    out = _run(tmp_path)
    text = tmp_path / "held-out.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    assert main(["eval", "--from", str(out), "--data", str(text), "--batch", "4", "--seq", "32", "--device", "cpu",
                 "--json", str(tmp_path / "e.json")]) == 0
    cap = capsys.readouterr()
    result = json.loads(cap.out)
    assert result == json.loads((tmp_path / "e.json").read_text())
    assert "/" in cap.err and "loss" in cap.err  # the progress line
    model = from_pretrained(out, xp=np)
    loader = BatchLoader([np.frombuffer(text.read_bytes(), np.uint8)], 4, 32, shuffle=False)
    losses = [float(model.loss(*loader.next_host())) for _ in range(loader.batches_per_epoch())]
    assert result["batches"] == len(losses) and result["tokens"] == len(losses) * 4 * 32
    assert result["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert result["tokenizer"] == "bytes" and result["model"].startswith("llmgpu run")
    # the same model as a Hugging Face directory gives the same numbers; --max-batches cuts the walk short
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["eval", "--from", str(tmp_path / "hf"), "--data", str(text), "--batch", "4", "--seq", "32",
                 "--device", "cpu", "--quiet", "--max-batches", "2"]) == 0
    cap = capsys.readouterr()
    short = json.loads(cap.out)
    assert short["batches"] == 2 and short["loss"] == pytest.approx(np.mean(losses[:2]), rel=1e-6) and not cap.err


def test_eval_takes_the_validation_shards_and_checks_tokens(tmp_path, capsys, one_error_line):
    out = _run(tmp_path)
    src = _inputs(tmp_path, 4)
    prep.prepare([src], tmp_path / "s", tokenizer="bytes", val_fraction=0.3, progress=False)
    r = evaluate.run_eval(str(out), str(tmp_path / "s"), batch=2, seq=16, device="cpu", progress=False)
    n_val = json.loads((tmp_path / "s" / "prepare.json").read_text())["val_tokens"]
    assert r["batches"] == (n_val - 1) // 16 // 2 and "validation shard" in r["notes"][0]
    prep.prepare([src], tmp_path / "g", tokenizer=ByteTokenizer(), progress=False)
    (tmp_path / "g" / "prepare.json").write_text(json.dumps({"tokenizer": "gpt2"}))  # as if GPT-2 tokens
    capsys.readouterr()
    one_error_line(main(["eval", "--from", str(out), "--data", str(tmp_path / "g"), "--device", "cpu"]),
                   "gpt2 tokens", "reads bytes tokens")
    one_error_line(main(["eval", "--from", str(out), "--data", str(src), "--seq", "512", "--device", "cpu"]),
                   "--seq 512 exceeds the model's block size 128")


def test_eval_tokenizes_text_with_the_models_bpe(tmp_path, tiny_bpe, monkeypatch):
    monkeypatch.setattr(evaluate, "get_tokenizer", lambda name, required=False: tiny_bpe)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    arrays, tok, _ = evaluate.eval_tokens(str(f), "gpt2")
    assert tok == "gpt2" and arrays[0].tolist() == [tiny_bpe.eot] + tiny_bpe._enc.encode_ordinary(TEXT)


# --------------------------------------------------------------------------- --overwrite never loses the old output

def test_a_file_named_twice_is_tokenized_once_with_a_note(tmp_path, capsys):
    """doc1.txt named itself, through its directory and through a glob (and a path spelled otherwise): one copy of
    its tokens, in its first place, and a note; the shards equal those of the files named once."""
    src = _inputs(tmp_path, 3)
    args = ["--tokenizer", "bytes", "--val-fraction", "0.25", "--shard-tokens", "400", "--quiet"]
    assert main(["prepare", str(src / "doc1.txt"), str(src), str(src / "*.txt"), str(src / ".." / "in" / "doc1.txt"),
                 "--out", str(tmp_path / "a"), *args]) == 0
    err = capsys.readouterr().err
    assert "llmgpu: note: 5 input file(s) named more than once" in err and "tokenized once" in err
    assert main(["prepare", *(str(src / f"doc{i}.txt") for i in (1, 0, 2)), "--out", str(tmp_path / "b"), *args]) == 0
    assert _snapshot(tmp_path / "a").keys() == _snapshot(tmp_path / "b").keys()
    assert {k: v for k, v in _snapshot(tmp_path / "a").items() if k.suffix == ".bin"} == \
        {k: v for k, v in _snapshot(tmp_path / "b").items() if k.suffix == ".bin"}
    info = json.loads((tmp_path / "a" / "prepare.json").read_text())
    assert [Path(f).name for f in info["inputs"]] == ["doc1.txt", "doc0.txt", "doc2.txt"]


def _snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fault", ["tokenizing", "ctrl-c", "writing shards", "publishing"])
def test_a_failed_overwrite_keeps_the_old_output_and_no_staging(tmp_path, monkeypatch, fault):
    src = _inputs(tmp_path, 3)
    out = tmp_path / "s"
    prep.prepare([src], out, tokenizer="bytes", val_fraction=0.2, shard_tokens=300, progress=False)
    (out / "notes.md").write_text("the user's own file")
    before = _snapshot(out)
    real_tokenize, real_replace, calls = prep._tokenize_to_file, os.replace, []

    def tokenize(task):
        calls.append(task)
        if len(calls) == 2:
            raise KeyboardInterrupt if fault == "ctrl-c" else OSError(28, "No space left on device", str(task[1]))
        return real_tokenize(task)

    def replace(a, b):  # fails once two new files are in place and the old ones moved aside
        calls.append(b)
        if Path(b).parent == out and len([c for c in calls if Path(c).parent == out]) == 3:
            raise OSError(5, "Input/output error", str(b))
        return real_replace(a, b)

    if fault in ("tokenizing", "ctrl-c"):
        monkeypatch.setattr(prep, "_tokenize_to_file", tokenize)
    elif fault == "writing shards":
        monkeypatch.setattr(prep, "write_shard", lambda path, tokens: (_ for _ in ()).throw(OSError(28, "full")))
    else:
        monkeypatch.setattr(prep.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt if fault == "ctrl-c" else OSError):
        prep.prepare([src], out, tokenizer="bytes", val_fraction=0.5, shard_tokens=200, workers=1, overwrite=True,
                     progress=False)
    monkeypatch.undo()
    assert _snapshot(out) == before  # the old shards, prepare.json and the user's file, byte for byte
    assert not (out / prep.STAGING).exists()


def test_a_failed_prepare_into_a_new_directory_leaves_no_directory(tmp_path, one_error_line):
    src = _inputs(tmp_path, 1)
    one_error_line(main(["prepare", str(src), "--out", str(tmp_path / "a" / "b" / "c"), "--tokenizer", "bytes",
                         "--val-fraction", "0.99999999", "--quiet"]), "nothing left to train on")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("layout", ["out inside the input directory", "out is the input directory"])
def test_overwrite_with_out_inside_the_inputs_reads_none_of_its_own_files(tmp_path, capsys, layout):
    """Its own shards, prepare.json (a .json, a text suffix) and staging are never inputs; a second --overwrite
    gives the same shards as the first, and those of a prepare into a directory elsewhere."""
    src = _inputs(tmp_path, 3)
    out = src / "shards" if layout.startswith("out inside") else src
    elsewhere = tmp_path / "elsewhere"
    args = ["--tokenizer", "bytes", "--val-fraction", "0.25", "--shard-tokens", "400", "--quiet"]
    assert main(["prepare", str(src), "--out", str(elsewhere), *args]) == 0
    assert main(["prepare", str(src), "--out", str(out), *args]) == 0
    first = {k: v for k, v in _snapshot(out).items() if k.suffix == ".bin"}
    assert main(["prepare", str(src), "--out", str(out), *args, "--overwrite"]) == 0
    assert main(["prepare", f"{src}/**", "--out", str(out), *args, "--overwrite"]) == 0  # a glob too
    shards = {k: v for k, v in _snapshot(out).items() if k.suffix == ".bin"}
    assert shards == first == {k: v for k, v in _snapshot(elsewhere).items() if k.suffix == ".bin"}
    info = json.loads((out / "prepare.json").read_text())
    assert sorted(Path(p).name for p in info["inputs"]) == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert not (out / prep.STAGING).exists() and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("kw,needle", [(dict(shard_tokens=2.5), "--shard-tokens must be an integer"),
                                       (dict(shard_tokens=True), "--shard-tokens must be an integer"),
                                       (dict(workers=1.0), "--workers must be an integer")])
def test_prepare_counts_are_integers(tmp_path, kw, needle):
    with pytest.raises(DataError, match=needle):
        prep.prepare([_inputs(tmp_path, 1)], tmp_path / "s", tokenizer="bytes", progress=False, **kw)
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------- eval --data stdlib

def test_eval_of_stdlib_is_its_validation_split_with_a_bounded_default(tmp_path, capsys, monkeypatch):
    """What a user who trained on the default corpus types: the split train held out (the run's --val-fraction),
    at most EMBEDDED_EVAL_BATCHES batches unless --max-batches, and it says so (JSON notes and stderr)."""
    out = _run(tmp_path)
    monkeypatch.setattr(evaluate, "EMBEDDED_EVAL_BATCHES", 3)  # the bound, small enough for a test
    capsys.readouterr()
    assert main(["eval", "--from", str(out), "--data", "stdlib", "--batch", "2", "--seq", "16", "--device", "cpu",
                 "--quiet"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert r["batches"] == 3 and any("validation split" in n for n in r["notes"])
    assert any("at most 3 batches" in n and "--max-batches" in n for n in r["notes"])
    assert all(f"llmgpu: note: {n}" in cap.err for n in r["notes"])
    val = load_corpus("stdlib", val_fraction=TrainConfig().val_fraction).val
    want = evaluate.evaluate(from_pretrained(out, xp=np), val, batch=2, seq=16, max_batches=3, progress=False)
    assert r["loss"] == pytest.approx(want["loss"], rel=1e-6)
    r2 = evaluate.run_eval(str(out), "stdlib", batch=2, seq=16, max_batches=2, device="cpu", progress=False)
    assert r2["batches"] == 2 and not any("at most" in n for n in r2["notes"])


def test_eval_help_lists_stdlib(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'stdlib' (the embedded corpus" in text and f"at most {evaluate.EMBEDDED_EVAL_BATCHES} batches" in text


@pytest.mark.parametrize("kw,needle", [(dict(max_batches=2.5), "--max-batches"), (dict(batch=2.0), "--batch"),
                                       (dict(seq=True), "--seq")])
def test_eval_counts_are_integers(tmp_path, kw, needle):
    out = _run(tmp_path)
    with pytest.raises(ConfigError, match=f"{needle} must be an integer"):
        evaluate.run_eval(str(out), "stdlib", **{"batch": 2, "seq": 16, **kw}, device="cpu", progress=False)


@pytest.mark.parametrize("where,needle", [("nodir/r.json", "nodir does not exist"), (".", "is a directory"),
                                          ("a.txt/r.json", "a.txt is not a directory")])
def test_eval_refuses_a_json_path_it_cannot_write_before_it_evaluates(tmp_path, monkeypatch, where, needle,
                                                                       one_error_line):
    """``eval --json`` to a path that cannot be written is one line up front, not after the evaluation."""
    def run_eval(*a, **kw):
        raise AssertionError("evaluated before the --json path was checked")

    monkeypatch.setattr(evaluate, "run_eval", run_eval)
    (tmp_path / "a.txt").write_text("a file")
    one_error_line(main(["eval", "--from", str(tmp_path), "--data", "stdlib", "--json", str(tmp_path / where)]),
                   "--json", needle)


def test_eval_reads_byte_shards_as_their_text_for_a_bpe_model(tmp_path, tiny_bpe, monkeypatch):
    """prepare's byte shards hold uint16 ids: their raw memory read as text put a zero byte after every character,
    and a GPT-2 model was evaluated on that, silently (64 tokens instead of 576 in the audit)."""
    monkeypatch.setattr(evaluate, "get_tokenizer", lambda name, required=False: tiny_bpe)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    assert main(["prepare", str(f), "--out", str(tmp_path / "s"), "--tokenizer", "bytes", "--val-fraction", "0",
                 "--quiet"]) == 0
    arrays, tok, _ = evaluate.eval_tokens(str(tmp_path / "s"), "gpt2")
    assert tok == "gpt2" and np.concatenate(arrays).tolist() == [tiny_bpe.eot] + tiny_bpe._enc.encode_ordinary(TEXT)
