"""Strided views of the buffers around attention: q, k, v as ``[B, H, T, D]`` views of the QKV projection's output
rows, and a ``[B, H, T, D]`` view of ``[B, T, C]`` rows (chapter 2b). Flash attention (ours and cuDNN's) reads and
writes through them, so no transposing copy is made before or after it."""

from __future__ import annotations

from .attention import kv_group


def split_qkv(qkv, n_head: int, n_kv_head: int | None = None):
    """q, k, v as ``[B, H, T, D]`` views of a contiguous ``[B, T, 3C]`` QKV buffer (no copy).

    Column block 0 of the last axis is q, block 1 k, block 2 v (the layout of GPT-2's ``c_attn``);
    element strides ``(T·3C, D, 3C, 1)``. With ``n_kv_head`` (grouped-query attention) the buffer is
    ``[B, T, (H + 2·H_kv)·D]``: q's H heads, then k's and v's H_kv heads each.
    """
    h_kv = n_head if n_kv_head is None else n_kv_head
    kv_group(n_head, h_kv)
    width = n_head + 2 * h_kv  # heads of D columns in a row
    if qkv.ndim != 3 or qkv.shape[-1] % width:
        want = "3C] with C a multiple of" if h_kv == n_head else f"(H + 2·H_kv)·D] with H_kv={h_kv},"
        raise ValueError(f"qkv must be [B, T, {want} n_head={n_head}, got {tuple(qkv.shape)}")
    if not qkv.flags.c_contiguous:
        raise ValueError("qkv must be C-contiguous")
    B, T, W = qkv.shape
    heads = qkv.reshape(B, T, width, W // width).transpose(0, 2, 1, 3)
    return heads[:, :n_head], heads[:, n_head:n_head + h_kv], heads[:, n_head + h_kv:]


def heads_view(x, n_head: int):
    """A ``[B, H, T, D]`` view of a contiguous ``[B, T, C]`` buffer (no copy): element strides ``(T·C, D, C, 1)``."""
    if x.ndim != 3 or x.shape[-1] % n_head:
        raise ValueError(f"x must be [B, T, C] with C a multiple of n_head={n_head}, got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous")
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


__all__ = ["heads_view", "split_qkv"]
