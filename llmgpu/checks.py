"""Argument checks shared by every op: clear errors before a kernel can read out of bounds.

A kernel trusts its pointers and sizes. Everything it cannot check (shape, dtype, contiguity,
which device the array lives on) is checked here, naming the argument, so bad input raises a
ValueError/TypeError in Python instead of a wrong answer or a crash inside CUDA. Also here: the
``method`` and GPU-dtype checks every op makes, and the import of optional dependencies (cuBLASLt's
nvmath-python, cuDNN's frontend) with a reason that says what to install.
"""

from __future__ import annotations

import importlib

import numpy as np

from . import backend

FLOAT_DTYPES = (backend.float32, backend.float16, backend.bfloat16, backend.float64)
GPU_DTYPES = (backend.float32, backend.float16, backend.bfloat16)  # storage types the CUDA kernels take


def array_module(**arrays):
    """NumPy or CuPy for the named arrays (None entries skipped); a mix raises TypeError."""
    names = list(arrays)
    for n, a in arrays.items():
        if a is not None and not (isinstance(a, np.ndarray) or backend.is_gpu_array(a)):
            raise TypeError(f"{n} must be a NumPy or CuPy array, got {type(a).__name__}")
    return backend.get_array_module(*arrays.values(), names=names)


def check_array(name, a, *, ndim=None, shape=None, dtype=None, dtypes=FLOAT_DTYPES, contiguous=True):
    """Validate one array. ``shape`` may hold None for 'any size' along an axis."""
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    if dtype is not None and a.dtype != backend.resolve_dtype(dtype):
        raise TypeError(f"{name} must be {backend.dtype_name(dtype)}, got {a.dtype}")
    if dtypes is not None and a.dtype not in dtypes:
        allowed = ", ".join(backend.dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {a.dtype}; supported: {allowed}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (row-major); call .copy() or xp.ascontiguousarray first")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {tuple(a.shape)})")
    return a


def check_float(name, value, *, low=None, high=None, low_open=False, high_open=False, where=None):
    """``value`` must be a finite real number (a bool or a string is a TypeError) within ``[low, high]``
    (``low_open``/``high_open``: that end excluded); returns it as a float. NaN fails every range, so
    a NaN learning rate is refused here instead of turning every weight into NaN."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{prefix}{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    ok = np.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        rng = " and ".join(x for x in (lo, hi) if x)
        raise ValueError(f"{prefix}{name} must be finite" + (f" and {rng}" if rng else "") + f", got {value!r}")
    return v


def check_choice(name, value, choices, *, where=None):
    """``value`` must be one of ``choices``; ``where`` (an op's name) starts the message."""
    if value not in choices:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}{name} must be one of {choices}, got {value!r}")
    return value


def check_method(op, method, methods):
    """An op's ``method`` argument must be one of ``methods``; the error names the op."""
    return check_choice("method", method, methods, where=op)


def check_gpu_dtype(name, a, dtypes=GPU_DTYPES, *, hint=None):
    """The storage dtype of ``a`` (an array, or a dtype) must be one of ``dtypes``, those the GPU path
    takes; ``hint`` (where the other dtypes run) ends the message."""
    dtype = backend.resolve_dtype(a) if isinstance(a, (np.dtype, str, type)) else a.dtype
    if dtype not in dtypes:
        allowed = ", ".join(backend.dtype_name(d) for d in dtypes)
        if hint is None and dtype == backend.float64:
            hint = "float64 runs on the NumPy path only"
        raise TypeError(f"{name} has dtype {dtype}; the GPU path supports {allowed}" + (f" ({hint})" if hint else ""))
    return a


def reference_dtype(*dtypes):
    """Arithmetic type of the NumPy references (a scalar type, callable on constants): float64 when
    any input is float64, else float32."""
    return np.float64 if any(np.dtype(d) == backend.float64 for d in dtypes) else np.float32


def check_same_dtype(**arrays):
    dts = {n: a.dtype for n, a in arrays.items() if a is not None}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n}={backend.dtype_name(d)}" for n, d in dts.items())
        raise TypeError(f"dtypes must match: {desc}")


def check_out(out, shape, dtype, xp, name="out"):
    """Validate a caller-provided output buffer, or allocate one."""
    if out is None:
        return xp.empty(shape, dtype=dtype)
    if backend.get_array_module(out) is not xp:
        raise TypeError(f"{name} must live on the same device as the inputs")
    check_array(name, out, shape=tuple(shape), dtype=dtype)
    return out


# --------------------------------------------------------------------------- optional dependencies


def optional_import(module, package, hint):
    """``(module, None)``, or ``(None, reason)`` when ``module`` cannot be imported: one line naming
    ``package`` and what to do (``hint``, e.g. which extra to install). Never raises."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:
        return None, f"{package} is not installed ({e}); {hint}"
    except Exception as e:  # a broken CUDA install can raise anything at import
        return None, f"{package} failed to import ({type(e).__name__}: {e}); {hint}"


def gpu_path_unavailable_reason(importer):
    """Why an optional GPU path cannot run here (no GPU, or ``importer()`` found no module), or None.
    ``importer`` returns ``optional_import``'s pair; it is called only when a GPU is there."""
    return backend.gpu_unavailable_reason() or importer()[1]


def require_module(importer, error):
    """The module ``importer()`` returns, or ``error(reason)`` raised."""
    module, reason = importer()
    if module is None:
        raise error(reason)
    return module
