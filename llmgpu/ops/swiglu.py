"""SwiGLU, the gated activation of Llama's MLP, forward and backward (``kernels/swiglu.cu``).

Llama's MLP is ``down(silu(gate(x)) * up(x))``: two projections of the same input, one passed through
SiLU and used as a gate on the other. This op is the elementwise middle::

    silu(a) = a * sigmoid(a) = a / (1 + exp(-a))
    h       = silu(gate) * up

With ``s = sigmoid(gate)``, ``d silu / da = s + a s (1 - s) = s (1 + a (1 - s))``, so::

    dgate = dh * up * s * (1 + gate * (1 - s))
    dup   = dh * silu(gate)

``gate`` and ``up`` share any shape (contiguous) and dtype; storage fp32, fp16 or bf16, arithmetic fp32
on the GPU (one fused pass over 16-byte packs, a scalar fallback for unaligned pointers). NumPy
arrays run the reference, in float64 (float32's cancellation is not the point here; the reference
is the spec the kernels are measured against).

Non-finite input, the same on both paths and as PyTorch's ``F.silu`` (``a / (1 + exp(-a))``, and its
backward ``s (1 + a (1 - s))``): NaN in ``gate``, ``up`` or ``dh`` gives NaN in every output it
reaches; ``silu(+inf) = +inf``; ``silu(-inf) = -inf / inf = NaN`` (the mathematical limit is 0; we
keep PyTorch's answer so that a model gives the same outputs); every finite ``a`` gives a finite
``silu(a)`` (``-0`` below ``a ≈ -88`` in fp32) and a finite derivative; ``silu'(±inf) = NaN``
(``inf · 0``), so ``dgate`` is NaN there. The products follow IEEE: ``silu(+inf) · 0 = NaN`` in ``h``,
``0 · inf`` likewise.

In place: ``out`` may be ``gate`` or ``up``; ``dgate`` and ``dup`` may each be any of the inputs (not
each other); a buffer that overlaps an input any other way is refused.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import array_module, check_alias, check_array, check_gpu_dtype, check_out, check_same_dtype, overlaps
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


def _launch(name, n, arrays, dtype, args):
    width = VECTOR_BYTES // np.dtype(dtype).itemsize
    vec = is_aligned(VECTOR_BYTES, *arrays)  # the kernels handle the tail past the last pack
    packs = n // width if vec else n
    blocks = max(1, -(-packs // (THREADS * UNROLL)))  # one pass: every pack once
    get_kernel("swiglu", name, dtype, int(vec))((blocks,), (THREADS,), args)


def swiglu_forward(gate, up, *, out=None):
    """h = silu(gate) * up, same shape and dtype as gate (written into ``out`` when given)."""
    xp = array_module(gate=gate, up=up, out=out)
    check_array("gate", gate)
    check_array("up", up, shape=tuple(gate.shape))
    check_same_dtype(gate=gate, up=up)
    if out is not None:
        check_out(out, gate.shape, gate.dtype, xp)
        check_alias("out", out, "gate", gate)
        check_alias("out", out, "up", up)
    if xp is np:
        h = swiglu_forward_reference(gate, up)
        if out is None:
            return h
        out[...] = h
        return out
    check_gpu_dtype("gate", gate)
    out = xp.empty(gate.shape, dtype=gate.dtype) if out is None else out
    _launch("swiglu_forward", gate.size, (gate, up, out), gate.dtype, (gate, up, out, np.int64(gate.size)))
    return out


def swiglu_backward(dh, gate, up, *, dgate=None, dup=None):
    """Gradients of ``h = silu(gate) * up``: returns ``(dgate, dup)``, shape and dtype of gate (written into
    the ``dgate`` / ``dup`` buffers when given)."""
    xp = array_module(dh=dh, gate=gate, up=up, dgate=dgate, dup=dup)
    check_array("gate", gate)
    check_array("up", up, shape=tuple(gate.shape))
    check_array("dh", dh, shape=tuple(gate.shape))
    check_same_dtype(dh=dh, gate=gate, up=up)
    for out_name, o in (("dgate", dgate), ("dup", dup)):
        if o is not None:
            check_out(o, gate.shape, gate.dtype, xp, name=out_name)
            for in_name, a in (("dh", dh), ("gate", gate), ("up", up)):
                check_alias(out_name, o, in_name, a)
    if overlaps(dgate, dup):
        raise ValueError("dgate and dup must be separate buffers")
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
    dgate = xp.empty(gate.shape, dtype=gate.dtype) if dgate is None else dgate
    dup = xp.empty(gate.shape, dtype=gate.dtype) if dup is None else dup
    _launch("swiglu_backward", gate.size, (dh, gate, up, dgate, dup), gate.dtype,
            (dh, gate, up, dgate, dup, np.int64(gate.size)))
    return dgate, dup


def traffic_bytes(n, dtype, backward=False):
    """Minimum bytes: forward reads gate and up, writes h; backward reads dh, gate, up, writes dgate, dup."""
    return (5 if backward else 3) * n * backend.resolve_dtype(dtype).itemsize


__all__ = ["swiglu_backward", "swiglu_backward_reference", "swiglu_forward", "swiglu_forward_reference",
           "traffic_bytes"]
