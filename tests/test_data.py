"""Chapter 7 data: embedded corpus, llm.c shards, text files, split, seeded shuffling, loader position."""

from __future__ import annotations

import os

import numpy as np
import pytest

from llmgpu.train import data as D

pytestmark = pytest.mark.ch7


def test_embedded_corpus_is_reproducible_and_real_text():
    files = D.stdlib_files()
    assert len(files) > 100
    rel = [p.as_posix() for p in files]
    assert rel == sorted(rel)  # reproducible order
    assert not any("/test/" in r or "site-packages" in r for r in rel)
    a = D.embedded_corpus(max_bytes=200_000)
    b = D.embedded_corpus(max_bytes=200_000)
    assert a == b and len(a) == 200_000
    assert b"def " in a and b"import " in a


def test_load_corpus_default_split_and_vocab():
    c = D.load_corpus(None, val_fraction=0.1, max_bytes=100_000)
    assert c.tokenizer == "bytes" and c.vocab_size == 256
    assert c.n_train + c.n_val == 100_000
    assert abs(c.n_val - 10_000) <= 1
    # the validation set is the tail of the stream, disjoint from training
    whole = np.concatenate(c.train + c.val)
    assert np.array_equal(whole, np.frombuffer(D.embedded_corpus(max_bytes=100_000), np.uint8))


def test_shard_roundtrip_and_header_validation(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, size=1000)
    p = D.write_shard(tmp_path / "x_train_000.bin", toks)
    got = D.read_shard(p)
    assert got.dtype == np.dtype("<u2") and np.array_equal(got, toks)
    raw = p.read_bytes()
    # wrong magic
    bad = tmp_path / "bad.bin"
    hdr = np.frombuffer(raw[:1024], "<i4").copy()
    hdr[0] = 1234
    bad.write_bytes(hdr.tobytes() + raw[1024:])
    with pytest.raises(D.DataError, match="magic 1234, expected 20240520"):
        D.read_shard(bad)
    # wrong version
    hdr[0], hdr[1] = D.SHARD_MAGIC, 2
    bad.write_bytes(hdr.tobytes() + raw[1024:])
    with pytest.raises(D.DataError, match="version 2"):
        D.read_shard(bad)
    # token count does not match the file size
    hdr[1] = 1
    bad.write_bytes(hdr.tobytes() + raw[1024:-2])
    with pytest.raises(D.DataError, match="header says 1000 tokens"):
        D.read_shard(bad)
    # a header of no tokens
    hdr[2] = 0
    bad.write_bytes(hdr.tobytes())
    with pytest.raises(D.DataError, match="its header says it holds 0 tokens: an empty or damaged shard"):
        D.read_shard(bad)
    # too short for a header
    bad.write_bytes(b"\0" * 100)
    with pytest.raises(D.DataError, match="shorter than"):
        D.read_shard(bad)
    with pytest.raises(D.DataError, match="does not exist"):
        D.read_shard(tmp_path / "missing.bin")


def test_shard_train_val_by_name_and_vocab_check(tmp_path):
    rng = np.random.default_rng(1)
    D.write_shard(tmp_path / "d_train_000.bin", rng.integers(0, 100, 3000))
    D.write_shard(tmp_path / "d_train_001.bin", rng.integers(0, 100, 3000))
    val = rng.integers(0, 100, 500)
    val[7] = 50300  # beyond GPT-2's vocabulary
    D.write_shard(tmp_path / "d_val_000.bin", val)
    c = D.load_corpus(str(tmp_path))
    assert c.tokenizer == "gpt2" and c.n_train == 6000 and c.n_val == 500
    assert c.max_token == 50300 and c.vocab_size == 50301
    c.check_vocab(50301)
    with pytest.raises(D.DataError, match="token id 50300 but the model's vocabulary is 50257"):
        c.check_vocab(50257)
    assert [n for n in c.notes if "token id 50300, beyond GPT-2's 50257 tokens" in n]  # not GPT-2 tokens: said
    c2 = D.load_corpus(str(tmp_path / "d_train_*.bin"), val_fraction=0.25)
    assert c2.n_train == 4500 and c2.n_val == 1500 and not c2.notes  # ids within GPT-2's: nothing to say


def test_text_file_and_errors(tmp_path):
    t = tmp_path / "a.txt"
    t.write_text("hello world\n" * 100)
    c = D.load_corpus(str(t), val_fraction=0.1)
    assert c.tokenizer == "bytes" and c.n_train + c.n_val == 1200
    with pytest.raises(D.DataError, match="does not exist"):
        D.load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(D.DataError, match="empty"):
        D.load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(D.DataError, match="no files match"):
        D.load_corpus(str(tmp_path / "*.bin"))


def test_data_that_is_not_a_file_says_what_it_is(tmp_path):
    """/dev/null exists but is no file (it reads as nothing), a glob may match a directory: each says so."""
    with pytest.raises(D.DataError, match=f"data file {os.devnull} is not a regular file"):
        D.load_corpus(os.devnull)
    (tmp_path / "p1").mkdir()
    with pytest.raises(D.DataError, match="'.*p1\\*' matches the directory .*p1: give a pattern that matches files"):
        D.load_corpus(str(tmp_path / "p1*"))
    with pytest.raises(D.DataError, match="token shard .*p1 is a directory"):
        D.read_shard(tmp_path / "p1")
    with pytest.raises(D.DataError, match="text file .*null is not a regular file"):
        D.read_text(os.devnull)


def test_loader_batches_are_next_token_pairs_and_seeded():
    toks = np.arange(1000, dtype=np.uint16)
    L = D.BatchLoader([toks], batch=4, seq=16, seed=3)
    b = L.next_host()
    assert b.shape == (2, 4, 16) and b.dtype == np.int32
    assert np.array_equal(b[0][:, 1:], b[1][:, :-1])  # targets are the inputs shifted by one
    assert np.array_equal(b[1][:, -1], b[0][:, -1] + 1)
    assert all(row[0] % 16 == 0 for row in b[0])  # windows start at multiples of seq
    assert len({int(row[0]) for row in b[0]}) == 4
    L2 = D.BatchLoader([toks], batch=4, seq=16, seed=3)
    assert np.array_equal(L2.next_host(), b)
    L3 = D.BatchLoader([toks], batch=4, seq=16, seed=4)
    assert not np.array_equal(L3.next_host(), b)


def test_loader_epochs_cover_every_window_once():
    toks = np.arange(16 * 10 + 1, dtype=np.uint16)
    L = D.BatchLoader([toks], batch=3, seq=16, seed=0)
    seen = []
    for _ in range(3):  # 10 windows, batch 3: 3 batches per epoch, 1 window dropped
        seen += [int(r[0]) // 16 for r in L.next_host()[0]]
    assert len(set(seen)) == 9
    assert L.state_dict()["epoch"] == 0
    L.next_host()
    assert L.state_dict()["epoch"] == 1


def test_loader_position_restore_reproduces_batches():
    toks = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    A = D.BatchLoader([toks], batch=4, seq=32, seed=7)
    for _ in range(13):
        A.next_host()
    state = A.state_dict()
    rest = [A.next_host() for _ in range(30)]  # crosses epoch boundaries (39 windows / 4)
    B = D.BatchLoader([toks], batch=4, seq=32, seed=7)
    B.load_state_dict(state)
    for want in rest:
        assert np.array_equal(B.next_host(), want)
    C = D.BatchLoader([toks], batch=4, seq=16, seed=7)
    with pytest.raises(D.DataError, match="same data"):
        C.load_state_dict(state)


def test_loader_windows_do_not_cross_files_and_too_small_data():
    a = np.full(33, 1, np.uint16)
    b = np.full(33, 2, np.uint16)
    L = D.BatchLoader([a, b], batch=4, seq=16, seed=0, shuffle=False)
    x = L.next_host()
    for row_x, row_y in zip(x[0], x[1]):
        assert len(set(row_x.tolist() + row_y.tolist())) == 1
    with pytest.raises(D.DataError, match="too few for one batch"):
        D.BatchLoader([a], batch=8, seq=16)


def test_datastream_numpy_state():
    toks = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint8)
    s = D.DataStream(D.BatchLoader([toks], 2, 8, seed=1), np)
    s.next()
    st = s.state_dict()
    x1, y1 = s.next()
    s2 = D.DataStream(D.BatchLoader([toks], 2, 8, seed=1), np)
    s2.load_state_dict(st)
    x2, y2 = s2.next()
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


@pytest.mark.gpu
def test_gpu_prefetcher_matches_host_batches_and_position(cp):
    toks = np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint8)
    ref = D.BatchLoader([toks], 4, 64, seed=5)
    want = [ref.next_host().copy() for _ in range(12)]
    s = D.DataStream(D.BatchLoader([toks], 4, 64, seed=5), cp, async_copy=True)
    state_after_5 = None
    for i in range(12):
        x, y = s.next()
        # work on the compute stream that reads the batch, as a training step would
        assert cp.asnumpy(x).tolist() == want[i][0].tolist()
        assert cp.asnumpy(y).tolist() == want[i][1].tolist()
        if i == 4:
            state_after_5 = s.state_dict()
    s2 = D.DataStream(D.BatchLoader([toks], 4, 64, seed=5), cp, async_copy=True)
    s2.load_state_dict(state_after_5)
    x, _ = s2.next()
    assert cp.asnumpy(x).tolist() == want[5][0].tolist()


def test_loader_checks_each_batch_against_the_vocabulary():
    toks = np.arange(200, dtype=np.uint16)
    L = D.BatchLoader([toks], batch=2, seq=8, seed=0, shuffle=False, vocab_size=100)
    L.next_host()  # ids 0..16
    for _ in range(4):
        L.next_host()
    with pytest.raises(D.DataError, match="token id 1\\d\\d but the model's vocabulary is 100"):
        for _ in range(10):
            L.next_host()
