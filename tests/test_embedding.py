"""Token + position embedding (chapter 3): reference vs finite differences (repeated tokens), CUDA
kernels vs the reference, determinism of the sorted scatter-add, the counting sort and its hot-row
pieces (NumPy models of the kernels' steps on the CPU, blocks in any order, against the definition of
the summation order; on the GPU the kernels against the float64 sum, bit for bit against that order
and against "optimized" on rows of at most PIECE positions, run to run, and under CUDA-graph capture),
bad ids, argument checks."""

import re

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.kernels import loader
from llmgpu.ops import embedding as em
from llmgpu.ops.embedding import METHODS, embedding_backward, embedding_backward_reference, embedding_forward
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array

pytestmark = pytest.mark.ch3


def _inputs(rng, b, t, c, v, max_t=None, dtype="fp32", idx_dtype=np.int64):
    max_t = max_t or t + 3
    idx = rng.integers(0, v, (b, t)).astype(idx_dtype)
    wte = random_array(rng, (v, c), dtype)
    wpe = random_array(rng, (max_t, c), dtype)
    dx = random_array(rng, (b, t, c), dtype)
    return idx, wte, wpe, dx


# --------------------------------------------------------------------------- NumPy reference


def test_forward_matches_direct_formula(rng):
    idx, wte, wpe, _ = _inputs(rng, 3, 5, 4, 11)
    x = embedding_forward(idx, wte, wpe)
    assert x.shape == (3, 5, 4) and x.dtype == np.float32
    for b in range(3):
        for t in range(5):
            np.testing.assert_allclose(x[b, t], wte[idx[b, t]] + wpe[t], rtol=1e-6)


def test_backward_matches_finite_differences_with_repeated_tokens(rng):
    b, t, c, v = 3, 4, 5, 3  # 12 positions over 3 tokens: every token repeats
    idx = rng.integers(0, v, (b, t))
    idx[0, 0] = idx[2, 3] = 1
    wte = rng.standard_normal((v, c))
    wpe = rng.standard_normal((t + 2, c))
    r = rng.standard_normal((b, t, c))

    def loss():
        return float((embedding_forward(idx, wte, wpe) * r).sum())

    dwte, dwpe = embedding_backward(r, idx, v, t + 2)
    check_gradient(loss, wte, dwte, name="dwte")
    check_gradient(loss, wpe, dwpe, name="dwpe")
    np.testing.assert_array_equal(dwpe[t:], 0.0)


def test_backward_accepts_wpe_shape_and_out(rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5, dtype="bf16", idx_dtype=np.int32)
    a = embedding_backward(dx, idx, 5, wpe.shape)
    o1, o2 = poisoned(wte.shape, "bf16", np), poisoned(wpe.shape, "bf16", np)
    b = embedding_backward(dx, idx, 5, wpe.shape[0], dwte_out=o1, dwpe_out=o2)
    assert b[0] is o1 and b[1] is o2 and a[0].dtype == backend.bfloat16
    np.testing.assert_array_equal(a[0].astype(np.float32), o1.astype(np.float32))
    np.testing.assert_array_equal(a[1].astype(np.float32), o2.astype(np.float32))


def test_bad_inputs(rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 5\)"):
        embedding_forward(np.array([[0, 5, 1]]), wte, wpe)
    with pytest.raises(ValueError, match="idx must lie"):
        embedding_backward(dx, np.array([[0, -1, 1], [0, 0, 0]]), 5, wpe.shape[0])
    with pytest.raises(TypeError, match="idx has dtype float64"):
        embedding_forward(idx.astype(np.float64), wte, wpe)
    with pytest.raises(ValueError, match="idx must be 2-D"):
        embedding_forward(idx[0], wte, wpe)
    with pytest.raises(ValueError, match="wpe must have shape"):
        embedding_forward(idx, wte, wpe[:, :3].copy())
    with pytest.raises(TypeError, match="dtypes must match"):
        embedding_forward(idx, wte, wpe.astype(np.float16))
    with pytest.raises(ValueError, match="wpe holds only"):
        embedding_forward(idx, wte, wpe[:2].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        embedding_forward(np.asfortranarray(idx), wte, wpe)
    with pytest.raises(ValueError, match="idx must have shape"):
        embedding_backward(dx, idx[:, :2].copy(), 5, 6)
    with pytest.raises(ValueError, match="max_t is"):
        embedding_backward(dx, idx, 5, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        embedding_backward(dx, idx, 0, 6)
    with pytest.raises(ValueError, match="wpe's shape"):
        embedding_backward(dx, idx, 5, (6, 3))


def test_forward_without_positions_is_the_bare_gather_and_vocab_size_bounds_the_ids(rng):
    """wpe=None (a Llama's embedding): x = wte[idx], bit for bit. vocab_size below wte's rows: the padded rows'
    ids are refused like any other id past the vocabulary."""
    idx, wte, _, _ = _inputs(rng, 3, 5, 6, 9, dtype="bf16", idx_dtype=np.int32)
    x = embedding_forward(idx, wte, None)
    assert x.dtype == wte.dtype and x.shape == (3, 5, 6)
    np.testing.assert_array_equal(x.view(np.uint16), wte[idx].view(np.uint16))
    out = poisoned((3, 5, 6), "bf16", np)
    assert embedding_forward(idx, wte, None, out=out, vocab_size=9) is out
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))
    idx %= 7
    idx[1, 2] = 7
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 7\); 1 do not \(first: idx\[1, 2\] = 7\)"):
        embedding_forward(idx, wte, None, vocab_size=7)
    with pytest.raises(ValueError, match=r"vocab_size must lie in \[1, 9\] \(wte's rows\), got 10"):
        embedding_forward(idx, wte, None, vocab_size=10)
    with pytest.raises(TypeError, match="vocab_size must be an int, got 7.0"):
        embedding_forward(idx, wte, None, vocab_size=7.0)


# --------------------------------------------------------------------------- counting sort, NumPy model
# A NumPy mirror of the "counting" path's kernels (embedding_count_*, embedding_backward_wte_pos's row
# walk and its hot-row pieces), step by step, with the kernels' constants: it checks the index
# arithmetic without a GPU. _counting_order_reference is the summation order's definition, written
# independently of the kernels; the GPU tests compare the kernels' bits with it.


def _counting_sort_model(ids, v, chunk=em.COUNT_CHUNK, scan_block=em.SCAN_BLOCK):
    """Steps a-d of the counting sort; returns (pos, start) as the kernels leave them."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    n = ids.size
    tok = np.where((ids >= 0) & (ids < v), ids, -1)  # emb_token
    nchunks = -(-n // chunk)
    # a. histogram per chunk
    table = np.zeros((nchunks, v), np.int64)
    inr = tok >= 0
    np.add.at(table, (np.flatnonzero(inr) // chunk, tok[inr]), 1)
    # b. exclusive prefix over chunks (in place), column totals, scan inside blocks of scan_block
    #    tokens (tokens 0..V: token V counts 0)
    count = table.sum(axis=0)
    table = np.cumsum(table, axis=0) - table
    nscan = -(-(v + 1) // scan_block)
    blocks = np.zeros(nscan * scan_block, np.int64)
    blocks[:v] = count
    blocks = blocks.reshape(nscan, scan_block)
    local = (np.cumsum(blocks, axis=1) - blocks).reshape(-1)[: v + 1]
    blocksum = blocks.sum(axis=1)
    # c. scan of the block sums; start(v) = blockoff[v // scan_block] + local[v]
    blockoff = np.cumsum(blocksum) - blocksum
    start = blockoff[np.arange(v + 1) // scan_block] + local
    # d. scatter: rank = lanes before in the warp with the same token + entries before the warp
    pos = np.full(start[v], -1, np.int64)
    lane = np.arange(chunk) % 32
    for c in range(nchunks):
        seg = tok[c * chunk : (c + 1) * chunk]
        k = np.arange(seg.size)
        eq = seg[:, None] == seg[None, :]
        before_warp = k[None, :] < (k - lane[: seg.size])[:, None]
        in_warp_before = (k[None, :] < k[:, None]) & ~before_warp
        rank = (eq & in_warp_before).sum(axis=1) + (eq & before_warp).sum(axis=1)
        ok = seg >= 0
        dest = start[seg[ok]] + table[c, seg[ok]] + rank[ok]
        assert (pos[dest] == -1).all() and len(np.unique(dest)) == dest.size, "a slot written twice"
        pos[dest] = c * chunk + k[ok]
    assert (pos >= 0).all(), "a slot never written"
    return pos, start


def _wte_walk_model(d, pos, start, v, rows=em.ROWS_PER_WARP, batch=em.BATCH, piece=em.PIECE):
    """embedding_backward_wte_pos's row walk (a warp per `rows` rows, all columns as one tile), in
    fp32. Rows with more than `piece` positions (hot) are jumped over: returns (dwte with NaN in the
    hot rows, write count per row)."""
    c = d.shape[1]
    dwte = np.full((v, c), np.nan, np.float32)
    writes = np.zeros(v, np.int64)
    for v0 in range(0, v, rows):
        nrows = min(rows, v - v0)
        st = start[v0 : v0 + nrows + 1]  # lane r holds start(v0 + r)
        hot = [st[r + 1] - st[r] > piece for r in range(nrows)]
        qa, qb = st[0], st[nrows]
        r = 0
        acc = np.zeros(c, np.float32)

        def flush(r, acc):
            dwte[v0 + r] = acc
            writes[v0 + r] += 1
            return r + 1, np.zeros(c, np.float32)

        q = qbuf = qa
        buf = pos[qa : min(qa + 32, qb)]  # lane l holds pos[qbuf + l]
        while True:
            h = next((k for k in range(r, nrows) if hot[k]), nrows)  # next hot row
            seg_end = st[h]
            row_end = st[r + 1] if r < nrows else 0
            while q < seg_end:
                if q - qbuf >= 32:
                    qbuf, buf = q, pos[q : min(q + 32, qb)]
                n = min(batch, seg_end - q, qbuf + 32 - q)
                raw = [d[buf[(q - qbuf + u) & 31]] for u in range(n)]
                for u in range(n):
                    while q + u >= row_end:
                        r, acc = flush(r, acc)
                        row_end = st[r + 1]
                    acc = acc + raw[u]
                q += n
            while r < h:
                r, acc = flush(r, acc)
            if h >= nrows:
                break
            r = h + 1  # the hot row: its pieces write it
            q = st[r]
    return dwte, writes


def _hot_pieces_model(d, ids, pos, start, v, piece=em.PIECE, order=None):
    """The hot-row blocks of embedding_backward_wte_pos (emb_hot_piece), run in the block order
    `order` (a permutation of the pieces: the GPU gives no order): each sums its hot rows' slots
    into the carry, counts, and the last block of a row adds the row's parts in piece order.
    Returns {token: fp32 row}."""
    c = d.shape[1]
    nin = int(start[v])
    npieces = -(-ids.size // piece)
    carry, counters, out = {}, {}, {}
    for k in range(npieces) if order is None else order:
        a = k * piece
        if a >= nin:
            continue
        b = min(a + piece, nin)
        rows = []
        for slot in (a, b - 1):
            tok = int(ids[pos[slot]])
            rows.append((int(start[tok]), int(start[tok + 1]), tok))
        for ri, (st, en, tok) in enumerate(rows):
            if ri == 1 and st == rows[0][0]:
                break
            if en - st <= piece:
                continue
            acc = np.zeros(c, np.float32)
            for q in range(max(a, st), min(b, en)):
                acc = acc + d[pos[q]]
            key = 2 * k + (0 if st <= a else 1)
            assert key not in carry, "a carry row written twice"
            carry[key] = acc
            k0, k1 = st // piece, (en - 1) // piece
            counters[k0] = counters.get(k0, 0) + 1
            if counters[k0] == k1 - k0 + 1:  # the last part of row tok: add them in piece order
                s = np.zeros(c, np.float32)
                for kk in range(k0, k1 + 1):
                    s = s + carry[2 * kk + (1 if kk * piece < st else 0)]
                assert tok not in out, "a hot row written twice"
                out[tok] = s
    return out


def _counting_order_reference(d, ids, v, piece=em.PIECE):
    """dwte [v, C] in fp32 summed in the "counting" order, from its definition (module docstring):
    a token with at most `piece` positions is one chain from 0 in ascending position order (the
    np.add.at bits); a hotter token's slots of the stable sort are cut at multiples of `piece`, each
    run summed from 0 in order, the runs' sums added from 0 in order. Vectorised: step r adds the
    r-th element of every run at once (each run gets one addition per step, in order)."""
    d = np.asarray(d, np.float32)
    ids = np.asarray(ids).reshape(-1)
    c = d.shape[1]
    inr = np.flatnonzero((ids >= 0) & (ids < v))
    order = inr[np.argsort(ids[inr], kind="stable")]
    tok = ids[order].astype(np.int64)
    start = np.searchsorted(tok, np.arange(v + 1))
    count = np.diff(start)
    q = np.arange(tok.size)
    hot_slot = count[tok] > piece
    new_run = np.ones(tok.size, bool)
    new_run[1:] = (tok[1:] != tok[:-1]) | (hot_slot[1:] & (q[1:] % piece == 0))
    run_start = np.flatnonzero(new_run)
    run_len = np.diff(np.append(run_start, tok.size))

    def chains(first, length, values):  # fp32 sums from 0 of values[first + r], r < length, per chain
        acc = np.zeros((first.size, values.shape[1]), np.float32)
        for r in range(int(length.max(initial=0))):
            sel = np.flatnonzero(length > r)
            acc[sel] = acc[sel] + values[first[sel] + r]
        return acc

    run_sum = chains(run_start, run_len, d[order])
    dwte = np.zeros((v, c), np.float32)
    run_tok = tok[run_start]
    rows, first, nruns = np.unique(run_tok, return_index=True, return_counts=True)
    dwte[rows] = chains(first, nruns, run_sum)
    return dwte


def _ids(rng, kind, n, v, piece=em.PIECE):
    if kind == "uniform":
        return rng.integers(0, v, n)
    if kind == "same":
        return np.full(n, v // 2)
    if kind == "two":
        return rng.choice([0, v - 1], n)
    if kind == "zipf":  # a few hot tokens, like text
        return np.minimum(rng.zipf(1.3, n) - 1, v - 1)
    if kind == "bad":  # out-of-range ids mixed in
        a = rng.integers(0, v, n)
        a[rng.random(n) < 0.2] = -1
        a[rng.random(n) < 0.1] = v
        a[rng.random(n) < 0.05] = 2**40
        return a
    if kind in ("hot20", "hot50"):  # one token at exactly 20% / 50% of the positions, the rest uniform
        a = rng.integers(0, v, n)
        a[rng.permutation(n)[: round(n * int(kind[3:]) / 100)]] = v // 3
        return a
    if kind == "fewhot":  # three hot tokens (10%, 5%, 2%), the rest uniform
        a = rng.integers(0, v, n)
        perm = rng.permutation(n)
        cuts = np.cumsum([0, n // 10, n // 20, n // 50])
        for tok, lo, hi in zip((v - 1, 0, v // 2), cuts[:-1], cuts[1:]):
            a[perm[lo:hi]] = tok
        return a
    if kind == "borders":  # tokens 0..5 with counts at the piece size's edges, then uniform ids >= 6
        p = piece
        counts = [2 * p, p + 1, p, 2 * p + 1, 3 * p, 1]  # slots [0, 2p), [2p, 3p+1), ...: aligned and not
        a = np.repeat(np.arange(len(counts)), counts)
        assert a.size <= n and v > len(counts)
        a = np.concatenate([a, rng.integers(len(counts), v, n - a.size)])
        return rng.permutation(a)
    raise ValueError(kind)


def test_counting_constants_come_from_the_kernel_source():
    """The host's launch constants are the .cu's #defines (read by the loader), and the widest KP the host asks for
    is the widest the // llmgpu:kernel line instantiates."""
    src = loader.source("embedding")
    for name, value in (("EMB_CHUNK", em.COUNT_CHUNK), ("EMB_SCAN_BLOCK", em.SCAN_BLOCK),
                        ("EMB_ROWS", em.ROWS_PER_WARP), ("EMB_BATCH", em.BATCH), ("EMB_PIECE", em.PIECE),
                        ("EMB_WTE_POS_THREADS", 32 * em.WARPS_PER_BLOCK)):
        m = re.search(rf"^#define {name} (\d+)", src, re.MULTILINE)
        assert m and int(m.group(1)) == value, name
    kps = re.search(r"embedding_backward_wte_pos<[^>]*\{([\d,]+)\}, \{0,1\}>", src).group(1)  # then ACC
    assert kps == ",".join(str(k) for k in range(1, em.MAX_PACKS_PER_LANE + 1))


@pytest.mark.parametrize(
    ("n", "v", "kind", "chunk", "scan_block"),
    [
        (1, 1, "uniform", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (7, 7, "uniform", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (1000, 7, "uniform", em.COUNT_CHUNK, em.SCAN_BLOCK),  # fewer positions than a chunk
        (3 * 1024 + 5, 50257, "uniform", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (3 * 1024 + 5, 300, "same", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (2048, 1, "same", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (2500, 1000, "two", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (4096, 50257, "zipf", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (2000, 13, "bad", em.COUNT_CHUNK, em.SCAN_BLOCK),
        (701, 1000, "uniform", 64, 4),  # small chunks and scan blocks: many of each
        (701, 5, "zipf", 32, 2),
        (700, 9, "bad", 96, 8),
    ],
)
def test_counting_sort_model_is_the_stable_sort(rng, n, v, kind, chunk, scan_block):
    ids = _ids(rng, kind, n, v)
    pos, start = _counting_sort_model(ids, v, chunk, scan_block)
    inr = np.flatnonzero((ids >= 0) & (ids < v))
    np.testing.assert_array_equal(pos, inr[np.argsort(ids[inr], kind="stable")])
    np.testing.assert_array_equal(start, np.searchsorted(np.sort(ids[inr]), np.arange(v + 1)))


def _light(ids, v, piece):
    ok = (ids >= 0) & (ids < v)
    return np.bincount(ids[ok], minlength=v) <= piece


@pytest.mark.parametrize(
    ("n", "v", "kind", "rows", "batch", "piece"),
    [(1, 1, "uniform", em.ROWS_PER_WARP, em.BATCH, em.PIECE), (37, 7, "uniform", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     (300, 1000, "uniform", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     (333, 17, "same", em.ROWS_PER_WARP, em.BATCH, em.PIECE),  # one hot row of 333
     (500, 50257, "zipf", em.ROWS_PER_WARP, em.BATCH, em.PIECE), (400, 41, "two", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     (300, 9, "bad", em.ROWS_PER_WARP, em.BATCH, em.PIECE), (90, 64, "zipf", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     (1000, 5000, "hot20", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     (2000, 10, "borders", em.ROWS_PER_WARP, em.BATCH, em.PIECE),
     # other constants (batches that straddle the 32-position register buffer, odd group sizes,
     # small pieces: many hot rows, several per warp, runs cut at many piece borders)
     (333, 17, "same", 5, 3, 16), (400, 101, "zipf", 3, 5, 8), (250, 30, "uniform", 31, 7, 4),
     (500, 20, "fewhot", 8, 4, 16), (300, 40, "bad", 8, 4, 5), (257, 3, "two", 2, 4, 8),
     (200, 12, "borders", 8, 4, 8), (200, 12, "borders", 3, 2, 16)],
)
def test_counting_row_walk_and_hot_pieces_models_match_reference_bitwise(rng, n, v, kind, rows, batch, piece):
    """The row walk (batches across rows, 32 positions per register load, flushes at row ends, hot
    rows jumped) plus the hot-row pieces (blocks in a random order, last one adds) write every row
    once, with the bits of the "counting" order's definition; rows of at most `piece` positions
    with the bits of np.add.at (ascending position order from 0.0f)."""
    c = 5
    ids = _ids(rng, kind, n, v, piece)
    d = rng.standard_normal((n, c)).astype(np.float32)
    pos, start = _counting_sort_model(ids, v)
    walk, walk_writes = _wte_walk_model(d, pos, start, v, rows, batch, piece)
    want = _counting_order_reference(d, ids, v, piece)
    for order in (None, rng.permutation(-(-n // piece))):  # the blocks in index order, then shuffled
        hot = _hot_pieces_model(d, ids, pos, start, v, piece, order)
        got, writes = walk.copy(), walk_writes.copy()
        for t, row in hot.items():
            assert writes[t] == 0, "a hot row written by the walk"
            got[t] = row
            writes[t] += 1
        assert (writes == 1).all(), "every row of dwte is written exactly once"
        np.testing.assert_array_equal(got, want)
    ok = (ids >= 0) & (ids < v)
    ref, _ = embedding_backward_reference(d[ok][None], ids[ok][None], v, max(1, int(ok.sum())))
    light = _light(ids, v, piece)
    np.testing.assert_array_equal(got[light], ref[light])


@pytest.mark.parametrize("kind", ["uniform", "same", "hot20", "fewhot", "borders", "bad"])
def test_counting_order_reference(rng, kind):
    """The "counting" order: np.add.at's bits with an infinite piece; close to the float64 sum."""
    n, v, c = 1500, 60, 3
    ids = _ids(rng, kind, n, v)
    d = rng.standard_normal((n, c)).astype(np.float32)
    ok = (ids >= 0) & (ids < v)
    ref, _ = embedding_backward_reference(d[ok][None], ids[ok][None], v, max(1, int(ok.sum())))
    np.testing.assert_array_equal(_counting_order_reference(d, ids, v, piece=n), ref)
    got = _counting_order_reference(d, ids, v)
    ref64 = np.zeros((v, c))
    np.add.at(ref64, ids[ok], d[ok].astype(np.float64))
    assert_close(got, ref64, "fp32")
    light = _light(ids, v, em.PIECE)
    np.testing.assert_array_equal(got[light], ref[light])
    if kind in ("same", "hot20", "borders"):  # some row is cut, and its bits may change: not all
        assert not light.all()


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bt", [(1, 1), (4, 7), (2, 64)])
@pytest.mark.parametrize("c", [1, 7, 33, 768])
@pytest.mark.parametrize("v", [7, 1000, 50257])
def test_gpu_matches_reference(cp, rng, dtype, method, bt, c, v):
    b, t = bt
    idx, wte, wpe, dx = _inputs(rng, b, t, c, v, max_t=t + 5, dtype=dtype, idx_dtype=np.int32 if c % 2 else np.int64)
    ref_x = embedding_forward(idx, wte, wpe)
    ref_dwte, ref_dwpe = embedding_backward(dx, idx, v, t + 5)
    idd, wted, wped, dxd = (cp.asarray(a) for a in (idx, wte, wpe, dx))
    x = embedding_forward(idd, wted, wped, out=poisoned((b, t, c), dtype, cp), method=method)
    assert_close(x, ref_x, dtype, name="x")
    dwte, dwpe = embedding_backward(
        dxd, idd, v, t + 5, method=method,
        dwte_out=poisoned((v, c), dtype, cp), dwpe_out=poisoned((t + 5, c), dtype, cp),
    )
    assert_close(dwte, ref_dwte, dtype, name="dwte")
    assert_close(dwpe, ref_dwpe, dtype, name="dwpe")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_backward_bitwise_deterministic(cp, rng, dtype):
    b, t, c, v = 8, 256, 768, 50  # 2048 positions on 50 tokens: long runs per token
    idx, _, _, dx = (cp.asarray(a) for a in _inputs(rng, b, t, c, v, max_t=t, dtype=dtype))
    first = [backend.to_numpy(a).tobytes() for a in embedding_backward(dx, idx, v, t)]
    for _ in range(2):
        assert [backend.to_numpy(a).tobytes() for a in embedding_backward(dx, idx, v, t)] == first


@pytest.mark.gpu
def test_gpu_out_of_range_ids_are_loud(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 4, 8, 10)
    idx[0, 1], idx[1, 3] = 10, -3
    good = idx.copy()
    good[0, 1] = good[1, 3] = 0
    x = backend.to_numpy(embedding_forward(cp.asarray(idx), cp.asarray(wte), cp.asarray(wpe)))
    assert np.isnan(x[0, 1]).all() and np.isnan(x[1, 3]).all()
    ref_x = embedding_forward(good, wte, wpe)
    mask = np.ones((2, 4), bool)
    mask[0, 1] = mask[1, 3] = False
    np.testing.assert_allclose(x[mask], ref_x[mask], rtol=1e-6)
    # backward: the bad positions are dropped from dwte, kept in dwpe
    dx_ok = dx.copy()
    dx_ok[0, 1] = dx_ok[1, 3] = 0.0
    ref_dwte, _ = embedding_backward(dx_ok, good, 10, wpe.shape[0])
    _, ref_dwpe = embedding_backward(dx, good, 10, wpe.shape[0])
    for method in METHODS:
        dwte, dwpe = embedding_backward(cp.asarray(dx), cp.asarray(idx), 10, wpe.shape[0], method=method)
        assert_close(dwte, ref_dwte, "fp32")
        assert_close(dwpe, ref_dwpe, "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["naive", "optimized"])
@pytest.mark.parametrize("c", [7, 64])
def test_gpu_forward_without_positions_is_the_gather_and_nan_past_vocab_size(cp, rng, dtype, method, c):
    """wpe=None on the GPU: wte's rows bit for bit (both kernels, vector and scalar packs); ids below 0 or from
    vocab_size up (a padded table's rows) read as NaN rows, where a plain gather read row -1 as the last row."""
    idx, wte, _, _ = _inputs(rng, 2, 5, c, 11, dtype=dtype, idx_dtype=np.int64)
    idx %= 9
    idx[0, 1], idx[1, 3], idx[1, 4] = -1, 9, 10  # vocab_size 9: rows 9 and 10 are padding
    x = backend.to_numpy(embedding_forward(cp.asarray(idx), cp.asarray(wte), None, method=method, vocab_size=9,
                                           out=poisoned((2, 5, c), dtype, cp)))
    bad = np.zeros((2, 5), bool)
    bad[0, 1] = bad[1, 3] = bad[1, 4] = True
    assert np.isnan(x[bad].astype(np.float32)).all()
    bits = np.uint16 if dtype == "bf16" else np.uint32
    np.testing.assert_array_equal(x[~bad].view(bits), wte[idx[~bad]].view(bits))


@pytest.mark.gpu
def test_gpu_misaligned_rows(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 5, 64, 9)
    buf = cp.empty(wte.size + 1, dtype=cp.float32)
    buf[1:] = cp.asarray(wte).ravel()
    wted = buf[1:].reshape(wte.shape)
    assert wted.data.ptr % 16 != 0
    x = embedding_forward(cp.asarray(idx), wted, cp.asarray(wpe))
    assert_close(x, embedding_forward(idx, wte, wpe), "fp32")


@pytest.mark.gpu
def test_gpu_bad_inputs(cp, rng):
    idx, wte, wpe, dx = _inputs(rng, 2, 3, 4, 5)
    with pytest.raises(TypeError, match="idx=ndarray|idx=numpy"):
        embedding_forward(idx, cp.asarray(wte), cp.asarray(wpe))
    with pytest.raises(TypeError, match="idx has dtype float32"):
        embedding_backward(cp.asarray(dx), cp.asarray(idx, dtype=cp.float32), 5, 6)
    with pytest.raises(TypeError, match="float64"):
        embedding_forward(cp.asarray(idx), cp.asarray(wte, dtype=cp.float64), cp.asarray(wpe, dtype=cp.float64))


# --------------------------------------------------------------------------- GPU: counting sort

_COUNTING_CASES = [  # (B, T, C, V, ids)
    (1, 1, 1, 1, "uniform"),
    (1, 1, 768, 50257, "uniform"),
    (1, 7, 7, 7, "uniform"),
    (4, 7, 770, 7, "uniform"),
    (1, 1000, 768, 1000, "uniform"),  # B*T < chunk
    (2, 1024, 7, 50257, "uniform"),  # B*T = 2 chunks
    (17, 181, 768, 50257, "uniform"),  # B*T = 3 chunks + 5
    (3, 1000, 770, 1000, "zipf"),
    (17, 181, 1, 7, "uniform"),  # ~440 positions per token: every row hot
    (4, 1000, 768, 50257, "same"),  # one token: a row of 4000 positions
    (4, 1000, 7, 1, "same"),
    (3, 700, 770, 1000, "two"),
    (5, 333, 768, 13, "bad"),
    (2, 64, 33, 50257, "bad"),
]


def _counting_inputs(rng, b, t, c, v, kind, dtype, idx_dtype):
    idx = _ids(rng, kind, b * t, v).reshape(b, t)
    if idx_dtype == np.int32:
        idx = np.where(idx >= 2**31, v, idx)
    idx = idx.astype(idx_dtype)
    dx = random_array(rng, (b, t, c), dtype)
    ok = (idx >= 0) & (idx < v)
    dx_ok = dx.copy()
    dx_ok[~ok] = 0  # out-of-range positions do not reach dwte ...
    ref_dwte, _ = embedding_backward(dx_ok, np.where(ok, idx, 0), v, t + 2)
    _, ref_dwpe = embedding_backward(dx, np.where(ok, idx, 0), v, t + 2)  # ... but do reach dwpe
    return idx, dx, ref_dwte, ref_dwpe


def _bits(a):
    return backend.to_numpy(a).view(np.uint8)


def _counting_want(dx, idx, v):
    """The exact dwte of method="counting" (fp32 sums in its order, cast to dx's dtype) and the rows
    of at most PIECE positions (where "optimized" has the same bits)."""
    dx, idx = backend.to_numpy(dx), backend.to_numpy(idx).reshape(-1)
    c = dx.shape[-1]
    want = _counting_order_reference(dx.reshape(-1, c).astype(np.float32), idx, v).astype(dx.dtype)
    return want, _light(idx, v, em.PIECE)


def _assert_counting_bits(dwte, dx, idx, v, opt=None, msg=""):
    want, light = _counting_want(dx, idx, v)
    got = backend.to_numpy(dwte)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{msg} counting order: dwte bits")
    if opt is not None:  # rows that are one chain: the bits of "optimized"
        np.testing.assert_array_equal(got[light].view(np.uint8), backend.to_numpy(opt)[light].view(np.uint8),
                                      err_msg=f"{msg} counting vs optimized (rows of <= PIECE positions)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", _COUNTING_CASES, ids=lambda k: "x".join(map(str, k)))
def test_gpu_counting_matches_reference_and_optimized(cp, rng, dtype, case):
    b, t, c, v, kind = case
    idx_dtype = np.int32 if (b + c) % 2 else np.int64
    idx, dx, ref_dwte, ref_dwpe = _counting_inputs(rng, b, t, c, v, kind, dtype, idx_dtype)
    idd, dxd = cp.asarray(idx), cp.asarray(dx)
    dwte, dwpe = embedding_backward(
        dxd, idd, v, t + 2, method="counting",
        dwte_out=poisoned((v, c), dtype, cp), dwpe_out=poisoned((t + 2, c), dtype, cp),
    )
    assert_close(dwte, ref_dwte, dtype, name="dwte")
    assert_close(dwpe, ref_dwpe, dtype, name="dwpe")
    opt = embedding_backward(dxd, idd, v, t + 2, method="optimized")
    _assert_counting_bits(dwte, dx, idx, v, opt[0])
    np.testing.assert_array_equal(_bits(dwpe), _bits(opt[1]), err_msg="counting vs optimized: dwpe bits")
    again = embedding_backward(dxd, idd, v, t + 2, method="counting")
    np.testing.assert_array_equal(_bits(dwte), _bits(again[0]), err_msg="counting run to run: dwte bits")


@pytest.mark.gpu
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_gpu_counting_bitwise_at_gpt2_size(cp, rng, idx_dtype):
    b, t, c, v = 8, 1024, 768, 50304
    idx = _ids(rng, "zipf", b * t, v).reshape(b, t).astype(idx_dtype)
    idd = cp.asarray(idx)
    dx = cp.asarray(random_array(rng, (b, t, c), "bf16"))
    first = [_bits(a) for a in embedding_backward(dx, idd, v, t, method="counting")]
    opt = embedding_backward(dx, idd, v, t, method="optimized")
    _assert_counting_bits(first[0].view(backend.bfloat16).reshape(v, c), dx, idx, v, opt[0])
    np.testing.assert_array_equal(first[1], _bits(opt[1]))
    for _ in range(2):
        for a, f in zip(embedding_backward(dx, idd, v, t, method="counting"), first):
            np.testing.assert_array_equal(_bits(a), f)


# Hot tokens: the rows the pieces split. (B, T, C, V, ids); "borders" has tokens whose counts are
# 2, 3 piece sizes (slots aligned on the pieces or not) and one more than 1 and 2 piece sizes.
_HOT_CASES = [
    (4, 1000, 768, 5003, "hot20"),  # B*T = 4000: not a multiple of the piece size
    (4, 1000, 768, 5003, "hot50"),
    (4, 1000, 768, 5003, "same"),  # 100%
    (4, 1000, 768, 1000, "fewhot"),
    (4, 1000, 768, 5003, "uniform"),
    (4, 1000, 768, 1000, "borders"),
    (3, 999, 770, 1000, "borders"),  # C not a multiple of the 16-byte pack: the scalar path
    (2, 2048, 7, 300, "hot50"),
    (1, 1025, 1, 5, "fewhot"),
    (4, 1024, 2304, 2000, "hot20"),  # several column tiles (fp32: 576 packs = 6 tiles)
    (5, 333, 768, 13, "bad"),  # ~85 positions per token, out-of-range ids dropped
    (16, 1024, 768, 50304, "hot20"),  # GPT-2 sized row, 16K positions
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", _HOT_CASES, ids=lambda k: "x".join(map(str, k)))
def test_gpu_counting_hot_tokens(cp, rng, dtype, case):
    """Hot tokens: close to the float64 sum, the exact bits of the "counting" order (NumPy model),
    the same bits on a second call, every row written (poisoned outputs)."""
    b, t, c, v, kind = case
    idx_dtype = np.int64 if t % 2 else np.int32
    idx = _ids(rng, kind, b * t, v).reshape(b, t)
    idx = np.where(idx >= 2**31, v, idx).astype(idx_dtype)
    dx = random_array(rng, (b, t, c), dtype)
    ok = (idx >= 0) & (idx < v)
    ref64 = np.zeros((v, c))
    np.add.at(ref64, idx[ok], dx[ok].astype(np.float64))
    idd, dxd = cp.asarray(idx), cp.asarray(dx)
    dwte, dwpe = embedding_backward(dxd, idd, v, t, method="counting", dwte_out=poisoned((v, c), dtype, cp),
                                    dwpe_out=poisoned((t, c), dtype, cp))
    assert_close(dwte, ref64, dtype, name="dwte")
    assert_close(dwpe, dx.astype(np.float64).sum(axis=0), dtype, name="dwpe")
    _assert_counting_bits(dwte, dx, idx, v)
    again, _ = embedding_backward(dxd, idd, v, t, method="counting")
    np.testing.assert_array_equal(_bits(again), _bits(dwte), err_msg="run to run")


@pytest.mark.gpu
def test_gpu_counting_misaligned_dx_takes_the_scalar_path(cp, rng):
    b, t, c, v = 3, 50, 64, 20
    idx, dx, ref_dwte, ref_dwpe = _counting_inputs(rng, b, t, c, v, "uniform", "bf16", np.int64)
    buf = cp.empty(dx.size + 1, dtype=dx.dtype)
    buf[1:] = cp.asarray(dx).ravel()
    dxd = buf[1:].reshape(dx.shape)
    assert dxd.data.ptr % 16 != 0
    dwte, dwpe = embedding_backward(dxd, cp.asarray(idx), v, t + 2, method="counting")
    assert_close(dwte, ref_dwte, "bf16", name="dwte")
    assert_close(dwpe, ref_dwpe, "bf16", name="dwpe")


@pytest.mark.gpu
def test_gpu_counting_replays_in_a_cuda_graph_with_new_ids(cp, rng):
    """Launch configurations and scratch sizes depend on the shapes only: one capture serves any idx,
    hot tokens or not (a host synchronization inside would fail the capture)."""
    from llmgpu.perf.graphs import capture

    b, t, c, v = 4, 700, 768, 1000
    idd = cp.asarray(rng.integers(0, v, (b, t)))
    dxd = cp.asarray(random_array(rng, (b, t, c), "bf16"))
    dwte, dwpe = cp.empty((v, c), dxd.dtype), cp.empty((t, c), dxd.dtype)
    g = capture(lambda: embedding_backward(dxd, idd, v, t, method="counting", dwte_out=dwte, dwpe_out=dwpe))
    for kind in ("zipf", "same", "uniform", "hot20", "borders", "hot50", "hot20"):
        idx = _ids(rng, kind, b * t, v).reshape(b, t)
        dx = random_array(rng, (b, t, c), "bf16")
        idd[...] = cp.asarray(idx)
        dxd[...] = cp.asarray(dx)
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        ref = embedding_backward(dxd, idd, v, t, method="optimized")
        _assert_counting_bits(dwte, dx, idx, v, ref[0], msg=kind)
        np.testing.assert_array_equal(_bits(dwpe), _bits(ref[1]), err_msg=kind)


# --------------------------------------------------------------------------- accumulate=True: fp32 gradients


def test_accumulate_adds_the_row_sums_into_the_touched_rows(rng):
    """NumPy: dwte_out[v] += the sum of token v's positions, for tokens in idx only; dwpe_out[:T] += the
    batch sum; the same as the reference added afterwards (fp64: bit for bit)."""
    b, t, c, v, max_t = 3, 5, 4, 9, 7
    idx = rng.integers(0, 4, (b, t))  # tokens 4..8 never occur
    dx = random_array(rng, (b, t, c), "fp64")
    g_te, g_pe = random_array(rng, (v, c), "fp64"), random_array(rng, (max_t, c), "fp64")
    want_te, want_pe = embedding_backward(dx, idx, v, max_t)
    out = embedding_backward(dx, idx, v, max_t, dwte_out=g_te.copy(), dwpe_out=g_pe.copy(), accumulate=True)
    np.testing.assert_array_equal(out[0], g_te + want_te)
    np.testing.assert_array_equal(out[1], g_pe + want_pe)
    np.testing.assert_array_equal(out[0][4:], g_te[4:])  # untouched
    # bf16 dx into fp32 gradients: the fp32 sums, not rounded to bf16 first
    d16 = dx.astype(backend.bfloat16)
    o32 = np.zeros((v, c), np.float32), np.zeros((max_t, c), np.float32)
    embedding_backward(d16, idx, v, max_t, dwte_out=o32[0], dwpe_out=o32[1], accumulate=True)
    ref32 = embedding_backward(d16.astype(np.float32), idx, v, max_t)
    np.testing.assert_array_equal(o32[0], ref32[0])
    np.testing.assert_array_equal(o32[1], ref32[1])
    with pytest.raises(ValueError, match="give both"):
        embedding_backward(dx, idx, v, max_t, dwte_out=g_te, accumulate=True)
    with pytest.raises(ValueError, match="dwpe_out must have shape"):
        embedding_backward(dx, idx, v, max_t, dwte_out=g_te, dwpe_out=g_pe[:3].copy(), accumulate=True)


def test_positions_false_sums_the_token_rows_only(rng):
    """A model without a position embedding (Llama): positions=False adds the same token-row sums and touches no
    dwpe; the other arguments are refused in one line."""
    b, t, c, v = 3, 5, 4, 9
    idx = rng.integers(0, 4, (b, t))
    dx = random_array(rng, (b, t, c), "fp64")
    g_te = random_array(rng, (v, c), "fp64")
    want, _ = embedding_backward(dx, idx, v, t, dwte_out=g_te.copy(), dwpe_out=np.zeros((t, c)), accumulate=True)
    got = g_te.copy()
    res = embedding_backward(dx, idx, v, t, dwte_out=got, accumulate=True, positions=False)
    assert res[0] is got and res[1] is None
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="positions=False sums the token rows only"):
        embedding_backward(dx, idx, v, t, positions=False)
    with pytest.raises(ValueError, match="positions=False sums the token rows only"):
        embedding_backward(dx, idx, v, t, dwte_out=got, dwpe_out=np.zeros((t, c)), accumulate=True, positions=False)
    with pytest.raises(TypeError, match="positions must be True or False"):
        embedding_backward(dx, idx, v, t, dwte_out=got, accumulate=True, positions=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_positions_false_matches_the_token_rows(cp, rng, dtype):
    b, t, c, v = 4, 333, 576, 1000
    idx = _ids(rng, "hot20", b * t, v).reshape(b, t).astype(np.int32)
    dx = random_array(rng, (b, t, c), dtype)
    g_te = random_array(rng, (v, c), "fp32")
    want_te, _ = _accumulate_want(dx, idx, v, g_te, np.zeros((t, c), np.float32))
    o_te = cp.asarray(g_te)
    res = embedding_backward(cp.asarray(dx), cp.asarray(idx), v, t, method="counting", dwte_out=o_te,
                             accumulate=True, positions=False)
    assert res[0] is o_te and res[1] is None
    np.testing.assert_array_equal(_bits(o_te), want_te.view(np.uint8), err_msg="dwte bits")


def _accumulate_want(dx, idx, v, g_te, g_pe):
    """The exact fp32 result of accumulate=True on the GPU: the counting order's fp32 row sums added once
    into the rows of the tokens that occur (in range), and the batch sums (b = 0, 1, ... from 0) into rows t < T."""
    d = np.asarray(dx, np.float32)
    b, t, c = d.shape
    ids = np.asarray(idx).reshape(-1)
    s = _counting_order_reference(d.reshape(-1, c), ids, v)
    rows = np.unique(ids[(ids >= 0) & (ids < v)])
    want_te = g_te.copy()
    want_te[rows] = g_te[rows] + s[rows]
    pe = np.zeros((t, c), np.float32)
    for k in range(b):
        pe = pe + d[k]
    want_pe = g_pe.copy()
    want_pe[:t] = g_pe[:t] + pe
    return want_te, want_pe


_ACCUMULATE_CASES = [  # (B, T, C, V, ids)
    (1, 1, 1, 1, "uniform"),
    (4, 7, 770, 7, "uniform"),  # C not a multiple of the pack: the scalar path
    (17, 181, 768, 50257, "uniform"),
    (3, 1000, 770, 1000, "zipf"),
    (4, 1000, 768, 5003, "hot20"),
    (4, 1000, 768, 1000, "borders"),
    (5, 333, 768, 13, "bad"),
    (4, 1024, 2304, 2000, "hot20"),
    (16, 1024, 768, 50304, "hot20"),  # GPT-2 sized
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", _ACCUMULATE_CASES, ids=lambda k: "x".join(map(str, k)))
def test_gpu_counting_accumulates_into_fp32_bitwise(cp, rng, dtype, case):
    b, t, c, v, kind = case
    idx_dtype = np.int64 if (b + t) % 2 else np.int32
    idx = _ids(rng, kind, b * t, v).reshape(b, t)
    idx = np.where(idx >= 2**31, v, idx).astype(idx_dtype)
    dx = random_array(rng, (b, t, c), dtype)
    g_te, g_pe = random_array(rng, (v, c), "fp32"), random_array(rng, (t + 2, c), "fp32")
    want_te, want_pe = _accumulate_want(dx, idx, v, g_te, g_pe)
    dxd, idd = cp.asarray(dx), cp.asarray(idx)
    o_te, o_pe = cp.asarray(g_te), cp.asarray(g_pe)
    res = embedding_backward(dxd, idd, v, t + 2, method="counting", dwte_out=o_te, dwpe_out=o_pe, accumulate=True)
    assert res[0] is o_te and res[1] is o_pe
    np.testing.assert_array_equal(_bits(o_te), want_te.view(np.uint8), err_msg="dwte bits")
    np.testing.assert_array_equal(_bits(o_pe), want_pe.view(np.uint8), err_msg="dwpe bits")
    # close to the float64 sums, and run to run the same bits
    ok = (idx >= 0) & (idx < v)
    ref64 = np.zeros((v, c))
    np.add.at(ref64, idx[ok], dx[ok].astype(np.float64))
    assert_close(o_te - cp.asarray(g_te), ref64, "fp32" if dtype == "fp32" else "fp16", name="dwte")
    o2 = cp.asarray(g_te), cp.asarray(g_pe)
    embedding_backward(dxd, idd, v, t + 2, method="counting", dwte_out=o2[0], dwpe_out=o2[1], accumulate=True)
    np.testing.assert_array_equal(_bits(o2[0]), _bits(o_te))
    np.testing.assert_array_equal(_bits(o2[1]), _bits(o_pe))


@pytest.mark.gpu
def test_gpu_counting_accumulate_misaligned_gradient_and_bad_arguments(cp, rng):
    b, t, c, v = 3, 50, 64, 20
    idx = rng.integers(0, v, (b, t))
    dx = random_array(rng, (b, t, c), "bf16")
    g_te, g_pe = random_array(rng, (v, c), "fp32"), random_array(rng, (t, c), "fp32")
    want_te, want_pe = _accumulate_want(dx, idx, v, g_te, g_pe)
    buf = cp.empty(v * c + 1, np.float32)
    o_te = buf[1:].reshape(v, c)  # 4 bytes off the 16-byte grid: the scalar path
    o_te[...] = cp.asarray(g_te)
    o_pe = cp.asarray(g_pe)
    dxd, idd = cp.asarray(dx), cp.asarray(idx)
    embedding_backward(dxd, idd, v, t, method="counting", dwte_out=o_te, dwpe_out=o_pe, accumulate=True)
    np.testing.assert_array_equal(_bits(o_te), want_te.view(np.uint8))
    np.testing.assert_array_equal(_bits(o_pe), want_pe.view(np.uint8))
    with pytest.raises(ValueError, match="method='counting'"):
        embedding_backward(dxd, idd, v, t, method="optimized", dwte_out=o_te, dwpe_out=o_pe, accumulate=True)
    with pytest.raises(TypeError, match="dwte_out"):
        embedding_backward(dxd, idd, v, t, method="counting", dwte_out=cp.zeros((v, c), dxd.dtype),
                           dwpe_out=o_pe, accumulate=True)


@pytest.mark.gpu
def test_gpu_counting_accumulate_replays_in_a_cuda_graph(cp, rng):
    from llmgpu.perf.graphs import capture

    b, t, c, v = 4, 700, 768, 1000
    idd = cp.asarray(rng.integers(0, v, (b, t)))
    dxd = cp.asarray(random_array(rng, (b, t, c), "bf16"))
    o_te, o_pe = cp.zeros((v, c), np.float32), cp.zeros((t, c), np.float32)
    g = capture(lambda: embedding_backward(dxd, idd, v, t, method="counting", dwte_out=o_te, dwpe_out=o_pe,
                                           accumulate=True))
    for kind in ("zipf", "same", "hot20", "borders", "uniform"):
        idx = _ids(rng, kind, b * t, v).reshape(b, t)
        dx = random_array(rng, (b, t, c), "bf16")
        g_te, g_pe = random_array(rng, (v, c), "fp32"), random_array(rng, (t, c), "fp32")
        idd[...] = cp.asarray(idx)
        dxd[...] = cp.asarray(dx)
        o_te[...] = cp.asarray(g_te)
        o_pe[...] = cp.asarray(g_pe)
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        want_te, want_pe = _accumulate_want(dx, idx, v, g_te, g_pe)
        np.testing.assert_array_equal(_bits(o_te), want_te.view(np.uint8), err_msg=kind)
        np.testing.assert_array_equal(_bits(o_pe), want_pe.view(np.uint8), err_msg=kind)
