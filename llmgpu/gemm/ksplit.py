"""Weight-gradient GEMMs that are right at every reduction length K (issue 13).

A weight gradient ``dW = dyᵀ x`` (``dy [K, M]``, ``x [K, N]``, row-major) sums over the K = B·T
tokens of the batch. On the H200 (CUDA 13 cuBLAS), bf16/fp16 GEMMs whose K is 2ⁿ + 1 were reported
to give ~4e-3 relative error against float64, as large as dropping the last of the K rows, where
K = 2ⁿ gives ~4e-5 (cuBLAS and PyTorch alike; fp32 unaffected). The normal GPT-2 case,
K = 16·1024 = 65536, is a multiple of 64 and not affected; an odd batch (a last partial batch, a
sequence length of 1025) is.

The protection splits the reduction so that no GEMM sees a K with a ragged tail:

* ``K % K_ALIGN == 0`` (the normal case): one GEMM, exactly the call without protection. No extra
  launch, no extra work.
* otherwise ``K = K_main + tail`` with ``K_main = K - K % K_ALIGN`` and ``0 < tail < K_ALIGN``: one GEMM
  over the first ``K_main`` rows (the caller's ``beta``), then one over the ``tail`` rows with
  ``beta = 1``. With ``pad_tail=True`` (default) the tail rows are first copied into zero-padded
  ``[K_ALIGN, M]`` / ``[K_ALIGN, N]`` buffers, so the second GEMM also has K = ``K_ALIGN`` (zero rows
  add exact zeros): every GEMM then has a K that is a multiple of 64, the case the H200 found right.
  Cost: one memset, two copies of ``tail`` rows and one K = 64 GEMM, a few microseconds.
* ``K < K_ALIGN`` (tests, toy batches): one GEMM, as without protection (there is no main part to
  protect; small K is not in the reported trigger set, and ``tools/probes/probe_gemm_k.py`` sweeps it).

Why a split and not an algorithm choice: the same trap shows in cuBLAS (``gemmEx``, whose algorithm
we cannot pick on Hopper) and in PyTorch, i.e. in the heuristics' choice for these K; avoiding the
K makes both of our paths (``llmgpu.gemm.cublas`` for ``linear_backward``, ``llmgpu.gemm.cublaslt``
for ``FastGPT``) right the same way, whatever algorithm the heuristic picks. With a 16-bit output,
the split rounds the partial result once more (two roundings instead of one); weight gradients in
mixed precision are fp32, where that is invisible.

``protect=False`` (an argument of ``pieces``, ``wgrad_gemm`` and ``ops.linear.linear_backward``) switches the
protection off, so ``tools/probes/probe_gemm_k.py`` can measure protected against unprotected in one process. NumPy
arrays never split (the reference is exact in
float32 at any K); :func:`run_pieces` runs the split on any backend, which is how the CPU tests
check it.
"""

from __future__ import annotations

import numpy as np

from ..checks import array_module

K_ALIGN = 64  # every GEMM of a protected reduction has K divisible by this


def pieces(k: int, *, align: int | None = None, protect: bool = True, pad_tail: bool = True):
    """The GEMMs of a K-row reduction: a list of ``(start, stop, k_gemm)``.

    Rows ``start:stop`` of both operands go into one GEMM whose reduction length is ``k_gemm``
    (``stop - start``, or ``align`` for a zero-padded tail; ``pad_tail=False``: the tail's own length). The
    pieces tile ``0:k`` exactly, in order. One piece (``[(0, k, k)]``) when protection is off
    (``protect=False``: the probe's baseline), when ``k % align == 0`` or when ``k < align``.
    """
    align = K_ALIGN if align is None else int(align)
    protect, pad_tail = bool(protect), bool(pad_tail)
    k = int(k)
    if k < 0 or align < 1:
        raise ValueError(f"need k >= 0 and align >= 1, got k={k}, align={align}")
    tail = k % align
    if not protect or tail == 0 or k < align:
        return [(0, k, k)]
    main = k - tail
    return [(0, main, main), (main, k, align if pad_tail else tail)]


def needs_split(k: int, **kw) -> bool:
    """True when :func:`pieces` makes more than one GEMM of a K-row reduction."""
    return len(pieces(k, **kw)) > 1


def _padded_rows(xp, a, b, start, stop, k_gemm):
    """Rows ``start:stop`` of a and b, zero-padded to ``k_gemm`` rows (one allocation, one memset)."""
    rows = stop - start
    if rows == k_gemm:
        return a[start:stop], b[start:stop]
    m, n = a.shape[1], b.shape[1]
    buf = xp.zeros(k_gemm * (m + n), dtype=a.dtype)
    pa = buf[: k_gemm * m].reshape(k_gemm, m)
    pb = buf[k_gemm * m:].reshape(k_gemm, n)
    pa[:rows] = a[start:stop]
    pb[:rows] = b[start:stop]
    return pa, pb


def run_pieces(gemm, a, b, parts, *, out=None, alpha=1.0, beta=0.0, out_dtype=None):
    """``out = alpha · aᵀ b + beta · out`` as one ``gemm(.., trans_a=True)`` call per piece of ``parts``.

    ``a [K, M]`` and ``b [K, N]`` are 2-D C-contiguous; ``gemm`` has the signature of
    :func:`llmgpu.gemm.gemm` (``lt_gemm`` too). The first piece takes the caller's ``beta``, every
    later one ``beta = 1``. Backend-agnostic (the CPU tests run it on NumPy arrays).
    """
    xp = array_module(a=a, b=b, out=out)
    for i, (start, stop, k_gemm) in enumerate(parts):
        pa, pb = _padded_rows(xp, a, b, start, stop, k_gemm)
        if i == 0:
            out = gemm(pa, pb, trans_a=True, out=out, alpha=alpha, beta=beta, out_dtype=out_dtype)
        else:
            out = gemm(pa, pb, trans_a=True, out=out, alpha=alpha, beta=1.0)
    return out


def wgrad_gemm(a, b, *, out=None, alpha=1.0, beta=0.0, out_dtype=None, gemm=None, protect: bool = True,
               pad_tail: bool = True):
    """``out = alpha · aᵀ b + beta · out`` for ``a [K, M]``, ``b [K, N]``: a weight gradient, right at every K.

    ``gemm`` is the GEMM to call (default :func:`llmgpu.gemm.gemm`, cuBLAS; ``FastGPT`` passes
    ``lt_gemm``). On the GPU with ``protect`` (default) and ``K % K_ALIGN != 0`` the reduction is split
    (module docstring; ``pad_tail`` as for ``pieces``); otherwise this is exactly ``gemm(a, b, trans_a=True, ...)``.
    """
    if gemm is None:
        from .cublas import gemm
    if a.ndim == 2 and b.ndim == 2 and array_module(a=a, b=b, out=out) is not np:
        parts = pieces(a.shape[0], protect=protect, pad_tail=pad_tail)
        if len(parts) > 1 and a.shape[0] == b.shape[0]:
            return run_pieces(gemm, a, b, parts, out=out, alpha=alpha, beta=beta, out_dtype=out_dtype)
    return gemm(a, b, trans_a=True, out=out, alpha=alpha, beta=beta, out_dtype=out_dtype)


__all__ = ["K_ALIGN", "needs_split", "pieces", "run_pieces", "wgrad_gemm"]
