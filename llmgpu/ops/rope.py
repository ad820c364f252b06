"""Rotary position embedding (RoPE), forward and backward, in Hugging Face Llama's layout (``kernels/rope.cu``).

RoPE encodes a token's position ``t`` by rotating its query and key vectors, pair by pair, by angles
that grow with ``t``. For head dimension ``D`` (even), with ``half = D / 2``::

    inv_freq_j = theta ** (-2 j / D)                 j = 0 .. half - 1
    angle[t, j] = t * inv_freq_j                     cos, sin: the tables [S, half] (rope_tables)
    y[..., t, j]        = x[..., t, j] cos[t, j] - x[..., t, j + half] sin[t, j]
    y[..., t, j + half] = x[..., t, j + half] cos[t, j] + x[..., t, j] sin[t, j]

Element ``j`` pairs with ``j + half`` ("rotate_half"), as ``transformers``' ``apply_rotary_pos_emb``
does, not with its neighbour ``j + 1`` (the RoFormer paper's and Meta's original complex-number
layout): the two differ by a permutation of the rows of ``W_q``/``W_k``, and this layout is the one
whose weights load unchanged into ``LlamaForCausalLM``.

Why it encodes *relative* position: the rotation ``R(t)`` is orthogonal and ``R(p)ᵀ R(q) = R(q - p)``,
so a query at ``p`` and a key at ``q`` score ``⟨R(p) a, R(q) b⟩ = ⟨a, R(q - p) b⟩``: a function of
``q - p`` only (``tests/test_rope.py`` asserts it).

Backward: ``y = R x`` is linear, so ``dx = Rᵀ dy``, the rotation by ``-angle``: the forward with ``sin``
negated (``rope_backward``). The tables are constants (no gradient).

Storage of x fp32, fp16 or bf16 (float64 on the NumPy path), tables fp32; arithmetic fp32. ``x`` is
``[..., T, D]`` (the book model's ``[B, H, T, D]``), or with ``seq_axis`` naming another axis for the
positions, e.g. ``seq_axis=1`` for the fast model's token-major ``[B, T, H, D]`` (the layout its GEMMs write,
so no transposing copy is needed before attention); the tables may be longer than T (rows ``0 .. T - 1`` are
used), so a model builds them once for its longest sequence. ``out`` may be ``x`` itself: in place, what the
model does to Q and K.

Layouts: ``x`` and ``out`` each C-contiguous, or a *row view*: the last two axes (heads, head_dim) contiguous
and the leading ones stepping by one token stride ``ld >= heads · D`` elements, its own for each. That is how
the fast Llama step rotates q's and k's heads together, in place, inside its one fused q|k|v GEMM's output
``qkv [B·T, C + 2K]``: ``x = qkv.reshape(B, T, H + 2 Hk, D)[:, :, :H + Hk]``, ``out=x``, v's heads untouched.
Anything else is a ValueError; a new ``out`` is C-contiguous.

Non-finite input: the op is a 2x2 rotation of each pair in IEEE arithmetic, so a NaN in ``x[j]`` gives NaN
in ``y[j]`` and ``y[j + half]``; ±inf gives ±inf or NaN by IEEE rules (at position 0, ``sin = 0`` and
``inf · 0 = NaN``: an inf at ``j + half`` makes ``y[j]`` NaN), the same on both paths and as Hugging Face's
``q * cos + rotate_half(q) * sin``.

The tables are computed in float64 and rounded once to fp32. ``transformers`` computes ``t * inv_freq`` in
fp32, whose rounding grows with t (up to about ``t · 2⁻²⁴`` rad: ~1e-4 at t = 2048); the two tables
agree to that, far inside bf16's resolution.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_alias,
    check_array,
    check_float,
    check_gpu_dtype,
    check_method,
    check_out,
    is_integer,
    row_stride,
)
from ..kernels import get_kernel, loader
from ..kernels.launch import VECTOR_BYTES, is_aligned

THREADS = loader.constant("rope", "ROPE_THREADS")
# The GPU kernels: "optimized" (rope_rotate, one thread per pack of one head) or "fast" (rope_rotate_heads: one
# thread per pack of HEADS_PER_THREAD heads that share a position and so a cos/sin row; 16-byte packs, HPT
# dividing the heads per position, else "optimized"). ROPE_METHOD is what method=None runs.
METHODS = ("optimized", "fast")
ROPE_METHOD = "optimized"
HEADS_PER_THREAD = tuple(sorted({int(e.split(",")[-1].rstrip(">")) for e in loader.name_expressions("rope")
                                 if e.startswith("rope_rotate_heads<")}, reverse=True))  # (4, 2): the largest fits
TABLE_DTYPES = (backend.float32, backend.float64)  # float64 tables: NumPy path only (the FD checks)
LAYOUTS = ("C-contiguous, or a view whose last two axes (heads, head_dim) are contiguous and whose leading axes "
           "step by one token stride (e.g. qkv.reshape(B, T, H + 2 * Hk, D)[:, :, :H + Hk])")


def rope_tables(seq, head_dim, theta=10000.0, *, xp=None, dtype=backend.float32):
    """``(cos, sin)``, each ``[seq, head_dim / 2]`` fp32 on ``xp`` (NumPy or CuPy; default: the active
    backend): the cosine and sine of ``t * theta ** (-2 j / head_dim)`` for positions ``t < seq``.
    ``dtype=float64`` (NumPy only): unrounded tables, for the float64 reference model."""
    if np.dtype(dtype) not in TABLE_DTYPES:
        raise ValueError(f"RoPE tables are float32 (or float64 on NumPy), got {np.dtype(dtype)}")
    if not is_integer(seq) or seq < 1:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    _check_head_dim(head_dim)
    theta = check_float("theta", theta, low=0.0, low_open=True)
    half = head_dim // 2
    inv_freq = theta ** (-2.0 * np.arange(half, dtype=np.float64) / head_dim)
    angle = np.arange(seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    xp = backend.default_xp() if xp is None else xp
    return (backend.to_device(np.cos(angle).astype(dtype), xp),
            backend.to_device(np.sin(angle).astype(dtype), xp))


def _check_head_dim(head_dim):
    if not is_integer(head_dim) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even integer >= 2 (RoPE rotates pairs j, j + head_dim/2), "
                         f"got {head_dim!r}")


# --------------------------------------------------------------------------- NumPy reference


def rope_reference(x, cos, sin, inverse=False, seq_axis=-2):
    """The rotation on NumPy arrays ``x [..., T, D]`` (positions along ``seq_axis``; by ``-angle`` when
    ``inverse``), arithmetic in float32 (float64 for float64 x), returned in x's dtype."""
    if _seq_axis(x, seq_axis) != x.ndim - 2:
        return np.moveaxis(rope_reference(np.moveaxis(x, seq_axis, -2), cos, sin, inverse), -2, seq_axis)
    ct = np.float64 if x.dtype == backend.float64 else np.float32
    n_t, half = x.shape[-2], x.shape[-1] // 2
    c = cos[:n_t].astype(ct)
    s = sin[:n_t].astype(ct) * (ct(-1.0) if inverse else ct(1.0))
    x1, x2 = x[..., :half].astype(ct), x[..., half:].astype(ct)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 = NaN is the documented answer
        y = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- public API


def _seq_axis(x, seq_axis):
    """``seq_axis`` as a non-negative axis of x before the last (head_dim), or a ValueError."""
    if not is_integer(seq_axis) or not -x.ndim <= seq_axis < x.ndim - 1 or seq_axis == -1:
        raise ValueError(f"seq_axis must name an axis of x before the last (head_dim), -{x.ndim} .. {x.ndim - 2}, "
                         f"got {seq_axis!r}")
    return int(seq_axis) % x.ndim


def _rotate(x, cos, sin, out, inverse, name, seq_axis, method):
    method = ROPE_METHOD if method is None else method
    check_method("rope", method, METHODS)
    xp = array_module(**{name: x, "cos": cos, "sin": sin, "out": out})
    check_array(name, x, contiguous=False)
    if x.ndim < 2:
        raise ValueError(f"{name} must be at least 2-D ([..., T, head_dim], e.g. [B, H, T, D]), got shape "
                         f"{tuple(x.shape)}")
    axis = _seq_axis(x, seq_axis)
    n_t, d = x.shape[axis], x.shape[-1]
    if d % 2:
        raise ValueError(f"head_dim (the last axis of {name}) must be even: RoPE rotates pairs j, j + head_dim/2; "
                         f"got {d}")
    half = d // 2
    check_array("cos", cos, dtypes=TABLE_DTYPES)
    check_array("sin", sin, shape=tuple(cos.shape), dtypes=TABLE_DTYPES)
    if cos.ndim != 2 or cos.shape[1] != half or cos.shape[0] < n_t:
        raise ValueError(f"cos and sin must have shape [S, {half}] with S >= T = {n_t} (rope_tables(S, {d})), "
                         f"got {tuple(cos.shape)}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must share one dtype, got {cos.dtype} and {sin.dtype}")
    if out is not None:
        check_out(out, x.shape, x.dtype, xp, contiguous=False)
        check_alias("out", out, name, x)
    rows_layout = not (x.flags.c_contiguous and (out is None or out.flags.c_contiguous))
    if rows_layout:  # token strides in elements; a new out is contiguous
        ld_x = row_stride(name, x, 2, LAYOUTS)
        ld_y = x.shape[-2] * d if out is None else row_stride("out", out, 2, LAYOUTS)

    if xp is np:
        y = rope_reference(x, cos, sin, inverse, axis)
        if out is None:
            return y
        out[...] = y
        return out

    check_gpu_dtype(name, x)
    if cos.dtype != np.float32:
        raise TypeError(f"cos and sin must be fp32 on the GPU path, got {cos.dtype}")
    out = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    rows = x.size // d
    inner = int(np.prod(x.shape[axis + 1:-1], dtype=np.int64))  # rows that share one position
    width = VECTOR_BYTES // x.dtype.itemsize
    vec = half % width == 0 and is_aligned(VECTOR_BYTES, x, out, cos, sin)
    layout = (x.shape[-2], ld_x, ld_y) if rows_layout else (1, 0, 0)  # unused by the contiguous kernel
    vec = vec and all(ld % width == 0 for ld in layout[1:])  # every token's row starts on a pack
    hpt = next((h for h in HEADS_PER_THREAD if inner % h == 0 and (not rows_layout or x.shape[-2] % h == 0)), 0)
    if method == "fast" and vec and hpt:
        packs = rows // hpt * (half // width)
        kern = get_kernel("rope", "rope_rotate_heads", x.dtype, int(inverse), int(rows_layout), hpt)
    else:
        packs = rows * (half // width if vec else half)
        kern = get_kernel("rope", "rope_rotate", x.dtype, int(vec), int(inverse), int(rows_layout))
    kern((-(-packs // THREADS),), (THREADS,), (x, out, cos, sin, np.int64(rows), np.int32(n_t), np.int32(inner),
                                                np.int32(half), np.int32(layout[0]), np.int64(layout[1]),
                                                np.int64(layout[2])))
    return out


def rope_forward(x, cos, sin, *, out=None, seq_axis=-2, method=None):
    """``y = R(t) x`` for ``x [..., T, head_dim]`` (positions along ``seq_axis``: 1 for ``[B, T, H, D]``) and the
    tables of ``rope_tables``; shape and dtype of x, written into ``out`` when given (``out=x``: in place). ``x``
    and ``out`` may be row views of a wider buffer (module docstring). ``method`` ("optimized", "fast"; None:
    ``ROPE_METHOD``) picks the GPU kernel (the same arithmetic; NumPy runs the reference)."""
    return _rotate(x, cos, sin, out, False, "x", seq_axis, method)


def rope_backward(dy, cos, sin, *, out=None, seq_axis=-2, method=None):
    """``dx = R(t)ᵀ dy``, the rotation by ``-angle`` (RoPE is linear in x); ``out=dy`` for in place."""
    return _rotate(dy, cos, sin, out, True, "dy", seq_axis, method)


def check_rope_tables(tables, T, D, xp):
    """``tables`` as a checked ``(cos, sin)`` pair of C-contiguous ``[S >= T, D / 2]`` tables on ``xp`` (fp32; fp64
    too on NumPy), for a caller that takes them as one argument (``flash_attention_backward(..., rope=)``)."""
    if not isinstance(tables, (tuple, list)) or len(tables) != 2:
        raise TypeError(f"rope must be the (cos, sin) pair of rope_tables, got {type(tables).__name__}")
    cos, sin = tables
    array_module(**{"rope cos": cos, "rope sin": sin})
    if backend.get_array_module(cos) is not xp:
        raise TypeError("rope's tables must live on the same device as q")
    dtypes = TABLE_DTYPES if xp is np else (backend.float32,)
    check_array("rope cos", cos, dtypes=dtypes)
    check_array("rope sin", sin, shape=tuple(cos.shape), dtype=cos.dtype, dtypes=dtypes)
    if cos.ndim != 2 or cos.shape[1] != D // 2 or cos.shape[0] < T:
        raise ValueError(f"rope's tables must have shape [S, {D // 2}] with S >= T = {T} (rope_tables(S, {D})), "
                         f"got {tuple(cos.shape)}")
    return cos, sin


def rope_backward_heads(g, cos, sin):
    """RoPE's backward in place on a ``[B, n, T, D]`` gradient (positions along axis 2): as the token-major row view
    where g is one (``split_qkv``'s and ``heads_view``'s views of ``[B, T, ...]`` rows), else through a copy."""
    if g.flags.c_contiguous:
        rope_backward(g, cos, sin, out=g, seq_axis=2)
        return g
    B, n, T, D = g.shape
    it = g.itemsize
    if g.strides[3] == it and g.strides[1] == D * it and g.strides[0] == T * g.strides[2]:
        t = g.transpose(0, 2, 1, 3)  # [B, T, n, D]: the heads side by side in each token's row
        rope_backward(t, cos, sin, out=t, seq_axis=1)
        return g
    g[...] = rope_backward(g.copy(), cos, sin, seq_axis=2)
    return g


__all__ = ["METHODS", "ROPE_METHOD", "check_rope_tables", "rope_backward", "rope_backward_heads", "rope_forward",
           "rope_reference", "rope_tables"]
