"""Argument checks shared by every op: clear errors before a kernel can read out of bounds.

A kernel trusts its pointers and sizes. Everything it cannot check (shape, dtype, contiguity,
which device the array lives on) is checked here, naming the argument, so bad input raises a
ValueError/TypeError in Python instead of a wrong answer or a crash inside CUDA. Also here: the
``method`` and GPU-dtype checks every op makes, the types of a configuration's fields and of token ids
(integers are never rounded), and the import of optional dependencies (cuBLASLt's nvmath-python, cuDNN's
frontend) with a reason that says what to install.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import fields

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


def check_bool(name, value):
    """``value`` must be True or False (a string such as "no" would read as True): a TypeError otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


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


def check_out(out, shape, dtype, xp, name="out", contiguous=True):
    """Validate a caller-provided output buffer, or allocate one (``contiguous=False``: the op checks the layout)."""
    if out is None:
        return xp.empty(shape, dtype=dtype)
    if backend.get_array_module(out) is not xp:
        raise TypeError(f"{name} must live on the same device as the inputs")
    check_array(name, out, shape=tuple(shape), dtype=dtype, contiguous=contiguous)
    return out


def check_row_stats(name, a, x, n_rows):
    """A statistic per row that a norm's forward saved (LayerNorm's mean and rstd, RMSNorm's inv_rms): fp32 or
    fp64, of shape ``x.shape[:-1]`` or ``(n_rows,)``."""
    check_array(name, a, dtypes=(backend.float32, backend.float64))
    shapes = list(dict.fromkeys([tuple(x.shape[:-1]), (n_rows,)]))
    if tuple(a.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(a.shape)}")


def check_param_grad_dtype(name, out, param_name, param):
    """A parameter gradient's buffer holds the parameter's dtype or fp32 (an fp32 sum of 16-bit parameters)."""
    if out is not None and out.dtype not in (param.dtype, np.dtype(np.float32)):
        also = "" if param.dtype == np.float32 else " or fp32"
        raise TypeError(f"{name} must be {backend.dtype_name(param.dtype)} ({param_name}'s dtype){also}, "
                        f"got {out.dtype}")


def _address(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def row_stride(name, a, row_axes, accepted):
    """The step, in elements, from one row of ``a`` to the next, a row being its last ``row_axes`` axes: those must be
    C-contiguous together, and the leading axes must step through memory by one stride ld >= the row's size (rows of a
    wider array, e.g. ``gu[:, :F]`` of ``gu [N, 2F]``: ld = 2F). A C-contiguous array gives ld = its row's size.
    Else a ValueError, ``{name} must be {accepted}``."""
    it = a.itemsize
    inner = list(zip(a.shape, a.strides))[max(a.ndim - row_axes, 0):]
    lead = [(n, s) for n, s in list(zip(a.shape, a.strides))[:max(a.ndim - row_axes, 0)] if n > 1]  # size 1: no step
    row = it
    ok = a.ndim >= row_axes
    for n, s in reversed(inner):
        ok = ok and (n == 1 or s == row)
        row *= n
    ld = lead[-1][1] if lead else row  # bytes
    ok = ok and ld % it == 0 and ld >= row  # a negative, zero or too short stride: rows that overlap or run backwards
    ok = ok and all(s == s_next * n_next for (_, s), (n_next, s_next) in zip(lead, lead[1:]))
    if not ok:
        raise ValueError(f"{name} must be {accepted}; got shape {tuple(a.shape)}, strides {tuple(a.strides)} (bytes)")
    return ld // it


def _extent(a):
    """[first byte, one past the last byte] that ``a`` spans, for any strides."""
    lo = hi = _address(a)
    for n, s in zip(a.shape, a.strides):
        lo, hi = lo + min(0, (n - 1) * s), hi + max(0, (n - 1) * s)
    return lo, hi + a.itemsize


def _blocks(a):
    """``(width, steps)``: the bytes of ``a``'s innermost C-contiguous run of axes (a whole row), and the absolute
    strides of the axes above it (size-1 axes dropped)."""
    axes = [(n, s) for n, s in zip(a.shape, a.strides) if n > 1]
    width = a.itemsize
    while axes and axes[-1][1] == width:
        width *= axes.pop()[0]
    return width, [abs(s) for _, s in axes]


def overlaps(u, v) -> bool:
    """Whether two arrays may share a byte (None shares nothing). Contiguous arrays: their byte ranges. Strided
    views: with P the gcd of both arrays' outer strides, each array lies inside ``start + k P + [0, width)``, so
    two views whose rows sit in disjoint columns of one period (``gu[:, :F]`` and ``gu[:, F:]``) do not overlap.
    Conservative: an answer of True may be a false alarm, False never is."""
    if u is None or v is None or u.size == 0 or v.size == 0:
        return False
    (ulo, uhi), (vlo, vhi) = _extent(u), _extent(v)
    if not (ulo < vhi and vlo < uhi):
        return False
    (wu, su), (wv, sv) = _blocks(u), _blocks(v)
    period = math.gcd(*su, *sv)
    if period == 0:  # two contiguous blocks whose ranges meet
        return True
    d = (_address(v) - _address(u)) % period  # where v's rows start within u's period
    return not (wu <= d and d + wv <= period)  # v's row fits in the gap after u's (never when wu + wv > period)


def same_buffer(u, v) -> bool:
    """Whether two arrays are the same bytes element for element: the same start, shape, item size and strides
    (those of size-1 axes aside)."""
    return (_address(u) == _address(v) and tuple(u.shape) == tuple(v.shape) and u.itemsize == v.itemsize
            and all(n == 1 or a == b for n, a, b in zip(u.shape, u.strides, v.strides)))


def check_alias(out_name, out, in_name, inp):
    """``out`` may be ``inp`` itself (in place) but must not overlap it any other way: a kernel that
    reads each element before writing it is safe in place, never with a shifted view."""
    if overlaps(out, inp) and not same_buffer(out, inp):
        raise ValueError(f"{out_name} overlaps {in_name} without being the same buffer: pass {out_name}={in_name} "
                         "for in place, or separate buffers")


# --------------------------------------------------------------------------- values of the user-facing API


def is_integer(v) -> bool:
    """A Python or NumPy integer, not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


_FIELD_TYPES = {"int": (is_integer, "an integer"), "float": (_is_real, "a number"),
                "str": (lambda v: isinstance(v, str), "a string"),
                "bool": (lambda v: isinstance(v, (bool, np.bool_)), "true or false")}


def check_field_types(obj, name_of=str, error=TypeError):
    """``obj`` (a dataclass) when every field holds a value of its declared type, else ``error`` naming the field
    (``name_of(field name)``: what the caller calls it, a flag for instance). An ``int`` field refuses 2.5 and True
    (a count is never rounded), a ``float`` field takes integers, ``None`` only where the type says ``| None``."""
    for f in fields(obj):
        kinds = _type_names(f.type)
        v = getattr(obj, f.name)
        known = [k for k in kinds if k in _FIELD_TYPES]
        if not known or (v is None and "None" in kinds) or any(_FIELD_TYPES[k][0](v) for k in known):
            continue
        want = " or ".join([_FIELD_TYPES[k][1] for k in known] + (["None"] if "None" in kinds else []))
        raise error(f"{name_of(f.name)} must be {want}, got {type(v).__name__} {v!r}")
    return obj


def fields_of_dict(cls, d, *, also=()):
    """The keyword arguments of dataclass ``cls`` that the dict ``d`` gives (an ``as_dict`` form: a checkpoint's
    model configuration, say). A TypeError for a non-dict; a ValueError naming keys that are no field (nor in
    ``also``): a misspelled one would otherwise leave its field at the default."""
    if not isinstance(d, dict):
        raise TypeError(f"a {cls.__name__} is a dict of its fields, got {type(d).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(str(k) for k in set(d) - set(names) - set(also))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} {'is no field' if len(unknown) == 1 else 'are no fields'} "
                         f"of {cls.__name__} ({', '.join(names)})")
    return {k: d[k] for k in names if k in d}


def _type_names(t) -> list[str]:
    """['int', 'None'] for ``int | None``, written as a string (``from __future__ import annotations``) or not."""
    if isinstance(t, str):
        return [k.strip() for k in t.split("|")]
    args = getattr(t, "__args__", None)
    if args:  # int | None, Optional[int]
        return [n for a in args for n in _type_names(a)]
    return ["None" if t is type(None) else getattr(t, "__name__", str(t))]


def check_token_ids(ids, vocab_size: int, name="the prompt") -> list[int]:
    """``ids`` as a list of Python ints: at least one, each an integer (1.0 is refused, not rounded) in
    ``[0, vocab_size)``; a ValueError/TypeError naming ``name`` otherwise."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if not ids:
        raise ValueError(f"{name} holds no token: give at least one")
    bad = next((t for t in ids if not is_integer(t)), None)
    if bad is not None:
        raise TypeError(f"{name} must hold integer token ids, got {type(bad).__name__} {bad!r}")
    out = [int(t) for t in ids]
    bad = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} has token id {bad}, outside the model's vocabulary [0, {vocab_size})")
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
