"""Global-norm gradient clipping without a host synchronisation.

Clipping by the global norm rescales every gradient by ``min(1, max_norm / (‖g‖ + ε))`` (``clip_coefficient``,
ε = ``CLIP_EPS``, 1e-6), where ‖g‖ is the L2 norm over *all* parameters. The textbook code reads the norm on the host
(``if norm > max_norm: ...``), which stalls the CPU until the GPU has finished the backward pass:
the next step's kernels cannot be queued in the meantime and the GPU idles while Python catches up.
Here the norm and the clip coefficient never leave the device: the kernel writes a 0-d array that
AdamW reads as its ``grad_scale``, and the norm is read for logging *after* the step (or every k
steps).

One launch (``kernels/grad_norm.cu``): per-block partial sums of squares, then the last block sums
the partials in a fixed order (fp64), so the result is bit-identical run to run; the same pass flags
inf/nan (``found_inf``, used by the fp16 loss scaler) and can fold in the loss-scale unscaling
(``prescale`` = 1/scale).

The kernel keeps its partials and ticket counter in a per-device workspace: launches on one stream
are fine; do not run two norm launches concurrently on different streams.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..checks import GPU_DTYPES, array_module, check_array
from ..kernels import loader

THREADS = loader.constant("grad_norm", "GN_THREADS")  # the kernel's block
CLIP_EPS = loader.constant("grad_norm", "GN_CLIP_EPS")  # keeps the clip coefficient finite at a zero norm
MAX_BLOCKS = 1024  # fixed cap: the grid (hence the summation order) depends only on n
_F32 = backend.float32


def clip_coefficient(norm, max_norm: float):
    """``min(1, max_norm / (norm + CLIP_EPS))``: the factor global-norm clipping multiplies the gradient by.

    ``norm``: a NumPy or CuPy array (0-d: a device scalar) or a number; the result is fp32 on the same device,
    element-wise, computed there (no host sync), in fp32 exactly as ``kernels/grad_norm.cu`` computes it
    (``fminf``: a nan norm gives 1; such a step is skipped anyway, its ``found_inf`` is set). ``max_norm`` > 0.
    """
    xp = backend.cupy_module() if backend.is_gpu_array(norm) else np
    norm = xp.asarray(norm, dtype=_F32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return xp.fmin(np.float32(1.0), np.float32(max_norm) / (norm + np.float32(CLIP_EPS)))


@dataclass
class GradNorm:
    """Outputs of one fused norm launch, all 0-d fp32 arrays on the gradient's device.

    ``norm``: ‖g‖ (of the unscaled gradient when a prescale was given); ``scale``: the factor to pass
    to AdamW as ``grad_scale`` (prescale × clip coefficient); ``found_inf``: 1.0 when any element was
    inf or nan, else 0.0.
    """

    norm: object
    scale: object
    found_inf: object


@functools.cache
def _workspace(device_id: int):
    cp = backend.require_gpu()
    with cp.cuda.Device(device_id):
        return (cp.zeros(MAX_BLOCKS, dtype=np.float32), cp.zeros(MAX_BLOCKS, dtype=np.uint32),
                cp.zeros(1, dtype=np.uint32))


def _check_grad(grad, xp):
    check_array("grad", grad, ndim=1, dtypes=GPU_DTYPES)


def _check_scalar(name, x, xp):
    if backend.get_array_module(x) is not xp:
        raise TypeError(f"{name} must live on the same device as grad")
    if x.size != 1 or x.dtype != _F32:
        raise TypeError(f"{name} must be a 0-d fp32 array, got shape {tuple(x.shape)} dtype {x.dtype}")


def _check_out(name, x, xp):
    _check_scalar(name, x, xp)
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")


def grad_norm_fused(grad, max_norm: float = 0.0, *, prescale=None, out: GradNorm | None = None) -> GradNorm:
    """Norm, clip factor and inf/nan flag of a flat gradient in one pass (one kernel launch on CuPy).

    ``grad``: 1-D fp32/fp16/bf16 (NumPy or CuPy). ``max_norm`` <= 0 disables clipping (scale =
    prescale). ``prescale``: optional 0-d fp32 array (the loss scaler's 1/scale) multiplied into the
    norm and the scale. ``out``: a GradNorm of preallocated 0-d fp32 arrays to write into (needed
    for CUDA-graph capture, where nothing may be allocated).
    """
    xp = array_module(grad=grad, prescale=prescale)
    _check_grad(grad, xp)
    if prescale is not None:
        _check_scalar("prescale", prescale, xp)
    if out is None:
        out = GradNorm(xp.empty((), _F32), xp.empty((), _F32), xp.empty((), _F32))
    else:
        for name in ("norm", "scale", "found_inf"):
            _check_out(f"out.{name}", getattr(out, name), xp)
    max_norm = float(max_norm)

    if xp is np:
        g = grad.astype(np.float64)
        pre = float(prescale.reshape(())) if prescale is not None else 1.0
        bad = not np.all(np.isfinite(g))
        with np.errstate(over="ignore", invalid="ignore"):
            norm = np.float32(np.sqrt(np.sum(g * g)) * pre)
        coef = clip_coefficient(norm, max_norm) if max_norm > 0 else np.float32(1.0)
        out.norm[...] = norm
        out.scale[...] = np.float32(pre) * coef
        out.found_inf[...] = np.float32(1.0 if bad else 0.0)
        return out

    from ..kernels import get_kernel
    from ..kernels.launch import elements_aligned

    cp = xp
    n = grad.size
    vec = int(elements_aligned(4, grad))  # chunks of 4 elements
    chunks = n // 4 if vec else n
    blocks = max(1, min(-(-max(chunks, 1) // (4 * THREADS)), MAX_BLOCKS))  # 4 chunks per thread and pass
    partial_sq, partial_bad, done = _workspace(cp.cuda.Device().id)
    kern = get_kernel("grad_norm", "grad_norm_kernel", grad.dtype)
    kern(
        (blocks,), (THREADS,),
        (grad, np.int64(n), np.int32(vec), partial_sq, partial_bad, done,
         prescale if prescale is not None else out.norm, np.int32(prescale is not None), np.float32(max_norm),
         out.norm, out.scale, out.found_inf),
    )
    return out


def global_grad_norm(grad_flat, *, prescale=None, out=None):
    """‖grad_flat‖₂ as a 0-d fp32 array on the gradient's device; deterministic, no host sync.

    NumPy: the sum of squares in float64. CuPy: one launch of the two-stage kernel (fp32 partials
    per block, fixed-order fp64 final sum). ``out``: optional 0-d fp32 array to write into.
    """
    xp = array_module(grad_flat=grad_flat, out=out)
    if out is not None:
        _check_out("out", out, xp)
        res = GradNorm(out, xp.empty((), _F32), xp.empty((), _F32))
    else:
        res = None
    return grad_norm_fused(grad_flat, 0.0, prescale=prescale, out=res).norm


def clip_scale(norm, max_norm: float, *, prescale=None):
    """``clip_coefficient(norm, max_norm)`` (× ``prescale``) as a 0-d fp32 array on norm's device (no host sync),
    with its arguments checked: the ``grad_scale`` to pass AdamW.

    ``grad_norm_fused`` computes the same factor inside the norm kernel; this is the standalone
    version (a few tiny element-wise launches on CuPy).
    """
    xp = array_module(norm=norm, prescale=prescale)
    _check_scalar("norm", norm, xp)
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    coef = clip_coefficient(norm, max_norm)
    if prescale is not None:
        _check_scalar("prescale", prescale, xp)
        coef = (coef * prescale.reshape(())).astype(_F32)
    return coef.reshape(())


class GradClipper:
    """Preallocated outputs for the fused norm/clip/inf-check, reused every step (graph-capturable).

    ``clipper(grad, prescale=None)`` → GradNorm with ``.norm``, ``.scale`` (pass to
    ``AdamW.step(grad_scale=...)``) and ``.found_inf`` (pass as ``found_inf=`` when loss scaling).
    ``max_norm`` <= 0 or None computes the norm without clipping.
    """

    def __init__(self, max_norm: float | None = 1.0, *, xp=None):
        self.xp = xp or backend.default_xp()
        self.max_norm = float(max_norm) if max_norm else 0.0
        self._buf = self.xp.zeros(3, dtype=_F32)
        # 0-d views into one buffer (a slice + reshape is a view in NumPy and CuPy; a[0] is not)
        self.result = GradNorm(*(self._buf[i : i + 1].reshape(()) for i in range(3)))

    def __call__(self, grad, *, prescale=None) -> GradNorm:
        return grad_norm_fused(grad, self.max_norm, prescale=prescale, out=self.result)

    def last_norm(self) -> float:
        """The norm of the last call, read on the host (a sync: call it after the step)."""
        return float(backend.to_numpy(self.result.norm))
