"""The flash-attention algorithm in NumPy: the spec our kernels (``kernels/flash_attention.cu``) are tested against.

Two forms of the same math, on q, k, v of shape ``[B, H, T, D]`` (NumPy, float32 math, float64 stays float64):

* ``naive_*`` materialises the T × T scores (as chapter 2's attention does) and is the definition.
* ``tiled_*`` is the FlashAttention algorithm (Dao et al., 2022; Dao, 2023): the forward walks key/value tiles
  with an **online softmax** (running row maximum ``m`` and sum ``l``; when a tile raises the maximum, the sum and
  the output accumulator are rescaled by ``exp(m_old − m_new)``) and keeps only the per-row log-sum-exp
  ``lse_i = m_i + log l_i`` for the backward. The backward recomputes ``P = exp(c·S − lse)`` tile by tile, as the
  CUDA kernels do: dK and dV per key tile looping over query tiles, dQ per query tile looping over key tiles.

Both take the scores scaled by ``scale`` (c, 1/√D by default) and, when ``causal``, mask key j > query i. K and V
have q's heads here (a ValueError otherwise); ``grouped_backward`` takes grouped-query K/V (H_kv dividing H), as the
public ops (``ops.flash_attention``, ``ops.attention``) do.
"""

from __future__ import annotations

import numpy as np

TILE = 64  # rows per tile, as in the CUDA kernels


def compute_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _check_heads(q, k, v, grouped=False):
    """k and v of q's shape ``[..., H, T, D]``, or with ``grouped`` of ``[..., H_kv, T, D]`` with H_kv dividing H."""
    want = q.shape if not grouped else (*q.shape[:-3], k.shape[-3], *q.shape[-2:])
    if k.shape != want or v.shape != want or (grouped and (k.shape[-3] < 1 or q.shape[-3] % k.shape[-3])):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}: "
                         + ("H_kv must divide H, with q's B, T, D" if grouped else "the reference takes q's heads "
                            "(grouped K/V: grouped_backward)"))


def _visible(q0, nq, k0, nk, causal):
    """Boolean [nq, nk] mask of the keys k0.. that queries q0.. see."""
    if not causal:
        return np.ones((nq, nk), dtype=bool)
    return (k0 + np.arange(nk))[None, :] <= (q0 + np.arange(nq))[:, None]


def naive_forward(q, k, v, scale, causal):
    """(o, lse) with the whole T × T score matrix, in the compute dtype."""
    _check_heads(q, k, v)
    ct = compute_dtype(q.dtype)
    T = q.shape[-2]
    s = np.matmul(q.astype(ct), np.swapaxes(k.astype(ct), -1, -2)) * ct(scale)
    s = np.where(_visible(0, T, 0, T, causal), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return np.matmul(p / den, v.astype(ct)), (m + np.log(den))[..., 0]


def tiled_forward(q, k, v, scale, causal, tile=TILE):
    """(o, lse) by the online softmax over key tiles of ``tile`` keys (query tiles likewise)."""
    _check_heads(q, k, v)
    ct = compute_dtype(q.dtype)
    q, k, v = (a.astype(ct) for a in (q, k, v))
    *lead, T, D = q.shape
    o = np.empty((*lead, T, D), dtype=ct)
    lse = np.empty((*lead, T), dtype=ct)
    for q0 in range(0, T, tile):
        qt = q[..., q0:q0 + tile, :]
        nq = qt.shape[-2]
        m = np.full((*lead, nq, 1), -np.inf, dtype=ct)
        l = np.zeros((*lead, nq, 1), dtype=ct)
        acc = np.zeros((*lead, nq, D), dtype=ct)
        kv_end = min(T, q0 + nq) if causal else T
        for k0 in range(0, kv_end, tile):
            kt, vt = k[..., k0:k0 + tile, :], v[..., k0:k0 + tile, :]
            s = np.matmul(qt, np.swapaxes(kt, -1, -2)) * ct(scale)
            s = np.where(_visible(q0, nq, k0, kt.shape[-2], causal), s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            ref = np.where(m_new == -np.inf, 0.0, m_new)  # a row that has seen only masked keys
            alpha = np.exp(m - ref)  # rescale what was summed against the old maximum
            p = np.exp(s - ref)
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * alpha + np.matmul(p, vt)
            m = m_new
        o[..., q0:q0 + nq, :] = acc / l
        lse[..., q0:q0 + nq] = (np.where(m == -np.inf, 0.0, m) + np.log(l))[..., 0]
    return o, lse


def naive_backward(do, q, k, v, o, lse, scale, causal):
    """(dq, dk, dv) from the recomputed T × T probabilities."""
    _check_heads(q, k, v)
    ct = compute_dtype(q.dtype)
    T = q.shape[-2]
    s = np.matmul(q.astype(ct), np.swapaxes(k.astype(ct), -1, -2)) * ct(scale)
    p = np.where(_visible(0, T, 0, T, causal), np.exp(s - lse.astype(ct)[..., None]), 0.0)
    dof = do.astype(ct)
    dv = np.matmul(np.swapaxes(p, -1, -2), dof)
    dp = np.matmul(dof, np.swapaxes(v.astype(ct), -1, -2))
    d_row = (dof * o.astype(ct)).sum(axis=-1, keepdims=True)  # D_i = dO_i · O_i = Σ_j P_ij dP_ij
    ds = p * (dp - d_row) * ct(scale)
    return np.matmul(ds, k.astype(ct)), np.matmul(np.swapaxes(ds, -1, -2), q.astype(ct)), dv


def tiled_backward(do, q, k, v, o, lse, scale, causal, tile=TILE):
    """(dq, dk, dv) as the CUDA kernels compute them: P recomputed per (query tile, key tile) from lse."""
    _check_heads(q, k, v)
    ct = compute_dtype(q.dtype)
    q, k, v, do, o = (a.astype(ct) for a in (q, k, v, do, o))
    lse = lse.astype(ct)
    T = q.shape[-2]
    delta = (do * o).sum(axis=-1)  # D_i, the preprocessing kernel
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    def probs(q0, k0):
        qt, kt = q[..., q0:q0 + tile, :], k[..., k0:k0 + tile, :]
        s = np.matmul(qt, np.swapaxes(kt, -1, -2)) * ct(scale)
        vis = _visible(q0, qt.shape[-2], k0, kt.shape[-2], causal)
        p = np.where(vis, np.exp(s - lse[..., q0:q0 + tile, None]), 0.0)
        dp = np.matmul(do[..., q0:q0 + tile, :], np.swapaxes(v[..., k0:k0 + tile, :], -1, -2))
        return p, p * (dp - delta[..., q0:q0 + tile, None])  # P and dS / scale

    for k0 in range(0, T, tile):  # flash_bwd_dkdv: one key tile, all query tiles that see it
        for q0 in range((k0 // tile) * tile if causal else 0, T, tile):
            p, ds = probs(q0, k0)
            dv[..., k0:k0 + tile, :] += np.matmul(np.swapaxes(p, -1, -2), do[..., q0:q0 + tile, :])
            dk[..., k0:k0 + tile, :] += np.matmul(np.swapaxes(ds, -1, -2), q[..., q0:q0 + tile, :])
    for q0 in range(0, T, tile):  # flash_bwd_dq: one query tile, the key tiles it sees
        for k0 in range(0, min(T, q0 + tile) if causal else T, tile):
            _, ds = probs(q0, k0)
            dq[..., q0:q0 + tile, :] += np.matmul(ds, k[..., k0:k0 + tile, :])
    return dq * ct(scale), dk * ct(scale), dv


def grouped_backward(do, q, k, v, o, lse, scale, causal):
    """``tiled_backward`` for K/V with H_kv heads dividing q's H: K/V repeated per group of H / H_kv query heads, then
    dK and dV summed over each group (what grouped-query attention's gradient is)."""
    _check_heads(q, k, v, grouped=True)
    B, H, T, D = q.shape
    G = H // k.shape[1]
    kr, vr = (np.repeat(a, G, axis=1) if G > 1 else a for a in (k, v))
    dq, dk, dv = tiled_backward(do, q, kr, vr, o, lse, scale, causal)
    return (dq, *(g.reshape(B, H // G, G, T, D).sum(axis=2) if G > 1 else g for g in (dk, dv)))


__all__ = ["TILE", "compute_dtype", "grouped_backward", "naive_backward", "naive_forward", "tiled_backward",
           "tiled_forward"]
