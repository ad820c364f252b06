"""GELU, tanh approximation (GPT-2's), forward and backward (chapter 3, ``kernels/gelu.cu``)::

    u = sqrt(2/pi) * (x + 0.044715 x**3),   t = tanh(u)
    y = 0.5 x (1 + t)
    dy/dx = 0.5 (1 + t) + 0.5 x (1 - t**2) sqrt(2/pi) (1 + 3 * 0.044715 x**2)

The same as PyTorch's ``F.gelu(x, approximate='tanh')``. Elementwise on any shape (contiguous);
storage fp32, fp16 or bf16, arithmetic fp32. ``method``: ``"naive"`` (one thread per element, scalar),
``"optimized"`` (grid-stride over 16-byte packs, expf and an IEEE division) or ``"fast"`` (one pass, two
16-byte packs per thread, the same sigmoid form with the hardware ex2/rcp approximations: ~10
instructions per element instead of ~29, what 16-bit storage needs to stay memory-bound; the default,
97-101 % of the copy bandwidth on the H200 in bf16 and fp32). NumPy arrays run the reference.

Non-finite input, the same for every method and the reference (and PyTorch's tanh GELU): NaN in
gives NaN out (forward and backward, x or dy); ``GELU(+inf) = +inf``, ``GELU(-inf) = NaN`` (the
formula's ``-inf · 0``); ``GELU'(±inf) = NaN`` (``inf · 0`` in its second term), so ``dx`` is NaN
there. Every finite x gives a finite ``GELU'(x)`` (0 or 1 at the saturated ends).
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_gpu_dtype, check_method, check_out, check_same_dtype
from ..kernels import get_kernel, loader
from ..kernels.launch import VECTOR_BYTES, is_aligned, stride_grid

METHODS = ("naive", "optimized", "fast")
SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
CUBIC = loader.constant("gelu", "GELU_CUBIC")  # the tanh approximation's, as the kernels use it
THREADS = 256
FAST_THREADS = loader.constant("gelu", "GELU_FAST_THREADS")  # the fast kernels' block
FAST_UNROLL = loader.constant("gelu", "GELU_FAST_UNROLL")  # packs per thread in the fast kernels


def _compute_dtype(dtype):
    # float64 always: 1 + tanh(u) cancels for negative x, and in float32 that costs GELU's small
    # outputs up to ~1e-4 of relative accuracy (the kernel avoids it with the sigmoid form).
    return np.float64


@np.errstate(invalid="ignore", over="ignore")  # non-finite x: NaN/inf is the documented answer
def gelu_forward_reference(x):
    ct = _compute_dtype(x.dtype)
    xf = x.astype(ct)
    t = np.tanh(ct(SQRT_2_OVER_PI) * (xf + ct(CUBIC) * xf**3))
    return (ct(0.5) * xf * (ct(1.0) + t)).astype(x.dtype)


@np.errstate(invalid="ignore", over="ignore")
def gelu_backward_reference(dy, x):
    ct = _compute_dtype(x.dtype)
    xf = x.astype(ct)
    t = np.tanh(ct(SQRT_2_OVER_PI) * (xf + ct(CUBIC) * xf**3))
    grad = ct(0.5) * (ct(1.0) + t) + ct(0.5) * xf * (ct(1.0) - t * t) * ct(SQRT_2_OVER_PI) * (
        ct(1.0) + ct(3.0 * CUBIC) * xf * xf
    )
    return (dy.astype(ct) * grad).astype(x.dtype)


def _launch(xp, n, arrays, dtype, method, name, args):
    if method == "naive":
        get_kernel("gelu", f"{name}_naive", dtype)((-(-n // THREADS),), (THREADS,), args)
        return
    width = VECTOR_BYTES // np.dtype(dtype).itemsize
    vec = is_aligned(VECTOR_BYTES, *arrays)  # the kernels handle the tail past the last pack
    if method == "fast":  # one pass: enough blocks to cover every pack once
        packs = n // width if vec else n
        blocks = max(1, -(-packs // (FAST_THREADS * FAST_UNROLL)))
        get_kernel("gelu", f"{name}_fast", dtype, int(vec))((blocks,), (FAST_THREADS,), args)
        return
    packs = n // width if vec else n
    blocks = stride_grid(packs, THREADS, xp)  # a grid-stride loop: enough blocks to fill the GPU
    get_kernel("gelu", name, dtype, int(vec))((blocks,), (THREADS,), args)


def gelu_forward(x, *, out=None, method="fast"):
    """y = GELU(x) (tanh approximation), same shape and dtype as x."""
    check_method("gelu_forward", method, METHODS)
    xp = array_module(x=x, out=out)
    check_array("x", x)
    if xp is np:
        y = gelu_forward_reference(x)
        if out is None:
            return y
        check_out(out, x.shape, x.dtype, xp)[...] = y
        return out
    check_gpu_dtype("x", x)
    out = check_out(out, x.shape, x.dtype, xp)
    _launch(xp, x.size, (x, out), x.dtype, method, "gelu_forward", (x, out, np.int64(x.size)))
    return out


def gelu_backward(dy, x, *, out=None, method="fast"):
    """dx = dy * GELU'(x), same shape and dtype as x."""
    check_method("gelu_backward", method, METHODS)
    xp = array_module(dy=dy, x=x, out=out)
    check_array("x", x)
    check_array("dy", dy, shape=tuple(x.shape))
    check_same_dtype(dy=dy, x=x)
    if xp is np:
        dx = gelu_backward_reference(dy, x)
        if out is None:
            return dx
        check_out(out, x.shape, x.dtype, xp)[...] = dx
        return out
    check_gpu_dtype("x", x)
    out = check_out(out, x.shape, x.dtype, xp)
    _launch(xp, x.size, (dy, x, out), x.dtype, method, "gelu_backward",
            (dy, x, out, np.int64(x.size)))
    return out


def traffic_bytes(n, dtype, backward=False):
    """Minimum bytes: forward reads x, writes y; backward reads dy and x, writes dx."""
    s = backend.resolve_dtype(dtype).itemsize
    return (3 if backward else 2) * n * s


__all__ = ["METHODS", "gelu_backward", "gelu_backward_reference", "gelu_forward", "gelu_forward_reference",
           "traffic_bytes"]
