"""Flat parameter buffers: every weight, gradient and optimizer moment in one contiguous array each.

A model has ~150 parameter tensors (GPT-2 124M: 148). Keeping each in its own allocation means one
optimizer kernel launch per tensor, one all-reduce per tensor, one cast per tensor. Instead,
``FlatParams`` owns one fp32 buffer per role and hands out per-tensor *views*:

=============  ===========  ==========================================================
buffer         dtype        role
=============  ===========  ==========================================================
``.data``      fp32         master weights (what AdamW updates)
``.grad``      fp32         gradients (the model writes into ``.grad_of(name)``)
``.m``, ``.v`` fp32         AdamW first and second moments
``.working``   bf16/fp16    the copy the forward/backward pass reads (``.weight(name)``);
                            for fp32 working precision it *is* ``.data``
=============  ===========  ==========================================================

Layout. Each tensor starts at an offset that is a multiple of ``ALIGN`` (16 elements: 64 bytes of
fp32, 32 bytes of bf16), so every per-tensor view keeps the 16-byte alignment vectorized kernels
need, and the total length is a multiple of ``ALIGN`` too. Padding elements are zero everywhere and
stay zero (zero gradient, zero moments, no decay). Tensors that get weight decay are laid out first,
tensors that do not (biases, layernorm gains and shifts: by default every 1-D tensor) after them, so
the decay mask is a single split point ``decay_end``: element i is decayed iff ``i < decay_end``.
One comparison per element, no mask array to read (a per-element mask would add 1 byte to the
~30 bytes AdamW moves per parameter). ``.decay_mask()`` builds the equivalent per-element mask for
checks and the NumPy reference.

The order of ``.names`` is the order the shapes were given in; the buffer order (``.offsets``) is
grouped by decay as above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .. import backend
from ..checks import GPU_DTYPES
from ..ops.cast import cast

ALIGN = 16  # elements; keeps 16-byte alignment for fp32 (4-wide) and 16-bit (8-wide) vector access


def default_no_decay(name: str, shape: tuple) -> bool:
    """nanoGPT's rule: tensors with fewer than two dimensions (biases, layernorm) get no decay."""
    return len(shape) < 2


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class FlatParams:
    """One contiguous buffer each for master weights, gradients, AdamW moments and the working copy.

    ``shapes``: name → shape (insertion order kept in ``.names``). ``xp``: NumPy or CuPy (default:
    ``backend.default_xp()``). ``working_dtype``: the compute precision the model reads ('fp32',
    'bf16', 'fp16'). ``no_decay(name, shape) -> bool`` selects the tensors without weight decay.
    ``multiple``: every tensor starts, and the decayed segment and the whole buffer end, on a multiple of it
    (default ``ALIGN``; ZeRO over N ranks asks for N·ALIGN: every tensor boundary is then a place to cut the
    buffer into buckets whose N pieces stay aligned).

    All buffers start at zero; initialise weights by writing into ``.param(name)`` (or
    ``load_dict``) and then call ``.sync_working()``.
    """

    def __init__(self, shapes: Mapping[str, tuple], *, xp=None, working_dtype="fp32",
                 no_decay: Callable[[str, tuple], bool] | None = None, multiple: int = ALIGN):
        if not shapes:
            raise ValueError("shapes is empty: FlatParams needs at least one tensor")
        self.xp = xp or backend.default_xp()
        self.working_dtype = backend.resolve_dtype(working_dtype)
        if self.working_dtype not in GPU_DTYPES:
            raise TypeError(f"working_dtype must be fp32, fp16 or bf16, got {self.working_dtype}")
        if multiple < ALIGN or multiple % ALIGN:
            raise ValueError(f"multiple must be a positive multiple of {ALIGN}, got {multiple}")
        no_decay = no_decay or default_no_decay
        self.names: list[str] = list(shapes)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.sizes: dict[str, int] = {}
        self.decay: dict[str, bool] = {}
        for name in self.names:
            shape = tuple(int(s) for s in shapes[name])
            if any(s <= 0 for s in shape):
                raise ValueError(f"shape of {name!r} must have positive sizes, got {shape}")
            self.shapes[name] = shape
            self.sizes[name] = int(np.prod(shape, dtype=np.int64))
            self.decay[name] = not bool(no_decay(name, shape))
        # layout: decayed tensors first, then the rest; each segment aligned
        self.offsets: dict[str, int] = {}
        pos = 0
        for group in (True, False):
            for name in self.names:
                if self.decay[name] == group:
                    self.offsets[name] = pos
                    pos += _align(self.sizes[name], multiple)
            pos = _align(pos, multiple)  # each group ends on a multiple: ZeRO cuts the buffer there (chapter 9)
            if group:
                self.decay_end = pos  # elements [0, decay_end) get weight decay
        self.numel = pos  # buffer length, padding included (a multiple of ALIGN)
        self.num_parameters = sum(self.sizes.values())  # real parameters, padding excluded
        self.grad_offsets = self.offsets  # where each gradient lives in .grad (ZeRO-2 repacks it: dist/zero.py)
        xp_ = self.xp
        f32 = backend.float32
        self.data = xp_.zeros(self.numel, dtype=f32)
        self.grad = xp_.zeros(self.numel, dtype=f32)
        self._m = self._v = None  # AdamW's moments: allocated when an optimizer first asks (``m``, ``v``)
        if self.working_dtype == f32:
            self.working = self.data
        else:
            self.working = xp_.zeros(self.numel, dtype=self.working_dtype)

    @classmethod
    def over(cls, *, data, grad, m, v, working, decay_end: int):
        """A FlatParams without names over given 1-D buffers (one rank's ZeRO shard, ``dist/zero.py``), so
        ``AdamW`` runs on it unchanged: elements [0, decay_end) get weight decay."""
        self = cls.__new__(cls)
        self.xp = backend.get_array_module(data)
        self.working_dtype = working.dtype
        self.names, self.shapes, self.sizes, self.decay, self.offsets = [], {}, {}, {}, {}
        self.grad_offsets = self.offsets
        self.data, self.grad, self._m, self._v, self.working = data, grad, m, v, working
        self.numel = self.num_parameters = int(data.size)
        self.decay_end = int(decay_end)
        return self

    # ------------------------------------------------------------------ views

    def _view(self, buf, name, offsets=None):
        try:
            off = (self.offsets if offsets is None else offsets)[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r}; known: {len(self.names)} names, e.g. {self.names[:3]}") from None
        return buf[off : off + self.sizes[name]].reshape(self.shapes[name])

    def param(self, name: str):
        """The fp32 master weight ``name`` (a view into ``.data``)."""
        return self._view(self.data, name)

    def grad_of(self, name: str):
        """The fp32 gradient of ``name`` (a view into ``.grad``): the model writes here."""
        return self._view(self.grad, name, self.grad_offsets)

    def weight(self, name: str):
        """The working-precision weight ``name`` (a view into ``.working``): the model reads here."""
        return self._view(self.working, name)

    def stacked(self, names, *, grad: bool = False):
        """Matrices ``names`` (same column count) as one ``[Σ rows, cols]`` view of the working weights (or, with
        ``grad``, of the gradients), when they lie back to back in that buffer, else None. A fused GEMM over
        the view is the GEMMs over the pieces (Llama's q|k|v and gate|up projections, chapter 10)."""
        offsets = self.grad_offsets if grad else self.offsets
        shapes = [self.shapes[n] for n in names]
        if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
            raise ValueError(f"stacked matrices must be 2-D with one column count, got {dict(zip(names, shapes))}")
        start = offsets[names[0]]
        end = start
        for n in names:
            if offsets[n] != end:
                return None  # padding or another tensor in between (e.g. a ZeRO layout): not one matrix
            end += self.sizes[n]
        rows = sum(s[0] for s in shapes)
        return (self.grad if grad else self.working)[start:end].reshape(rows, shapes[0][1])

    # AdamW's first and second moments, one flat fp32 buffer each. They are allocated on first use, by the
    # optimizer built over these parameters: a ZeRO rank (chapter 9) builds its optimizer over its shard
    # instead, and so never holds the whole buffers.
    def _moment(attr: str):
        def get(self):
            if getattr(self, attr) is None:
                setattr(self, attr, self.xp.zeros(self.numel, dtype=backend.float32))
            return getattr(self, attr)

        return property(get, lambda self, buf: setattr(self, attr, buf))

    m, v = _moment("_m"), _moment("_v")
    del _moment

    @property
    def has_moments(self) -> bool:
        """Whether the moment buffers exist (an optimizer over these parameters asked for them)."""
        return self._m is not None

    def moments(self):
        """(m, v), allocated now if they were not (an optimizer calls this when it is built, so the buffers
        never appear inside a captured step)."""
        return self.m, self.v

    def m_of(self, name: str):
        return self._view(self.m, name)

    def v_of(self, name: str):
        return self._view(self.v, name)

    def segments(self):
        """(name, offset, size, decay) in buffer order."""
        return sorted(((n, self.offsets[n], self.sizes[n], self.decay[n]) for n in self.names), key=lambda t: t[1])

    def decay_mask(self):
        """Per-element 0/1 float32 mask (1 = decayed) on ``xp``: the split point spelled out."""
        mask = np.zeros(self.numel, dtype=np.float32)
        mask[: self.decay_end] = 1.0
        return backend.to_device(mask, self.xp)

    def __contains__(self, name):
        return name in self.offsets

    def __len__(self):
        return len(self.names)

    def __repr__(self):
        return (f"FlatParams({len(self.names)} tensors, {self.num_parameters:,} parameters, buffer {self.numel:,}, "
                f"working {backend.dtype_name(self.working_dtype)}, on {'cupy' if self.xp is not np else 'numpy'})")

    # ------------------------------------------------------------------ operations

    def zero_grad(self):
        """Zero the whole gradient buffer (one memset)."""
        self.grad.fill(0)

    def sync_working(self):
        """Cast master → working copy in one launch (no-op when the working dtype is fp32)."""
        if self.working is self.data:
            return
        cast(self.data, self.working_dtype, out=self.working)

    def to_dict(self) -> dict[str, np.ndarray]:
        """name → NumPy copy of the fp32 master weight (one device→host copy of the whole buffer)."""
        host = backend.to_numpy(self.data)
        return {n: host[self.offsets[n] : self.offsets[n] + self.sizes[n]].reshape(self.shapes[n]).copy()
                for n in self.names}

    def flatten(self, d: Mapping[str, object], *, what: str = "flatten") -> np.ndarray:
        """name → array (every name of these parameters, each of its shape) as one host fp32 buffer in this
        layout (padding zero): the inverse of splitting a flat buffer by name."""
        host = np.zeros(self.numel, dtype=np.float32)
        for n in self.names:
            if n not in d:
                raise KeyError(f"{what} has no entry for {n!r}")
            arr = np.asarray(backend.to_numpy(d[n]), dtype=np.float32)
            if arr.shape != self.shapes[n]:
                raise ValueError(f"{what}[{n!r}] has shape {arr.shape}, expected {self.shapes[n]}")
            host[self.offsets[n]: self.offsets[n] + self.sizes[n]] = arr.reshape(-1)
        return host

    def load_dict(self, d: Mapping[str, object], strict: bool = True):
        """Copy name → array into the master weights (NumPy or CuPy arrays, any float dtype), then
        refresh the working copy. ``strict`` requires exactly the same set of names (a ValueError naming the first
        few missing and unexpected ones: weights of another model)."""
        if strict:
            missing = [n for n in self.names if n not in d]
            extra = [n for n in d if n not in self.offsets]
            if missing or extra:
                def few(names):
                    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                said = ([f"{len(missing)} missing ({few(missing)})"] if missing else []) + (
                    [f"{len(extra)} unexpected ({few(extra)})"] if extra else [])
                raise ValueError(f"load_dict: the names are not this model's: {'; '.join(said)}")
        host = np.zeros(self.numel, dtype=np.float32)
        cur = backend.to_numpy(self.data) if not strict else None
        if cur is not None:
            host[:] = cur
        for n, a in d.items():
            if n not in self.offsets:
                continue
            arr = np.asarray(backend.to_numpy(a), dtype=np.float32)
            if arr.shape != self.shapes[n]:
                raise ValueError(f"load_dict: {n!r} has shape {arr.shape}, expected {self.shapes[n]}")
            host[self.offsets[n] : self.offsets[n] + self.sizes[n]] = arr.reshape(-1)
        self.data[...] = backend.to_device(host, self.xp)
        self.sync_working()
