"""Checking kernels: float64 finite differences, GPU-vs-reference comparison, poisoned outputs.

Two rules every test in the project follows (and the book's correctness cells too):

* A gradient is checked against central finite differences in float64, where rounding is small
  enough that a wrong formula cannot hide in the noise.
* A GPU kernel is checked against the NumPy reference on fresh random inputs (never zeros), with
  its output buffer poisoned (NaN) first, so an element the kernel forgot to write fails loudly.
  The error measure is ``‖out − ref‖ / ‖ref‖``, with a threshold per dtype; NaN never passes.
"""

from __future__ import annotations

import numpy as np

from . import backend

# Relative error allowed for a kernel's output against a float64 reference, by storage dtype.
# fp32 arithmetic lands far below 1e-5; bf16 has 8 bits of mantissa (2^-8 ≈ 4e-3 per rounding).
TOLERANCE = {
    backend.float64: 1e-12,
    backend.float32: 1e-5,
    backend.float16: 5e-3,
    backend.bfloat16: 2e-2,
}


def tolerance(dtype) -> float:
    return TOLERANCE[backend.resolve_dtype(dtype)]


def rel_error(out, ref, scale=None) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NumPy or CuPy arrays); inf when out has NaN/inf.

    ``scale`` replaces ‖ref‖ in the denominator for outputs that are differences of larger terms
    (softmax backward's ``dp − Σ p⊙dp`` when one probability is ≈ 1, AdamW's moments): rounding
    error is proportional to the terms, so that is the size to measure it against.
    """
    out = backend.to_numpy(out).astype(np.float64)
    ref = backend.to_numpy(ref).astype(np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: out {out.shape} vs reference {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref.ravel()) if scale is None else float(scale)
    num = np.linalg.norm((out - ref).ravel())
    if denom == 0.0:
        return float(num)
    return float(num / denom)


def assert_close(out, ref, dtype=None, rtol=None, name="output", scale=None):
    """Fail unless rel_error(out, ref, scale) <= rtol (default: TOLERANCE of ``dtype`` or out's dtype)."""
    if rtol is None:
        rtol = tolerance(dtype if dtype is not None else out.dtype)
    err = rel_error(out, ref, scale)
    if not err <= rtol:  # also catches NaN
        n_bad = int(np.sum(~np.isfinite(backend.to_numpy(out).astype(np.float64))))
        extra = f" ({n_bad} non-finite elements: unwritten output?)" if n_bad else ""
        raise AssertionError(f"{name}: relative error {err:.3e} > {rtol:.1e}{extra}")
    return err


def random_array(rng: np.random.Generator, shape, dtype=np.float32, xp=np, scale=1.0):
    """Standard-normal values (times ``scale``) in ``dtype`` on the backend ``xp``."""
    a = (rng.standard_normal(shape) * scale).astype(backend.resolve_dtype(dtype))
    return backend.to_device(a, xp)


def poisoned(shape, dtype, xp):
    """An array full of NaN: pass it as a kernel's ``out`` to see every element it fails to write."""
    return xp.full(shape, np.nan, dtype=backend.resolve_dtype(dtype))


def numerical_gradient(f, x: np.ndarray, eps: float = 1e-6, indices=None) -> np.ndarray:
    """Central differences of the scalar function ``f`` at ``x`` (float64), optionally at a subset.

    ``f`` is called with ``x`` modified in place, one coordinate at a time; ``indices`` (an iterable of
    flat indices) limits the work for large tensors. Returns an array shaped like x (zeros where not
    evaluated) and the evaluated flat indices.
    """
    if x.dtype != np.float64:
        raise TypeError(f"finite differences need float64 input, got {x.dtype}")
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    idx = range(flat.size) if indices is None else indices
    for i in idx:
        old = flat[i]
        flat[i] = old + eps
        fp = float(f())
        flat[i] = old - eps
        fm = float(f())
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return grad


def check_gradient(f, x: np.ndarray, analytic: np.ndarray, *, eps=1e-6, rtol=1e-6, n_samples=None, seed=0,
                   name="gradient"):
    """Compare an analytic gradient of scalar ``f`` w.r.t. ``x`` with central differences (float64).

    ``n_samples`` checks that many random coordinates instead of all. Returns the relative error on
    the checked coordinates and raises AssertionError above ``rtol``.
    """
    if analytic.shape != x.shape:
        raise AssertionError(f"{name}: analytic gradient shape {analytic.shape} != input shape {x.shape}")
    idx = None
    if n_samples is not None and n_samples < x.size:
        idx = np.random.default_rng(seed).choice(x.size, size=n_samples, replace=False)
    num = numerical_gradient(f, x, eps=eps, indices=idx)
    sel = slice(None) if idx is None else idx
    a, n = np.asarray(analytic, dtype=np.float64).reshape(-1)[sel], num.reshape(-1)[sel]
    err = np.linalg.norm(a - n) / max(np.linalg.norm(n), 1e-300)
    if not err <= rtol:
        raise AssertionError(f"{name}: relative error vs finite differences {err:.3e} > {rtol:.1e}")
    return float(err)
