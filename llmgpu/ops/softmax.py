"""Softmax over the last axis, forward and backward (chapter 2, ``kernels/softmax.cu``).

Forward, one row x (with an optional ``scale`` s, as attention uses it)::

    p_j = exp(s·x_j − m) / Σ_k exp(s·x_k − m),      m = max_k s·x_k

Backward: the Jacobian of softmax is ∂p_i/∂x_j = s·p_i·(δ_ij − p_j), a T × T matrix per row that we
never build. Its product with the incoming gradient dp collapses to one dot product per row::

    dx_j = s · p_j · (dp_j − Σ_k p_k dp_k)

so the backward pass reads p and dp once and writes dx once: O(T) work and memory per row, not O(T²).

``causal=True`` treats x as score matrices [..., T, T]: row i (query position i) sees columns
0..i; later columns get probability exactly 0 and gradient exactly 0, and the kernels never read them.

``method`` picks the CUDA kernel on CuPy arrays (NumPy arrays always run the reference):

* ``"naive"`` one thread per row (the article's kernel): uncoalesced, three sweeps per row.
* ``"warp"``  one warp per row: coalesced loads, shuffle reductions, online max/sum.
* ``"block"`` one block per row, 16-byte vector loads, registers hold the row between the two passes.
* ``"auto"``  ``"warp"`` for rows of at most ``AUTO_WARP_MAX_COLS`` columns, else ``"block"``. A short row
  is at most four elements per lane: one warp covers it in a few coalesced loads and needs no
  barrier, and eight rows share a 256-thread block. The block kernel would leave most of its
  (at least 32) threads idle on such a row and pay two ``__syncthreads``. From a few hundred columns on,
  one warp cannot keep enough bytes in flight for a row (scalar loads, and a 50257-wide row would
  be walked by 32 threads alone), while the block kernel spreads the row over up to 1024 threads
  with 16-byte loads. The benchmark (``benchmarks/bench_ch2_softmax_attention.py``) times both
  across row lengths so the threshold can be checked on the GPU at hand.

Non-finite input, every method and the reference alike (as PyTorch): a NaN or +inf among a row's
visible entries makes that whole row of p NaN (+inf: inf − inf); −inf entries get probability 0;
a row with no finite entry (all −inf) is NaN; masked (causal) entries stay exactly 0 and are never
read. Backward: a NaN in a row's visible p or dp makes that row of dx NaN (through Σ p⊙dp).

Dtypes: fp32, fp16, bf16 on the GPU (arithmetic in fp32); the NumPy reference also takes fp64. The
output defaults to the input's dtype; ``out_dtype`` may ask for fp16/bf16 probabilities from fp32
scores (attention does this: scores from cuBLAS in fp32, probabilities in bf16 for the next GEMM).
Likewise ``softmax_backward`` accepts an fp32 ``dp`` with fp16/bf16 ``p`` and writes dx like p.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import GPU_DTYPES, array_module, check_array, check_gpu_dtype, check_method, check_out, reference_dtype
from ..kernels import get_kernel, loader
from ..kernels.launch import VECTOR_BYTES, elements_aligned

METHODS = ("naive", "warp", "block", "auto")
AUTO_WARP_MAX_COLS = 128
NAIVE_THREADS = 128
WARP_ROWS_PER_BLOCK = 8  # 256 threads
BLOCK_MAX_THREADS = 1024
BLOCK_VECTORS_PER_THREAD = loader.constant("softmax", "SOFTMAX_CACHE")  # vectors a thread keeps in registers


def _pick_method(method, cols):
    check_method("softmax", method, METHODS)
    if method == "auto":
        return "warp" if cols <= AUTO_WARP_MAX_COLS else "block"
    return method


def _check_causal(name, a, causal):
    if causal and (a.ndim < 2 or a.shape[-1] != a.shape[-2]):
        raise ValueError(f"causal softmax needs square score matrices [..., T, T]; {name} has shape {tuple(a.shape)}")


def _check_pair(score_name, score_dtype, prob_name, prob_dtype):
    """GPU type pairs: the same dtype, or fp32 scores with fp16/bf16 probabilities."""
    for n, d in ((score_name, score_dtype), (prob_name, prob_dtype)):
        check_gpu_dtype(n, d)
    if score_dtype != prob_dtype and score_dtype != backend.float32:
        raise TypeError(
            f"{score_name} ({backend.dtype_name(score_dtype)}) and {prob_name} ({backend.dtype_name(prob_dtype)}) "
            f"must share a dtype, or {score_name} must be fp32"
        )


def _causal_mask(T):
    """Boolean [T, T] mask of the visible entries (key position <= query position); broadcasts over [..., T, T]."""
    return np.tril(np.ones((T, T), dtype=bool))


_compute_dtype = reference_dtype


# --------------------------------------------------------------------------- forward


def softmax_forward(x, method="auto", out=None, *, scale=1.0, causal=False, out_dtype=None):
    """``p = softmax(scale · x)`` over the last axis (rows of any length ≥ 1).

    ``causal=True``: x is [..., T, T] and row i keeps columns 0..i (the rest of p is exactly 0).
    ``out_dtype`` (default: x's dtype) lets fp32 scores produce fp16/bf16 probabilities.
    """
    xp = array_module(x=x, out=out)
    check_array("x", x)
    if x.ndim < 1:
        raise ValueError("x must have at least one axis")
    _check_causal("x", x, causal)
    pdt = backend.resolve_dtype(out_dtype) if out_dtype is not None else x.dtype
    if pdt not in (*GPU_DTYPES, backend.float64):
        raise TypeError(f"out_dtype must be a float dtype, got {pdt}")
    cols = x.shape[-1]
    method = _pick_method(method, cols)
    if xp is np:
        p = _softmax_forward_numpy(x, float(scale), causal)
        out = check_out(out, x.shape, pdt, xp)
        out[...] = p.astype(pdt)
        return out
    _check_pair("x", x.dtype, "out", pdt)
    out = check_out(out, x.shape, pdt, xp)
    rows = x.size // cols
    _launch(xp, "fwd", method, (x, out), rows, cols, scale, x.shape[-1] if causal else 0)
    return out


def _softmax_forward_numpy(x, scale, causal):
    """The reference: float32 math (float64 for float64 input), max subtracted. NaN or +inf among a
    row's visible entries gives a NaN row (np.max propagates NaN; inf - inf), as in PyTorch; masked
    (causal) entries are exactly 0 whatever the row holds, as the kernels write them."""
    t = x.astype(_compute_dtype(x.dtype)) * scale
    if causal:
        mask = _causal_mask(t.shape[-1])
        t = np.where(mask, t, -np.inf)
    with np.errstate(invalid="ignore"):  # inf - inf for +inf or all -inf rows: NaN is the answer
        t = t - t.max(axis=-1, keepdims=True)
        e = np.exp(t)  # exp(-inf) = 0 for masked entries
        p = e / e.sum(axis=-1, keepdims=True)
    return np.where(mask, p, 0.0) if causal else p


# --------------------------------------------------------------------------- backward


def softmax_backward(dp, p, method="auto", out=None, *, scale=1.0, causal=False):
    """``dx = scale · p ⊙ (dp − Σ p⊙dp)`` per row: the gradient of ``softmax(scale · x)`` w.r.t. x.

    ``dp`` may be fp32 with fp16/bf16 ``p``; dx has p's dtype. With ``causal=True`` the masked part of
    dx is exactly 0 and neither p nor dp is read there.
    """
    xp = array_module(dp=dp, p=p, out=out)
    check_array("p", p)
    check_array("dp", dp, shape=p.shape)
    _check_causal("p", p, causal)
    cols = p.shape[-1]
    method = _pick_method(method, cols)
    if xp is np:
        if dp.dtype != p.dtype and dp.dtype not in (backend.float32, backend.float64):
            raise TypeError(f"dp ({dp.dtype}) and p ({p.dtype}) must share a dtype, or dp must be fp32")
        ct = _compute_dtype(dp.dtype, p.dtype)
        pf, gf = p.astype(ct), dp.astype(ct)
        if causal:  # masked entries are never read (a NaN there must not reach the row's sum)
            mask = _causal_mask(cols)
            pf, gf = np.where(mask, pf, 0.0), np.where(mask, gf, 0.0)
        with np.errstate(invalid="ignore"):  # inf - inf for a +inf dp: NaN is the answer
            dx = scale * pf * (gf - (pf * gf).sum(axis=-1, keepdims=True))
        if causal:
            dx = np.where(mask, dx, 0.0)
        out = check_out(out, p.shape, p.dtype, xp)
        out[...] = dx.astype(p.dtype)
        return out
    _check_pair("dp", dp.dtype, "p", p.dtype)
    out = check_out(out, p.shape, p.dtype, xp)
    rows = p.size // cols
    _launch(xp, "bwd", method, (dp, p, out), rows, cols, scale, cols if causal else 0)
    return out


# --------------------------------------------------------------------------- launching


def pair_vector_width(score_dtype, prob_dtype) -> int:
    """Elements per 16-byte vector of the wider of the two types (4 for fp32, 8 for 16-bit pairs)."""
    return VECTOR_BYTES // max(np.dtype(score_dtype).itemsize, np.dtype(prob_dtype).itemsize)


def block_threads(cols, width) -> int:
    """Threads of the block kernel: enough for ``BLOCK_VECTORS_PER_THREAD`` vectors each, 32..1024."""
    nvec = cols // width
    want = -(-nvec // BLOCK_VECTORS_PER_THREAD)
    return int(min(BLOCK_MAX_THREADS, max(32, -(-want // 32) * 32)))


def can_vectorize(arrays, cols, width) -> bool:
    """16-byte loads need whole vectors per row and every base pointer aligned to its vector size."""
    return cols % width == 0 and elements_aligned(width, *arrays)


def _launch(xp, direction, method, arrays, rows, cols, scale, causal_T):
    if rows >= 2**31 or cols >= 2**31:
        raise ValueError(f"softmax kernels take fewer than 2**31 rows and columns, got {rows} x {cols}")
    score, prob = arrays[0].dtype, arrays[1].dtype
    fn = f"softmax_{direction}_{method}"
    args = (*arrays, np.int32(rows), np.int32(cols), np.float32(scale), np.int32(causal_T))
    if method == "naive":
        kernel = get_kernel("softmax", fn, score, prob)
        kernel((-(-rows // NAIVE_THREADS),), (NAIVE_THREADS,), args)
    elif method == "warp":
        kernel = get_kernel("softmax", fn, score, prob)
        kernel((-(-rows // WARP_ROWS_PER_BLOCK),), (32 * WARP_ROWS_PER_BLOCK,), args)
    else:
        width = pair_vector_width(score, prob)
        vec = can_vectorize(arrays, cols, width)
        kernel = get_kernel("softmax", fn, score, prob, "true" if vec else "false")
        kernel((rows,), (block_threads(cols, width if vec else 1),), args)


def softmax_bytes(rows, cols, score_dtype, prob_dtype=None, direction="fwd") -> int:
    """Minimum bytes moved: forward reads x and writes p; backward reads dp and p and writes dx."""
    prob_dtype = prob_dtype or score_dtype
    s, p = np.dtype(score_dtype).itemsize, np.dtype(prob_dtype).itemsize
    per = s + p if direction == "fwd" else s + 2 * p
    return int(rows) * int(cols) * per


__all__ = [
    "AUTO_WARP_MAX_COLS",
    "METHODS",
    "softmax_backward",
    "softmax_bytes",
    "softmax_forward",
]
