"""Token + position embedding, forward and backward (chapter 3, ``kernels/embedding.cu``)::

    x[b, t, :]  = wte[idx[b, t], :] + wpe[t, :]              idx [B, T] int32/int64, T <= maxT
                                                             (wpe None: no position rows, as in a Llama)
    dwte[v, :]  = sum of dx[b, t, :] over all (b, t) with idx[b, t] == v
    dwpe[t, :]  = sum_b dx[b, t, :]       (rows t >= T are zero)

The backward of a gather is a scatter-add: several positions write the same row of dwte. The
``"naive"`` GPU path does it with float atomics (fp32 scratch, then cast): short, but the order of
the additions, and so the last bits of dwte, changes from run to run. The ``"optimized"`` path is
deterministic: it sorts the (token, position) keys (``cupy.sort``), finds each token's run by binary
search and gives each token row to one group of threads that sums its positions in ascending order
-- every dwte row is written exactly once, the same bits every run. The sort goes through CuPy's
Thrust binding, which allocates its scratch and may synchronize the stream: fine for eager training,
not for CUDA-graph capture.

The ``"counting"`` path sorts with a counting sort of its own (below): no host synchronization,
scratch whose size depends only on (B, T, C, V), and launch configurations that depend only on
(B, T, C, V), so a whole training step that uses it can be captured in a CUDA graph. It also
splits hot rows (below), so one frequent token does not serialize the backward. The forward has no
scatter; its ``"counting"`` method is the optimized gather.

Counting sort (``method="counting"``; kernels ``embedding_count_*`` and ``embedding_backward_wte_pos``)
    We need ``pos``: the in-range positions ``i`` (``0 <= idx[i] < V``) ordered by token, ties in
    ascending ``i`` (a *stable* sort by token), and ``start[v]``, the first slot of token ``v``, so
    that token ``v``'s positions are ``pos[start[v]:start[v+1]]``. Token ids are small integers
    (below ``V``), which is the case for a counting sort: count, prefix-sum, place.

    a. Cut the ``N = B*T`` positions into chunks of ``CHUNK = 1024`` consecutive positions. A
       histogram per chunk: ``table[c, v]`` = number of positions of chunk ``c`` holding token ``v``
       (integer atomics, so the counts do not depend on their order).
    b. Per token, an exclusive prefix over the chunks, in place: ``table[c, v]`` becomes the number of
       positions of token ``v`` in chunks before ``c``; the column total is ``count[v]``.
    c. ``start[v] = count[0] + ... + count[v-1]`` (an exclusive scan over the vocabulary; done as a
       scan inside blocks of 256 tokens plus a scan of the block sums).
    d. Place: position ``i`` of chunk ``c`` with token ``v`` goes to slot
       ``start[v] + table[c, v] + rank(i)``, where ``rank(i)`` counts the earlier positions of the
       same chunk with the same token (a loop over the chunk's tokens in shared memory).
       Positions of ``v`` from earlier chunks come first, then earlier ones of the same chunk: the
       slots are exactly the stable order, and each is written once.

    Then one warp per 8 consecutive token rows walks their (contiguous) range of ``pos`` and sums
    each row from zero in ascending position order, as the optimized kernel does -- except hot rows.

Hot rows (``method="counting"``; ``emb_hot_piece`` in the same kernel launch as the row walk)
    A row summed as one chain costs a memory latency per few positions in one warp: a token at 20%
    of B*T = 65536 positions took 6 ms (4.4 ms on "optimized") against 0.6 ms for float atomics.
    So a token with more than ``PIECE = 128`` positions is *hot*, and its positions are summed in
    pieces: piece ``k`` is slots ``[128k, 128k + 128)`` of ``pos``, one thread block per piece
    (``ceil(N/128)`` blocks: a bound known from the shapes, no count read back). Each block sums
    the positions of the (at most two) hot rows it meets, in ascending order, into an fp32
    partial; the last block of a row to finish (an atomic counter per row) adds the row's
    partials in piece order and writes the row::

        part(v, k) = 0 + dx[pos[q]] for v's slots q in piece k, ascending
        dwte[v]    = 0 + part(v, k0) + part(v, k0 + 1) + ... + part(v, k1)

    The order of every addition is fixed by idx (the pieces cut the sorted order at multiples of
    128), never by which block finishes first: bitwise reproducible, as before. But a hot row is no
    longer one chain, so its bits generally differ from ``"optimized"`` (rows of at most 128
    positions keep the exact ``"optimized"`` / ``np.add.at`` bits); the same terms are added in
    fp32, in shorter chains, so the rounding error is no worse. A hot token at 20% of the
    positions becomes ~100 pieces of 128 positions summed side by side plus a 100-term sum.

    Scratch: a ``[ceil(N/1024), V]`` int32 table (13 MB at GPT-2 size), ``N`` int32 slots, ``O(V)``
    ints, the hot rows' counters and a ``[2 * ceil(N/128), C]`` fp32 carry (3 MB at GPT-2 size),
    allocated from CuPy's pool at each call (their sizes depend only on the shapes: under graph
    capture, use a private memory pool as for any other temporary). ``test_embedding.py`` checks
    NumPy models of these steps against ``np.argsort(idx, kind="stable")`` and of the hot-row
    pieces (blocks finishing in any order) against the formula above.

Token ids outside ``[0, V)`` (in the forward, ``V`` may be given as ``vocab_size`` below wte's rows: a
padded table's extra rows are not tokens): the NumPy path raises ValueError. The GPU path does not read
out of bounds; the forward writes NaN into those rows of x (the loss turns NaN: loud), and the backward
leaves those positions out of dwte (they still count in dwpe).
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_array,
    check_bool,
    check_gpu_dtype,
    check_method,
    check_out,
    check_same_dtype,
    reference_dtype,
)
from ..kernels import get_kernel, loader
from ..kernels.launch import stride_grid, vector_width

METHODS = ("naive", "optimized", "counting")
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_C_INDEX = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
THREADS = 256
# The counting sort's constants, read from the #defines of kernels/embedding.cu (written there once)
_EMB = loader.constants("embedding")
COUNT_CHUNK = _EMB["EMB_CHUNK"]  # positions per chunk of the histogram table
SCAN_BLOCK = _EMB["EMB_SCAN_BLOCK"]  # tokens per block of the prefix kernel
ROWS_PER_WARP = _EMB["EMB_ROWS"]  # token rows per warp in embedding_backward_wte_pos
BATCH = _EMB["EMB_BATCH"]  # dx rows in flight per lane in embedding_backward_wte_pos (the tests model its walk)
WARPS_PER_BLOCK = _EMB["EMB_WTE_POS_THREADS"] // 32  # embedding_backward_wte_pos's block
PIECE = _EMB["EMB_PIECE"]  # slots per piece of a hot row; a token with more positions is "hot"
# the KP (packs per lane) instantiations of embedding_backward_wte_pos its // llmgpu:kernel line declares: 1 .. this
MAX_PACKS_PER_LANE = max(int(e.split(",")[2]) for e in loader.name_expressions("embedding")
                         if e.startswith("embedding_backward_wte_pos<"))


_compute_dtype = reference_dtype


def check_ids_numpy(idx, v, name="idx"):
    """A ValueError naming the first id of the NumPy array ``idx`` outside ``[0, v)``, and how many are (on a GPU
    the kernels write NaN rows for such ids instead: checking there would cost a host synchronisation)."""
    bad = (idx < 0) | (idx >= v)
    if bad.any():
        i = tuple(int(k) for k in np.argwhere(bad)[0])
        raise ValueError(f"{name} must lie in [0, {v}); {int(bad.sum())} do not (first: {name}{list(i)} = "
                         f"{int(idx[i])})")


def _pack_grid(rows, c, dtype, arrays):
    """(vec, grid, block) for kernels with one block row per output row and threads over packs."""
    width = vector_width(dtype, c, *arrays)
    vec, nvec = width > 1, c // width
    bx = min(THREADS, -(-nvec // 32) * 32)
    return vec, (rows, -(-nvec // bx)), (bx,)


# --------------------------------------------------------------------------- NumPy reference


def embedding_forward_reference(idx, wte, wpe):
    ct = _compute_dtype(wte.dtype)
    if wpe is None:
        return wte[idx]  # a bare gather: no sum, so no rounding
    t = idx.shape[1]
    return (wte.astype(ct)[idx] + wpe.astype(ct)[:t][None]).astype(wte.dtype)


def embedding_backward_reference(dx, idx, vocab_size, max_t):
    ct = _compute_dtype(dx.dtype)
    b, t, c = dx.shape
    d = dx.astype(ct)
    dwte = np.zeros((vocab_size, c), dtype=ct)
    np.add.at(dwte, idx.reshape(-1), d.reshape(b * t, c))  # positions in order
    dwpe = np.zeros((max_t, c), dtype=ct)
    dwpe[:t] = d.sum(axis=0)
    return dwte.astype(dx.dtype), dwpe.astype(dx.dtype)


# --------------------------------------------------------------------------- public API


def embedding_forward(idx, wte, wpe, *, out=None, method="optimized", vocab_size=None):
    """``x [B, T, C] = wte[idx] + wpe[:T]`` for ``idx [B, T]``, ``wte [V, C]``, ``wpe [maxT, C]`` (or None:
    ``x = wte[idx]``, the token rows alone).

    ``vocab_size`` (default V): ids from it up are not tokens (a padded table's last rows); NumPy refuses them, the
    GPU writes NaN rows for them. ``method="counting"`` is the optimized gather (the methods differ in the backward
    only)."""
    check_method("embedding_forward", method, METHODS)
    xp = array_module(idx=idx, wte=wte, wpe=wpe, out=out)
    check_array("idx", idx, ndim=2, dtypes=INDEX_DTYPES)
    check_array("wte", wte, ndim=2)
    v, c = wte.shape
    b, t = idx.shape
    if wpe is not None:
        check_array("wpe", wpe, shape=(None, c))
        check_same_dtype(wte=wte, wpe=wpe)
        if t > wpe.shape[0]:
            raise ValueError(f"idx has T={t} positions but wpe holds only {wpe.shape[0]}")
    if vocab_size is not None:
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
        if not 0 < vocab_size <= v:
            raise ValueError(f"vocab_size must lie in [1, {v}] (wte's rows), got {vocab_size}")
        v = int(vocab_size)

    if xp is np:
        check_ids_numpy(idx, v)
        x = embedding_forward_reference(idx, wte, wpe)
        if out is None:
            return x
        check_out(out, (b, t, c), wte.dtype, xp)[...] = x
        return out

    check_gpu_dtype("wte", wte)
    if b * t >= 2**31 or v >= 2**31:
        raise ValueError("B*T and V must be below 2**31")
    out = check_out(out, (b, t, c), wte.dtype, xp)
    ti = _C_INDEX[idx.dtype]
    pos = wpe if wpe is not None else np.uint64(0)  # a null pointer: the kernels add no position row
    if method == "naive":
        n = b * t * c
        get_kernel("embedding", "embedding_forward_naive", wte.dtype, ti)(
            (-(-n // THREADS),), (THREADS,),
            (idx, wte, pos, out, np.int64(b * t), np.int32(t), np.int32(c), np.int32(v)),
        )
        return out
    vec, grid, block = _pack_grid(b * t, c, wte.dtype, (wte, out) if wpe is None else (wte, wpe, out))
    get_kernel("embedding", "embedding_forward", wte.dtype, ti, int(vec))(
        grid, block, (idx, wte, pos, out, np.int32(t), np.int32(c), np.int32(v))
    )
    return out


def embedding_backward(dx, idx, vocab_size, max_t, *, method="optimized", dwte_out=None, dwpe_out=None,
                       accumulate=False, positions=True):
    """``(dwte [V, C], dwpe [maxT, C])`` from ``dx [B, T, C]`` and the forward's ``idx [B, T]``.

    ``max_t`` is wpe's number of rows (an int, or wpe's shape). Gradients have dx's dtype, summed in
    fp32; on the optimized and counting GPU paths in an order fixed by idx alone (bitwise
    reproducible). The two give the same bits except in rows of tokens with more than ``PIECE``
    positions, which ``"counting"`` sums in pieces (module docstring). ``"counting"`` neither
    synchronizes nor sizes anything by the data: it can be captured in a CUDA graph.

    ``accumulate=True`` (the training step's gradients): ``dwte_out`` and ``dwpe_out`` are required,
    fp32 (on NumPy any float dtype), and the fp32 row sums are **added** into them: ``dwte_out[v] +=``
    the sum of token v's positions, for the tokens in ``idx`` only (the other rows are not touched),
    ``dwpe_out[t] +=`` the sum over the batch, for ``t < T`` only. No sum is rounded to dx's dtype
    first. On the GPU it takes ``method="counting"`` (the same sums in the same order, bitwise
    repeatable and capturable); it returns ``(dwte_out, dwpe_out)``.

    ``positions=False`` (a model without a position embedding, e.g. Llama; with ``accumulate=True``): only the
    token rows are summed, ``dwpe_out`` is not taken and None is returned in its place.
    """
    check_method("embedding_backward", method, METHODS)
    xp = array_module(dx=dx, idx=idx, dwte_out=dwte_out, dwpe_out=dwpe_out)
    check_array("dx", dx, ndim=3)
    b, t, c = dx.shape
    check_array("idx", idx, shape=(b, t), dtypes=INDEX_DTYPES)
    if isinstance(max_t, (tuple, list)):
        if len(max_t) != 2 or max_t[1] != c:
            raise ValueError(f"max_t given as a shape must be wpe's shape (maxT, {c}), got {tuple(max_t)}")
        max_t = max_t[0]
    for name, val in (("vocab_size", vocab_size), ("max_t", max_t)):
        if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    v, max_t = int(vocab_size), int(max_t)
    if t > max_t:
        raise ValueError(f"dx has T={t} positions but max_t is {max_t}")
    check_bool("positions", positions)
    if not positions and (not accumulate or dwpe_out is not None):
        raise ValueError("positions=False sums the token rows only: it takes accumulate=True and no dwpe_out")
    if accumulate:
        if dwte_out is None or (positions and dwpe_out is None):
            raise ValueError("accumulate=True adds into dwte_out and dwpe_out: give both (fp32 gradient buffers)")
        if xp is not np and method != "counting":
            raise ValueError(f"accumulate=True runs on the GPU with method='counting', got method={method!r}")

    if xp is np:
        check_ids_numpy(idx, v)
        if accumulate:  # any float dtype here; the GPU path below checks for fp32
            for name, o, shape in (("dwte_out", dwte_out, (v, c)), ("dwpe_out", dwpe_out, (max_t, c))):
                if o is not None:
                    check_out(o, shape, o.dtype if o.dtype.kind == "f" else np.float32, xp, name=name)
            _accumulate_reference(dx, idx, dwte_out, dwpe_out)
            return dwte_out, dwpe_out
        dwte, dwpe = embedding_backward_reference(dx, idx, v, max_t)
        res = []
        for name, val, o in (("dwte_out", dwte, dwte_out), ("dwpe_out", dwpe, dwpe_out)):
            if o is not None:
                check_out(o, val.shape, val.dtype, xp, name=name)[...] = val
                val = o
            res.append(val)
        return tuple(res)

    check_gpu_dtype("dx", dx)
    bt = b * t
    if bt >= 2**31 or v >= 2**31:
        raise ValueError("B*T and V must be below 2**31")
    out_dtype = np.float32 if accumulate else dx.dtype
    dwte = check_out(dwte_out, (v, c), out_dtype, xp, name="dwte_out")
    dwpe = check_out(dwpe_out, (max_t, c), out_dtype, xp, name="dwpe_out") if positions else None
    ti = _C_INDEX[idx.dtype]
    acc = int(bool(accumulate))

    if method == "naive":
        dwte32 = xp.zeros((v, c), dtype=np.float32)
        dwpe32 = xp.zeros((max_t, c), dtype=np.float32)
        blocks = stride_grid(bt * c, THREADS, xp)
        get_kernel("embedding", "embedding_backward_naive", dx.dtype, ti)(
            (blocks,), (THREADS,), (dx, idx, dwte32, dwpe32, np.int64(bt), np.int32(t), np.int32(c), np.int32(v))
        )
        dwte[...] = dwte32
        dwpe[...] = dwpe32
        return dwte, dwpe

    if method == "counting":
        _backward_counting(xp, dx, idx, dwte, v, ti, acc)
        if not positions:
            return dwte, None
        vec, grid, block = _pack_grid(v, c, dx.dtype, (dx, dwte, dwpe))
        get_kernel("embedding", "embedding_backward_wpe", dx.dtype, int(vec), acc)(
            (t if acc else max_t, grid[1]), block, (dx, dwpe, np.int32(b), np.int32(t), np.int32(c))
        )
        return dwte, dwpe

    keys = xp.empty(bt, dtype=np.int64)
    get_kernel("embedding", "embedding_make_keys", ti)(
        (-(-bt // THREADS),), (THREADS,), (idx, np.int64(bt), np.int32(v), keys)
    )
    keys = xp.sort(keys)
    starts = xp.empty(v + 1, dtype=np.int64)
    get_kernel("embedding", "embedding_segment_starts")(
        (-(-(v + 1) // THREADS),), (THREADS,), (keys, np.int64(bt), np.int32(v), starts)
    )
    vec, grid, block = _pack_grid(v, c, dx.dtype, (dx, dwte, dwpe))
    get_kernel("embedding", "embedding_backward_wte", dx.dtype, int(vec))(
        grid, block, (dx, keys, starts, dwte, np.int32(c), np.int64(bt))
    )
    get_kernel("embedding", "embedding_backward_wpe", dx.dtype, int(vec), 0)(
        (max_t, grid[1]), block, (dx, dwpe, np.int32(b), np.int32(t), np.int32(c))
    )
    return dwte, dwpe


def _accumulate_reference(dx, idx, dwte_out, dwpe_out):
    """accumulate=True on NumPy: the reference's row sums in the compute dtype, added once per row into
    the rows that have positions (dwte) and the rows t < T (dwpe)."""
    ct = _compute_dtype(dx.dtype)
    b, t, c = dx.shape
    d = dx.astype(ct).reshape(b * t, c)
    ids = idx.reshape(-1)
    rows = np.unique(ids)
    sums = np.zeros((dwte_out.shape[0], c), dtype=ct)
    np.add.at(sums, ids, d)  # positions in order, as embedding_backward_reference
    dwte_out[rows] += sums[rows].astype(dwte_out.dtype)
    if dwpe_out is not None:
        dwpe_out[:t] += d.reshape(b, t, c).sum(axis=0).astype(dwpe_out.dtype)


def _backward_counting(xp, dx, idx, dwte, v, ti, acc=0):
    """dwte through the counting sort (module docstring, steps a-d, then the row sums)."""
    b, t, c = dx.shape
    bt = b * t
    # Row sums (below): a warp per ROWS_PER_WARP rows and per column tile of 32*kp packs (kp <= 3).
    width = vector_width(dx.dtype, c, dx, dwte)  # dwte fp32 (acc): 16-byte aligned, and C % width == 0
    vec, nvec = width > 1, c // width
    ntiles = -(-nvec // (32 * MAX_PACKS_PER_LANE))
    kp = -(-nvec // (32 * ntiles))
    if ntiles > 65535:  # gridDim.y
        raise ValueError(f"C={c} is too large for the counting path's column tiles (at most {65535 * 96} packs)")
    nchunks = -(-bt // COUNT_CHUNK)
    nscan = -(-(v + 1) // SCAN_BLOCK)  # blocks of the prefix kernel (token V included: start[V] = N)
    npieces = -(-bt // PIECE)  # pieces of the sorted order: a bound on the hot rows' pieces
    # Scratch, sized by the shapes only. Zeroed (one memset): the histogram table [nchunks, V], the
    # hot rows' counters [npieces, ntiles] and the any-hot flag. Not zeroed: local starts [V + 1],
    # block sums and block offsets [nscan] each, the sorted positions [B*T]; the fp32 carry of the
    # hot rows' piece sums [2 * npieces, C] (only read where written).
    ntable = nchunks * v
    table = xp.zeros(ntable + npieces * ntiles + 1, dtype=np.int32)
    counters = table[ntable : ntable + npieces * ntiles]
    any_hot = table[ntable + npieces * ntiles :]
    carry = xp.empty(2 * npieces * c, dtype=np.float32)
    work = xp.empty((v + 1) + 2 * nscan + bt, dtype=np.int32)
    local = work[: v + 1]
    blocksum = work[v + 1 : v + 1 + nscan]
    blockoff = work[v + 1 + nscan : v + 1 + 2 * nscan]
    pos = work[v + 1 + 2 * nscan :]
    n64, v32 = np.int64(bt), np.int32(v)

    get_kernel("embedding", "embedding_count_histogram", ti)((-(-bt // 256),), (256,), (idx, n64, v32, table))
    get_kernel("embedding", "embedding_count_prefix")(
        (nscan,), (SCAN_BLOCK,), (table, np.int32(nchunks), v32, local, blocksum, any_hot)
    )
    get_kernel("embedding", "embedding_count_scan_blocks")((1,), (1024,), (blocksum, np.int32(nscan), blockoff))
    get_kernel("embedding", "embedding_count_scatter", ti)(
        (nchunks, COUNT_CHUNK // 256), (256,), (idx, n64, v32, table, local, blockoff, pos)
    )

    # Row sums: blocks [0, npieces) sum the pieces of the hot rows, the others walk the rows.
    ngroups = -(-v // ROWS_PER_WARP)
    get_kernel("embedding", "embedding_backward_wte_pos", dx.dtype, int(vec), kp, acc)(
        (npieces + -(-ngroups // WARPS_PER_BLOCK), ntiles), (32 * WARPS_PER_BLOCK,),
        (dx, idx, np.int32(idx.dtype.itemsize == 8), pos, local, blockoff, dwte, carry, counters, any_hot,
         np.int32(c), v32, np.int32(npieces)),
    )


def traffic_bytes(b, t, c, vocab_size, max_t, dtype, backward=False, index_itemsize=8):
    """Minimum bytes. Forward: read idx, the B*T gathered wte rows, wpe[:T]; write x. Backward:
    read dx and idx; write dwte and dwpe."""
    s = backend.resolve_dtype(dtype).itemsize
    if backward:
        return b * t * c * s + b * t * index_itemsize + (vocab_size + max_t) * c * s
    return 2 * b * t * c * s + t * c * s + b * t * index_itemsize


__all__ = [
    "METHODS",
    "check_ids_numpy",
    "embedding_backward",
    "embedding_backward_reference",
    "embedding_forward",
    "embedding_forward_reference",
    "traffic_bytes",
]
