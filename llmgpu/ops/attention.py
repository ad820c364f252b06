"""Scaled dot-product attention, forward and backward, from batched GEMMs and the softmax kernels.

Per (batch, head), with q, k, v of shape [T, D] and scale c = 1/√D::

    forward    S = q kᵀ            [T, T]   GEMM
               P = softmax(c·S)    [T, T]   row softmax, causal mask (key ≤ query) applied inside
               O = P v             [T, D]   GEMM
    backward   dV = Pᵀ dO          [T, D]   GEMM
               dP = dO vᵀ          [T, T]   GEMM
               dS = c · P ⊙ (dP − rowsum(P ⊙ dP))   softmax backward (the scale folded in)
               dQ = dS k           [T, D]   GEMM
               dK = dSᵀ q          [T, D]   GEMM

All B·H products run as one strided-batched cuBLAS call (``llmgpu.gemm.gemm`` on [B·H, T, D] views,
fp32 accumulation). The T × T matrices are what makes this "math path" memory-hungry: S and P cost
B·H·T² elements each, against B·H·T·D for q, k, v. A fused (flash) kernel (Dao et al.,
FlashAttention) never writes them: it keeps a tile of S in registers and stores only the row
log-sum-exp for the backward, which recomputes P. The profiling chapter builds that path;
``AttentionStats`` already has the slot for it (``lse``), so the signatures stay the same.

Precision of the T × T intermediates for fp16/bf16 inputs (``fp32_scores=True``, the default):
the scores S and the gradient dP come out of cuBLAS in **fp32** and are consumed right away by the
softmax kernels; the probabilities P and the gradient dS are stored in the **input dtype**, because
they feed the next GEMM (whose operands share a dtype) and P must be kept for the backward. This is
the precision FlashAttention uses (fp32 scores in registers, 16-bit P into the PV product). Rounding
S to bf16 instead would perturb every logit by up to 2⁻⁹·|S| (|S| grows like √D) before the
exponential; fp32 S costs 2 extra bytes per score written and read once, while the stored
activation (P) is the same 2 bytes per element either way. ``fp32_scores=False`` keeps S and dP in
the input dtype (less traffic, less accuracy) for comparison.

Grouped-query attention (GQA; multi-query when H_kv = 1): k and v may have H_kv heads, H_kv dividing the H
query heads. Query head h reads K/V head h // G, G = H / H_kv (Hugging Face's ``repeat_kv`` order: K/V head j
serves the contiguous query heads j·G … j·G + G − 1), and the gradient of a K/V head is the sum over its group.
No repeated K/V is made: q's heads j·G … j·G + G − 1 are contiguous, so q viewed as [B·H_kv, G·T, D] stacks the
group's G·T query rows over one K/V head, and the two forward GEMMs take that view as their M side (S comes out
[B·H_kv, G·T, T], which is [B·H, T, T] again in memory, so the softmax and its causal mask still see one T × T
matrix per (b, h) and mask by query position t, not by row of the stacked G·T). In the backward the same views
make dV = Pᵀ dO and dK = dSᵀ Q GEMMs whose inner dimension runs over the G·T rows: the sum over the group happens
inside the GEMM's fp32 accumulation, rounded once. With H_kv = H the views are today's [B·H, T, D] and nothing
changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_bool, check_float, check_gpu_dtype, check_same_dtype
from ..gemm import gemm
from .softmax import softmax_backward, softmax_forward


@dataclass
class AttentionStats:
    """What ``attention_backward`` needs from ``attention_forward``.

    This implementation keeps the probabilities ``p`` [B, H, T, T] (input dtype). A fused kernel
    keeps only ``lse`` [B, H, T] (fp32 row log-sum-exp of the scaled scores) and recomputes P; both
    fit this object, so callers pass it through without looking inside.
    """

    p: Any = None
    lse: Any = None
    scale: float = 1.0
    causal: bool = True

    @property
    def kind(self) -> str:
        return "probs" if self.p is not None else "lse"

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.p, self.lse) if a is not None)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def kv_group(n_head: int, n_kv_head: int) -> int:
    """G = H / H_kv, the query heads that share one K/V head (1: multi-head; H: multi-query attention); a ValueError
    naming both head counts when H_kv does not divide H."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"grouped-query attention needs the query heads H={n_head} to be a multiple of the key/value "
                         f"heads H_kv={n_kv_head}")
    return n_head // n_kv_head


def _check_qkv(q, k, v):
    """xp and G for q [B, H, T, D] and k, v [B, H_kv, T, D] (H_kv dividing H)."""
    xp = array_module(q=q, k=k, v=v)
    check_array("q", q, ndim=4)
    B, H, T, D = q.shape
    check_array("k", k, shape=(B, None, T, D))
    check_array("v", v, shape=k.shape)
    group = kv_group(H, k.shape[1])
    check_same_dtype(q=q, k=k, v=v)
    if xp is not np:
        check_gpu_dtype("q", q)  # k and v: q's dtype, checked above
    return xp, group


def _score_dtype(dtype, fp32_scores):
    if dtype == backend.float64:
        return backend.float64
    return backend.float32 if fp32_scores else dtype


def _mm(a, b, *, trans_a=False, trans_b=False, out=None, out_dtype=None):
    """Batched product through ``gemm``; float64 (NumPy only, for finite differences) through np.matmul,
    since ``gemm`` takes fp32/fp16/bf16 inputs."""
    if a.dtype == backend.float64:
        A = np.swapaxes(a, -1, -2) if trans_a else a
        B = np.swapaxes(b, -1, -2) if trans_b else b
        return np.matmul(A, B, out=out)
    return gemm(a, b, trans_a=trans_a, trans_b=trans_b, out=out, out_dtype=out_dtype)


def attention_forward(q, k, v, causal=True, *, scale=None, method="auto", fp32_scores=True):
    """``O = softmax(scale · q kᵀ, causal) v`` for q [B, H, T, D] and k, v [B, H_kv, T, D] (H_kv = H, or fewer
    K/V heads shared by groups of H / H_kv query heads: the module's docstring); returns ``(o, stats)``.

    ``scale`` defaults to 1/√D; ``method`` picks the softmax kernel (see ``llmgpu.ops.softmax``).
    """
    _, G = _check_qkv(q, k, v)
    B, H, T, D = q.shape
    scale = default_scale(D) if scale is None else check_float("scale", scale)
    check_bool("causal", causal)
    q3 = q.reshape(B * H // G, G * T, D)  # a K/V head's group of query rows (G = 1: [BH, T, D])
    k3, v3 = (a.reshape(B * H // G, T, D) for a in (k, v))
    s = _mm(q3, k3, trans_b=True, out_dtype=_score_dtype(q.dtype, fp32_scores))  # S = q kᵀ  [BH/G, GT, T]
    p = softmax_forward(s.reshape(B * H, T, T), method=method, scale=scale, causal=causal, out_dtype=q.dtype)
    del s  # the scores are not kept: the backward needs P only
    o = _mm(p.reshape(B * H // G, G * T, T), v3)  # O = P v  [BH/G, GT, D]
    return o.reshape(B, H, T, D), AttentionStats(p=p.reshape(B, H, T, T), scale=scale, causal=causal)


def attention_backward(do, q, k, v, o, stats, causal=True, *, method="auto", fp32_scores=True):
    """Gradients ``(dq, dk, dv)`` of attention given dO, the inputs, the output and the forward's stats; dk and dv
    have k's H_kv heads, each the sum over the query heads of its group."""
    array_module(do=do, q=q, k=k, v=v, o=o)
    _, G = _check_qkv(q, k, v)
    check_array("do", do, shape=q.shape)
    check_array("o", o, shape=q.shape)
    check_same_dtype(q=q, do=do, o=o)
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be the AttentionStats returned by attention_forward, got {type(stats).__name__}")
    if stats.p is None:
        raise ValueError("stats holds no probabilities (only lse): it comes from a fused kernel, not this path")
    if check_bool("causal", causal) != stats.causal:
        raise ValueError(f"stats were computed with causal={stats.causal}, backward called with causal={causal}")
    B, H, T, D = q.shape
    array_module(q=q, **{"stats.p": stats.p})  # same device as q (TypeError naming stats.p otherwise)
    check_array("stats.p", stats.p, shape=(B, H, T, T), dtype=q.dtype)

    BK = B * H // G  # (batch, K/V head) pairs; a K/V head's G query heads as G·T rows (G = 1: [BH, T, D])
    q3, do3 = (a.reshape(BK, G * T, D) for a in (q, do))
    k3, v3 = (a.reshape(BK, T, D) for a in (k, v))
    p3 = stats.p.reshape(BK, G * T, T)
    dv = _mm(p3, do3, trans_a=True)  # dV = Pᵀ dO, summed over the group's G·T rows
    dp = _mm(do3, v3, trans_b=True, out_dtype=_score_dtype(q.dtype, fp32_scores))  # dP = dO vᵀ
    ds = softmax_backward(dp.reshape(B * H, T, T), stats.p.reshape(B * H, T, T), method=method, scale=stats.scale,
                          causal=causal).reshape(BK, G * T, T)  # dS, scale folded in
    del dp
    dq = _mm(ds, k3)  # dQ = dS k
    dk = _mm(ds, q3, trans_a=True)  # dK = dSᵀ q, summed over the group's G·T rows
    return dq.reshape(B, H, T, D), dk.reshape(k.shape), dv.reshape(v.shape)


# --------------------------------------------------------------------------- accounting and profiling


def attention_flops(B, H, T, D, causal=True, direction="fwd") -> float:
    """Useful floating-point work, FlashAttention's convention: forward 4·B·H·T²·D (two GEMMs), halved
    when causal (only the lower triangle counts); backward 2.5 × forward. The math path computes the
    full T × T GEMMs even when causal, so its rate by this count is an *effective* rate. H counts query
    heads: grouped K/V heads (H_kv < H) share operands, not work, so the count is the same."""
    fwd = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return fwd if direction == "fwd" else 2.5 * fwd


def attention_stages(q, k, v, do, causal=True, *, method="auto", fp32_scores=True):
    """The forward and backward as their eight stages, to run (and time) one at a time.

    Returns ``[(pass, stage, kind, fn), ...]`` with pass ``"fwd"|"bwd"``, kind ``"gemm"|"softmax"`` and
    ``fn()`` running the stage on buffers allocated once (``llmgpu.perf.sweeps.attention_stage_times``
    times them). Run them in order once before timing, so each stage reads real data.
    """
    xp, G = _check_qkv(q, k, v)
    check_array("do", do, shape=q.shape, dtype=q.dtype)
    B, H, T, D = q.shape
    BK = B * H // G  # as in attention_backward: a K/V head's group of query rows as one operand
    scale = default_scale(D)
    sdt = _score_dtype(q.dtype, fp32_scores)
    q3, do3 = (a.reshape(BK, G * T, D) for a in (q, do))
    k3, v3 = (a.reshape(BK, T, D) for a in (k, v))
    S = xp.empty((B * H, T, T), dtype=sdt)
    P = xp.empty((B * H, T, T), dtype=q.dtype)
    dP = xp.empty((B * H, T, T), dtype=sdt)
    dS = xp.empty((B * H, T, T), dtype=q.dtype)
    O, dQ = (xp.empty((BK, G * T, D), dtype=q.dtype) for _ in range(2))
    dV, dK = (xp.empty((BK, T, D), dtype=q.dtype) for _ in range(2))
    S3, P3, dP3, dS3 = (a.reshape(BK, G * T, T) for a in (S, P, dP, dS))
    stages = [
        ("fwd", "S = Q Kᵀ", "gemm", lambda: _mm(q3, k3, trans_b=True, out=S3)),
        ("fwd", "P = softmax(S)", "softmax",
         lambda: softmax_forward(S, method=method, out=P, scale=scale, causal=causal, out_dtype=q.dtype)),
        ("fwd", "O = P V", "gemm", lambda: _mm(P3, v3, out=O)),
        ("bwd", "dV = Pᵀ dO", "gemm", lambda: _mm(P3, do3, trans_a=True, out=dV)),
        ("bwd", "dP = dO Vᵀ", "gemm", lambda: _mm(do3, v3, trans_b=True, out=dP3)),
        ("bwd", "dS = softmax_bwd(dP, P)", "softmax",
         lambda: softmax_backward(dP, P, method=method, out=dS, scale=scale, causal=causal)),
        ("bwd", "dQ = dS K", "gemm", lambda: _mm(dS3, k3, out=dQ)),
        ("bwd", "dK = dSᵀ Q", "gemm", lambda: _mm(dS3, q3, trans_a=True, out=dK)),
    ]  # fmt: skip
    return stages


__all__ = [
    "AttentionStats",
    "attention_backward",
    "attention_flops",
    "attention_forward",
    "attention_stages",
    "default_scale",
    "kv_group",
]
