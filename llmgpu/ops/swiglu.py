"""SwiGLU, the gated activation of Llama's MLP, forward and backward (``kernels/swiglu.cu``).

Llama's MLP is ``down(silu(gate(x)) * up(x))``: two projections of the same input, one passed through
SiLU and used as a gate on the other. This op is the elementwise middle::

    silu(a) = a * sigmoid(a) = a / (1 + exp(-a))
    h       = silu(gate) * up

With ``s = sigmoid(gate)``, ``d silu / da = s + a s (1 - s) = s (1 + a (1 - s))``, so::

    dgate = dh * up * s * (1 + gate * (1 - s))
    dup   = dh * silu(gate)

``gate`` and ``up`` share any shape and dtype; storage fp32, fp16 or bf16, arithmetic fp32 on the GPU (one
fused pass over 16-byte packs, a scalar fallback for unaligned pointers). NumPy arrays run the reference, in
float64 (float32's cancellation is not the point here; the reference is the spec the kernels are measured
against).

Layouts: every array C-contiguous (any shape), or 2-D ``[N, F]`` arrays that are each C-contiguous or a *row
view*: unit column stride and a row stride ``ld >= F`` elements of its own. That is how the fast Llama step
reads its one fused gate|up GEMM's output ``gu [N, 2F]``: ``gate = gu[:, :F]``, ``up = gu[:, F:]`` (ld = 2F),
and the backward writes ``dgate``, ``dup`` back over them. The kernels then address element ``e`` of a
``[N, F]`` array at ``(e / F) ld + e % F``; 16-byte packs need F and every ld to be multiples of the pack, else
the scalar path. Anything else (N-D views, a column stride other than 1, negative strides) is a ValueError.
Outputs the op allocates are C-contiguous.

Non-finite input, the same on both paths and as PyTorch's ``F.silu`` (``a / (1 + exp(-a))``, and its
backward ``s (1 + a (1 - s))``): NaN in ``gate``, ``up`` or ``dh`` gives NaN in every output it
reaches; ``silu(+inf) = +inf``; ``silu(-inf) = -inf / inf = NaN`` (the mathematical limit is 0; we
keep PyTorch's answer so that a model gives the same outputs); every finite ``a`` gives a finite
``silu(a)`` (``-0`` below ``a ≈ -88`` in fp32) and a finite derivative; ``silu'(±inf) = NaN``
(``inf · 0``), so ``dgate`` is NaN there. The products follow IEEE: ``silu(+inf) · 0 = NaN`` in ``h``,
``0 · inf`` likewise.

In place: ``out`` may be ``gate`` or ``up``; ``dgate`` and ``dup`` may each be any of the inputs (not
each other); a buffer that overlaps an input any other way is refused (``checks.overlaps``: ``gu[:, :F]`` and
``gu[:, F:]`` are apart, a shifted view is not).
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_alias,
    check_array,
    check_gpu_dtype,
    check_out,
    check_same_dtype,
    overlaps,
    row_stride,
)
from ..kernels import get_kernel, loader
from ..kernels.launch import VECTOR_BYTES, is_aligned

THREADS = loader.constant("swiglu", "SWIGLU_THREADS")  # the kernels' block
UNROLL = loader.constant("swiglu", "SWIGLU_UNROLL")  # 16-byte packs per thread and array


# --------------------------------------------------------------------------- NumPy reference


@np.errstate(over="ignore", invalid="ignore")  # exp(-a) overflows for a < ~-709; inf/inf is the documented NaN
def _silu_parts(a):
    """(silu(a), sigmoid(a), 1 - sigmoid(a)) in float64, the kernels' formulas."""
    e = np.exp(-a)
    d = 1.0 + e
    s = 1.0 / d
    return a / d, s, np.fmin(e * s, 1.0)  # 1 - s = e s; fmin: e = inf, s = 0 gives 1, as the kernel's fminf


def swiglu_forward_reference(gate, up):
    """h = silu(gate) * up, computed in float64, returned in gate's dtype."""
    a, u = gate.astype(np.float64), up.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return (_silu_parts(a)[0] * u).astype(gate.dtype)


def swiglu_backward_reference(dh, gate, up):
    """(dgate, dup), computed in float64, returned in gate's dtype."""
    a, u, d = gate.astype(np.float64), up.astype(np.float64), dh.astype(np.float64)
    silu, s, one_minus_s = _silu_parts(a)
    with np.errstate(invalid="ignore", over="ignore"):
        dgate = d * u * (s * (1.0 + a * one_minus_s))
        dup = d * silu
    return dgate.astype(gate.dtype), dup.astype(gate.dtype)


# --------------------------------------------------------------------------- public API


LAYOUTS = "C-contiguous, or a 2-D row view (unit column stride, row stride >= its columns, e.g. gu[:, :F])"


def _row_strides(arrays):
    """None when every array (name -> array, same shape) is C-contiguous: the flat kernels. Else each one's row
    stride in elements (the arrays must then be 2-D), or a ValueError naming the first that is neither."""
    if all(a.flags.c_contiguous for a in arrays.values()):
        return None
    for name, a in arrays.items():
        if a.ndim != 2:
            raise ValueError(f"{name} must be {LAYOUTS} when any array is not C-contiguous; got shape "
                             f"{tuple(a.shape)}, strides {tuple(a.strides)} (bytes)")
    return [row_stride(name, a, 1, LAYOUTS) for name, a in arrays.items()]


def _launch(name, arrays, lds):
    """One pass of kernel ``name`` over ``arrays`` (inputs then outputs, all of one shape); ``lds``: their row
    strides (ROWS = 1) or None (flat)."""
    first = arrays[0]
    n, cols = first.size, first.shape[-1]
    width = VECTOR_BYTES // first.dtype.itemsize
    vec = is_aligned(VECTOR_BYTES, *arrays)  # flat: the kernels handle the tail past the last pack
    if lds is not None:  # rows: a pack must not straddle two rows, and every row must start aligned
        vec = vec and cols % width == 0 and all(ld % width == 0 for ld in lds)
    packs = n // width if vec else n
    blocks = max(1, -(-packs // (THREADS * UNROLL)))  # one pass: every pack once
    strides = [np.int64(ld) for ld in lds or [n] * len(arrays)]  # unused by the flat kernels
    get_kernel("swiglu", name, first.dtype, int(vec), int(lds is not None))(
        (blocks,), (THREADS,), (*arrays, np.int64(n), np.int64(cols), *strides))


def swiglu_forward(gate, up, *, out=None):
    """h = silu(gate) * up, same shape and dtype as gate (written into ``out`` when given). Inputs and ``out``
    may be row views (module docstring); a new h is C-contiguous."""
    xp = array_module(gate=gate, up=up, out=out)
    check_array("gate", gate, contiguous=False)
    check_array("up", up, shape=tuple(gate.shape), contiguous=False)
    check_same_dtype(gate=gate, up=up)
    if out is not None:
        check_out(out, gate.shape, gate.dtype, xp, contiguous=False)
        check_alias("out", out, "gate", gate)
        check_alias("out", out, "up", up)
    lds = _row_strides({"gate": gate, "up": up, **({} if out is None else {"out": out})})
    if xp is np:
        h = swiglu_forward_reference(gate, up)
        if out is None:
            return h
        out[...] = h
        return out
    check_gpu_dtype("gate", gate)
    if out is None:
        out = xp.empty(gate.shape, dtype=gate.dtype)
        lds = None if lds is None else [*lds, gate.shape[-1]]
    _launch("swiglu_forward", (gate, up, out), lds)
    return out


def swiglu_backward(dh, gate, up, *, dgate=None, dup=None):
    """Gradients of ``h = silu(gate) * up``: returns ``(dgate, dup)``, shape and dtype of gate (written into
    the ``dgate`` / ``dup`` buffers when given: ``dgate=gate, dup=up`` overwrites ``gu`` in place). Any array
    may be a row view (module docstring); new gradients are C-contiguous."""
    xp = array_module(dh=dh, gate=gate, up=up, dgate=dgate, dup=dup)
    check_array("gate", gate, contiguous=False)
    check_array("up", up, shape=tuple(gate.shape), contiguous=False)
    check_array("dh", dh, shape=tuple(gate.shape), contiguous=False)
    check_same_dtype(dh=dh, gate=gate, up=up)
    for out_name, o in (("dgate", dgate), ("dup", dup)):
        if o is not None:
            check_out(o, gate.shape, gate.dtype, xp, name=out_name, contiguous=False)
            for in_name, a in (("dh", dh), ("gate", gate), ("up", up)):
                check_alias(out_name, o, in_name, a)
    if overlaps(dgate, dup):
        raise ValueError("dgate and dup must be separate buffers")
    given = {k: a for k, a in (("dh", dh), ("gate", gate), ("up", up), ("dgate", dgate), ("dup", dup))
             if a is not None}
    lds = _row_strides(given)
    if xp is np:
        grads = swiglu_backward_reference(dh, gate, up)
        result = []
        for o, g in zip((dgate, dup), grads):
            if o is not None:
                o[...] = g
                g = o
            result.append(g)
        return result[0], result[1]
    check_gpu_dtype("gate", gate)
    if lds is not None:
        ld_of = dict(zip(given, lds))
        lds = [ld_of.get(k, gate.shape[-1]) for k in ("dh", "gate", "up", "dgate", "dup")]  # new ones: contiguous
    dgate = xp.empty(gate.shape, dtype=gate.dtype) if dgate is None else dgate
    dup = xp.empty(gate.shape, dtype=gate.dtype) if dup is None else dup
    _launch("swiglu_backward", (dh, gate, up, dgate, dup), lds)
    return dgate, dup


def traffic_bytes(n, dtype, backward=False):
    """Minimum bytes: forward reads gate and up, writes h; backward reads dh, gate, up, writes dgate, dup."""
    return (5 if backward else 3) * n * backend.resolve_dtype(dtype).itemsize


__all__ = ["swiglu_backward", "swiglu_backward_reference", "swiglu_forward", "swiglu_forward_reference",
           "traffic_bytes"]
