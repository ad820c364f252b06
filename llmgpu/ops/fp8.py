"""FP8 on Hopper (chapter 5): the two formats, scaled casts that measure amax in the same pass, scales from amax.

**The formats** (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; ``E4M3`` and ``E5M2`` below):
E4M3 (4 exponent bits, 3 mantissa bits, no infinities: its "fn" variant spends the would-be inf codes on
more range) reaches 448 with a unit roundoff of 2^-4; E5M2 reaches 57344 with 2^-3. E4M3 holds weights and
activations, E5M2 (more range, less precision) the gradients. Either range is far too small for raw
tensors, so every FP8 tensor carries an fp32 **scale**: ``q = fp8(x · scale)``, ``x ≈ q · scale_inv``.

**A scale from amax.** With ``amax = max |x|``, ``scale = fp8_max / amax / 2^margin`` maps the largest
element onto the format's largest value (``margin`` bits of headroom), optionally rounded down to a power
of two (then ``scale_inv`` is exact and dequantization loses nothing). Guards: an amax of 0, inf or NaN
keeps the previous scale; scales are clamped to [2^-126, 2^126] so that ``1/scale`` stays a normal float.
``AmaxHistory`` holds that state on the device (scale, scale_inv, the last amax and a ring of the last
``n`` amaxes; the scale comes from the ring's max), updated by one launch, so a step never reads it back:

* **current scaling** (``quantize(..., recipe="current")``): measure amax of this tensor, update
  (n = 1), cast: three kernels and a 4-byte memset, two reads of x; the scale always fits the data.
* **delayed scaling** (``recipe="delayed"``, NVIDIA Transformer Engine's default): cast with the scale
  from the last n steps' amaxes while measuring this step's amax in the same pass; ``update()`` later.
  One read of x; a tensor that grows faster than the history saturates (the cast clips, it never overflows).
  ``AmaxHistories`` updates many states (a model's) in one launch: their arrays become views of flat buffers.

**The cast** (``fp8_cast``): ``x`` (fp32 / bf16 / fp16) → the FP8 bytes as a ``uint8`` array (CuPy has no
float8 dtype; ``FP8_FORMATS[...].dtype`` views them on NumPy), and ``amax(|x|)`` in the same pass, and
optionally the transposed bytes ``[C, R]`` that cuBLASLt's FP8 GEMMs need for the backward pass
(``llmgpu.gemm.fp8``). Rounding: ``x · scale`` in fp32, then one round-to-nearest-even; saturating
(``|x · scale| > fp8_max`` and ±inf become ±fp8_max); NaN → the byte ``NAN_BITS``. amax is of ``x`` before
scaling; a NaN anywhere makes amax NaN (not ignored: the trainer must see it). The CUDA kernels
(``kernels/fp8.cu``) give the NumPy reference's bytes exactly, and their amax is deterministic.

**GELU on the fly** (``act=``, the amax pass and the cast): ``"gelu"`` casts GELU(x + bias), x being the MLP's
product x·Wᵀ and ``bias`` its bias (optional), so the forward never writes GELU's bf16 output (nor the biased
pre-activation) only to read it back for the cast; ``"dgelu"`` casts x · GELU'(pre + bias), x being the gradient
of GELU's output. The values are computed in fp32 with ``kernels/gelu.cuh``'s fast form (a few fp32 ulp from the
float64 formula the reference uses, far below FP8's 2^-4), so a byte can differ from the reference's by one code
where a value sits on a rounding boundary.

**Bias gradients on the fly** (``column_sums=``): the cast adds the column sums of the values it casts (fp32,
per tile of rows, then the tiles in a fixed order: the same bits on every run) into a bias gradient, so no other
pass reads the gradient for it.

Capturable: pass every output (``out``, ``out_t``, ``amax``, ``scale_inv``) preallocated; nothing is then
allocated and nothing read back (``column_sums`` takes a scratch buffer from CuPy's pool, which a CUDA graph
capture allows).

This module is long because its parts are one contract: the NumPy references define the bytes the kernels' hosts
must give, and chapter 5b reads the formats, the casts and the scaling state side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .. import backend
from ..checks import FLOAT_DTYPES, GPU_DTYPES, array_module, check_array, check_choice, is_integer, overlaps
from ..kernels import get_kernel
from ..kernels.launch import elements_aligned, resident_grid
from ..kernels.loader import constant
from .gelu import gelu_backward_reference, gelu_forward_reference

BYTES = np.dtype(np.uint8)
THREADS = constant("fp8", "FP8_THREADS")
TILE = constant("fp8", "FP8_TILE")
ROWS_8X8, COLS_8X8 = constant("fp8", "FP8_8X8_ROWS"), constant("fp8", "FP8_8X8_COLS")
NAN_BITS = constant("fp8", "FP8_NAN_BITS")  # what NaN becomes, in both formats
WORDS = constant("fp8", "FP8_STATE_WORDS")  # AmaxHistories: a state's scalars this many words apart
SCALE_EXP_LIMIT = constant("fp8", "FP8_SCALE_EXP_LIMIT")  # scales live in [2^-limit, 2^limit]
ACTS = {None: constant("fp8", "FP8_ACT_NONE"), "gelu": constant("fp8", "FP8_ACT_GELU"),
        "dgelu": constant("fp8", "FP8_ACT_DGELU")}  # act= of the amax pass and the cast: the kernels' ACT
ACT_DTYPES = (np.dtype(np.float32), np.dtype(backend.bfloat16))  # the inputs the act= kernels are built for
_QNAN_BITS = 0x7FC00000  # the canonical quiet NaN: the amax of an input holding NaN
_EXP_MASK = 0x7F800000


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its NumPy dtype (ml_dtypes, where the facts come from) and its names in CUDA."""

    name: str
    dtype: np.dtype
    c_name: str  # __nv_fp8_interpretation_t in cuda_fp8.h: the kernels' template argument
    cuda_data_type: int  # cudaDataType_t (library_types.h): what cuBLASLt is told

    @property
    def max(self) -> float:
        """The largest finite value (448 for E4M3, 57344 for E5M2)."""
        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def mantissa_bits(self) -> int:
        return int(ml_dtypes.finfo(self.dtype).nmant)

    @property
    def unit_roundoff(self) -> float:
        """Relative error bound of one round-to-nearest in the normal range: 2^-(mantissa bits + 1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def smallest_normal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_normal)

    @property
    def smallest_subnormal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_subnormal)

    def values(self, xp=np):
        """The value of each of the 256 bytes as fp32 (NaN for the NaN codes): ``values()[q]`` decodes."""
        return xp.asarray(np.arange(256, dtype=np.uint8).view(self.dtype).astype(np.float32))


E4M3 = Fp8Format("e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "__NV_E4M3", 28)
E5M2 = Fp8Format("e5m2", np.dtype(ml_dtypes.float8_e5m2), "__NV_E5M2", 29)
FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_format(fmt) -> Fp8Format:
    """``'e4m3'``, ``'e5m2'`` or an ``Fp8Format`` → the ``Fp8Format``."""
    if isinstance(fmt, Fp8Format):
        return fmt
    check_choice("fp8 format", fmt, tuple(FP8_FORMATS))
    return FP8_FORMATS[fmt]


class Fp8Tensor(NamedTuple):
    """A cast's result: the bytes (``data``, x's shape, or None), the transposed bytes (``data_t`` [C, R], or
    None), ``scale_inv`` (fp32 [1]: x ≈ values · scale_inv, what the GEMM reads) and the format."""

    data: object
    data_t: object
    scale_inv: object
    fmt: Fp8Format


def dequantize(bits, scale_inv, fmt="e4m3"):
    """fp32 values of FP8 bytes: ``values[bits] · scale_inv`` (a table lookup; both backends, for checks)."""
    fmt = fp8_format(fmt)
    xp = array_module(bits=bits, scale_inv=scale_inv)
    check_array("bits", bits, dtypes=(BYTES,), contiguous=False)
    check_scalar("scale_inv", scale_inv, xp, dtype=None)
    return fmt.values(xp)[bits] * scale_inv.astype(np.float32).reshape(())


# --------------------------------------------------------------------------- NumPy reference


def amax_bits(x) -> np.ndarray:
    """|x| as uint32 bit patterns ordered like the values, NaN (any payload) as the canonical quiet NaN on top:
    the kernels' reduction order, so the reference's max is theirs bit for bit."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    return np.where(bits > _EXP_MASK, np.uint32(_QNAN_BITS), bits)


def _bits_to_float(b) -> np.float32:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def amax_reference(x) -> np.float32:
    """max |x| as fp32 (NaN if any element is NaN, +inf if any is infinite and none NaN)."""
    return _bits_to_float(amax_bits(x).max())


@np.errstate(invalid="ignore", over="ignore")
def act_reference(x, act=None, pre=None, bias=None) -> np.ndarray:
    """The values a cast with ``act`` quantizes, as fp32: x, GELU(x + bias) or x · GELU'(pre + bias) (float64
    formula, one rounding; ``bias`` along the last axis, optional); x itself (its dtype) when ``act`` is None."""
    if act is None:
        return np.asarray(x)
    xf = np.asarray(x).astype(np.float64)
    b = 0.0 if bias is None else np.asarray(bias).astype(np.float64)
    if act == "gelu":
        return gelu_forward_reference(xf + b).astype(np.float32)
    return gelu_backward_reference(xf, np.asarray(pre).astype(np.float64) + b).astype(np.float32)


def quantize_reference(x, scale, fmt="e4m3") -> np.ndarray:
    """The bytes of ``fp8(saturate(x · scale))``: fp32 multiply, clip to ±max (NaN kept), round to nearest even."""
    fmt = fp8_format(fmt)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(x).astype(np.float32) * np.float32(scale)
        q = np.clip(s, -fmt.max, fmt.max).astype(fmt.dtype).view(np.uint8)
    return np.where(np.isnan(s), np.uint8(NAN_BITS), q)


def scale_reference(amax_max, prev_scale, fmt="e4m3", margin=0, pow2=False) -> np.float32:
    """The scale for an amax (the history's max), as ``fp8_update_scale_kernel`` computes it, in fp32."""
    fmt = fp8_format(fmt)
    m = int(amax_bits(np.float32(amax_max)))
    if m == 0 or m >= _EXP_MASK:  # 0, inf or NaN: keep the previous scale
        return np.float32(prev_scale)
    with np.errstate(over="ignore", under="ignore"):
        s = np.float32(fmt.max) / _bits_to_float(m)
        s = s * np.float32(2.0 ** -margin)
    s = np.clip(s, np.float32(2.0 ** -SCALE_EXP_LIMIT), np.float32(2.0 ** SCALE_EXP_LIMIT))
    if pow2:
        s = np.array([s], np.float32).view(np.uint32)[0] & np.uint32(_EXP_MASK)
        s = _bits_to_float(s)
    return np.float32(s)


# --------------------------------------------------------------------------- checks shared by the calls


def check_scalar(name, a, xp, dtype=np.float32):
    """``a``: a [1] array on ``xp`` (of ``dtype``, or any float dtype for None)."""
    if backend.get_array_module(a) is not xp:
        raise TypeError(f"{name} must live on the same device as x")
    check_array(name, a, shape=(1,), dtype=dtype, dtypes=None if dtype is not None else FLOAT_DTYPES)


def bytes_out(name, out, shape, xp):
    """A caller's uint8 output checked (device, shape, contiguity), or a new one."""
    if out is None:
        return xp.empty(shape, dtype=BYTES)
    if backend.get_array_module(out) is not xp:
        raise TypeError(f"{name} must live on the same device as x")
    return check_array(name, out, shape=tuple(shape), dtype=BYTES, dtypes=None)


def check_scale_outputs(amax, accumulate_amax, scale_inv, xp):
    """A cast's ``amax`` (optional; ``accumulate_amax`` needs it) and ``scale_inv`` (new when None) checked: the
    ``scale_inv`` to write."""
    if amax is not None:
        check_scalar("amax", amax, xp)
    elif accumulate_amax:
        raise ValueError("accumulate_amax=True needs amax=")
    scale_inv = xp.empty(1, dtype=np.float32) if scale_inv is None else scale_inv
    check_scalar("scale_inv", scale_inv, xp)
    return scale_inv


def optional_arg(a):
    return a if a is not None else np.uint64(0)  # an optional array argument of a kernel: a null pointer for None


def _check_act(act, pre, bias, x):
    """act=, pre= and bias= checked against x: ``pre`` is the pre-activation ``"dgelu"`` needs (x's shape and
    dtype), given with it alone; ``bias`` (x's last axis and dtype) goes with an ``act``. Their device is checked
    by the caller's ``array_module``, which names every array."""
    check_choice("act", act, tuple(ACTS))
    if act is not None and np.dtype(x.dtype) not in ACT_DTYPES:
        raise TypeError(f"act={act!r} casts take x as float32 or bfloat16, got {np.dtype(x.dtype).name}")
    if bias is not None:
        if act is None:
            raise ValueError("bias= is added before GELU (act='gelu' or 'dgelu'); act=None takes none")
        check_array("bias", bias, shape=(x.shape[-1],), dtype=x.dtype, dtypes=None)
    if act != "dgelu":
        if pre is not None:
            raise ValueError(f"pre= is GELU's input for act='dgelu'; act={act!r} takes none")
        return
    if pre is None:
        raise ValueError("act='dgelu' casts x * GELU'(pre): pre= (GELU's input) must be given")
    check_array("pre", pre, shape=x.shape, dtype=x.dtype, dtypes=None)


def _check_margin(margin):
    if not is_integer(margin) or not 0 <= margin <= 64:
        raise ValueError(f"margin must be an integer in [0, 64] (bits of headroom), got {margin!r}")
    return int(margin)


# --------------------------------------------------------------------------- amax


def fp8_amax(x, out=None, *, accumulate=False, act=None, pre=None, bias=None):
    """max |x| into ``out`` (fp32 [1], new when None) and return it; ``accumulate``: max with what ``out`` holds
    (amax over several tensors or micro-batches); ``act``, ``pre``, ``bias``: of GELU(x + bias) or
    x · GELU'(pre + bias) instead (the module docstring). NaN propagates (see the module docstring)."""
    xp = array_module(x=x, out=out, pre=pre, bias=bias)
    check_array("x", x, dtypes=GPU_DTYPES)
    _check_act(act, pre, bias, x)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True takes the max with out's value, so out must be given")
        out = xp.zeros(1, dtype=np.float32)
    check_scalar("out", out, xp)
    if xp is np:
        new = amax_bits(act_reference(x, act, pre, bias)).max()
        out[0] = _bits_to_float(max(int(new), int(amax_bits(out)[0])) if accumulate else new)
        return out
    if not accumulate:
        out.fill(0)  # a memset: the kernel raises it with atomicMax
    n = x.size
    kern = get_kernel("fp8", "fp8_amax_kernel", x.dtype, ACTS[act])
    grid = resident_grid(kern, -(-n // 4), THREADS, xp)
    C = x.shape[-1] if x.ndim else 1
    vec = elements_aligned(4, x, pre) and (bias is None or C % 4 == 0)  # a pack in one row: one bias offset
    kern((grid,), (THREADS,), (x, optional_arg(pre), optional_arg(bias), np.int64(n), np.int64(C), out, np.int32(vec)))
    return out


# --------------------------------------------------------------------------- the cast


def fp8_cast(x, scale, fmt="e4m3", *, rowwise=True, transpose=False, out=None, out_t=None, amax=None,
             accumulate_amax=False, scale_inv=None, act=None, pre=None, bias=None, column_sums=None) -> Fp8Tensor:
    """Scaled cast of ``x`` (fp32 / bf16 / fp16, any shape) to FP8 bytes; one pass over x.

    ``scale``: fp32 [1] array on x's device (read there, never on the host). ``rowwise``: write the bytes in
    x's shape (``out``, uint8, new when None). ``transpose``: also write ``x.reshape(R, C).T``'s bytes
    (``out_t`` [C, R], C = x's last axis). ``amax``: fp32 [1] that receives max |x| (overwritten, or raised
    with ``accumulate_amax``); None skips the measurement. ``scale_inv``: fp32 [1] that receives 1/scale (new
    when None; keep it with the bytes: a later scale update must not change how they are read). ``act``, ``pre``,
    ``bias``: cast GELU(x + bias) or x · GELU'(pre + bias) instead of x (amax too; the module docstring).
    ``column_sums``: fp32 [C] into which the values' sums over the rows are added (a bias gradient; deterministic;
    float32 or bfloat16 x).
    """
    fmt = fp8_format(fmt)
    xp = array_module(x=x, scale=scale, out=out, out_t=out_t, amax=amax, scale_inv=scale_inv, pre=pre, bias=bias,
                      column_sums=column_sums)
    check_array("x", x, dtypes=GPU_DTYPES)
    _check_act(act, pre, bias, x)
    check_scalar("scale", scale, xp)
    if not (rowwise or transpose):
        raise ValueError("fp8_cast writes nothing with rowwise=False and transpose=False")
    for name, given, wanted in (("out", out, rowwise), ("out_t", out_t, transpose)):
        if given is not None and not wanted:
            raise ValueError(f"{name}= was given but {'rowwise' if name == 'out' else 'transpose'} is False")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (its last is C), got a 0-d array")
    if xp is np and not (np.isfinite(scale[0]) and scale[0] > 0):  # free on the host (the GPU reads it there)
        raise ValueError(f"scale must be finite and > 0, got {scale[0]}: the bytes would be 0 or NaN")
    C = x.shape[-1]
    R = x.size // C
    if column_sums is not None:
        if np.dtype(x.dtype) not in ACT_DTYPES:
            raise TypeError(f"column_sums= takes x as float32 or bfloat16, got {np.dtype(x.dtype).name}")
        check_array("column_sums", column_sums, shape=(C,), dtype=np.float32, dtypes=None)
    y = bytes_out("out", out, x.shape, xp) if rowwise else None
    yt = bytes_out("out_t", out_t, (C, R), xp) if transpose else None
    scale_inv = check_scale_outputs(amax, accumulate_amax, scale_inv, xp)
    outs = {"out": y, "out_t": yt, "amax": amax, "scale_inv": scale_inv, "column_sums": column_sums}
    for name, arr in outs.items():
        if any(overlaps(arr, a) for a in (scale, x, pre, bias)):
            raise ValueError(f"{name} overlaps an input (scale, x, pre or bias): the kernel reads those while it "
                             f"writes {name}")

    if xp is np:
        v = act_reference(x, act, pre, bias)
        q = quantize_reference(v, scale[0], fmt)
        if y is not None:
            y[...] = q
        if yt is not None:
            yt[...] = q.reshape(R, C).T
        if amax is not None:
            fp8_amax(v, amax, accumulate=accumulate_amax)  # the values already computed, not the act again
        if column_sums is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                column_sums += v.reshape(R, C).sum(axis=0, dtype=np.float64).astype(np.float32)
        scale_inv[0] = np.float32(1.0) / scale[0]
        return Fp8Tensor(y, yt, scale_inv, fmt)

    if amax is not None and not accumulate_amax:
        amax.fill(0)
    amax_ptr = optional_arg(amax)
    if yt is None and act is None and column_sums is None:
        n = x.size
        kern = get_kernel("fp8", "fp8_cast_kernel", x.dtype, fmt.c_name)
        vec = elements_aligned(4, x, y)
        kern((resident_grid(kern, -(-n // 4), THREADS, xp),), (THREADS,),
             (x, y, np.int64(n), scale, scale_inv, amax_ptr, np.int32(vec)))
    else:
        # a transposing kernel (also without a transpose for act= or column_sums=: only they apply GELU and sum)
        sums = int(column_sums is not None)
        kern, grid = _cast_transpose_kernel(x, pre, y, yt, fmt, ACTS[act], sums)
        if grid[1] > 65535:
            raise ValueError(f"fp8_cast(transpose=True or act=) takes at most {65535 * TILE} columns, got {C}")
        part = xp.empty((grid[0], C), dtype=np.float32) if column_sums is not None else None
        kern(grid, (THREADS,), (x, *map(optional_arg, (pre, bias, y, yt)), np.int64(R), np.int64(C), scale,
                                scale_inv, amax_ptr, optional_arg(part)))
        if part is not None:
            get_kernel("fp8", "fp8_column_sums_kernel")((-(-C // THREADS),), (THREADS,),
                                                         (part, np.int32(grid[0]), np.int64(C), column_sums,
                                                          np.int32(1)))
    return Fp8Tensor(y, yt, scale_inv, fmt)


def _cast_transpose_kernel(x, pre, y, yt, fmt, act, sums):
    """The transposing cast for these operands, and its grid: an 8 x 8 block per thread, transposed in registers,
    for 16-bit x in whole blocks (fp16 never comes with act or sums); else 64 x 64 shared tiles."""
    C = x.shape[-1]
    R = x.size // C
    if x.dtype.itemsize == 2 and R % 8 == C % 8 == 0 and elements_aligned(8, x, pre, y, yt):
        kern = get_kernel("fp8", "fp8_cast_transpose_8x8_kernel", x.dtype, fmt.c_name, act, sums)
        return kern, (-(-R // ROWS_8X8), -(-C // COLS_8X8))
    vec = 4 if (C % 4 == 0 and R % 4 == 0 and elements_aligned(4, x, pre, y, yt)) else 1
    kern = get_kernel("fp8", "fp8_cast_transpose_kernel", x.dtype, fmt.c_name, vec, act, sums)
    return kern, (-(-R // TILE), -(-C // TILE))


# --------------------------------------------------------------------------- scaling state


class AmaxHistory:
    """The scaling state of one FP8 tensor, kept on the device: ``scale`` and ``scale_inv`` (fp32 [1], start at
    1), ``amax`` (fp32 [1], what the casts write), and ``history`` (fp32 [length], a ring of the recorded amaxes;
    its write position ``pos`` is on the device too, so a captured graph's replays keep rotating it).

    ``update()`` records ``amax`` in the ring and sets ``scale`` from the ring's max (``scale_reference``); one
    launch, no host synchronisation. ``length=1`` is current scaling's state.
    """

    def __init__(self, fmt="e4m3", length=1, *, margin=0, pow2=False, xp=None):
        self.fmt = fp8_format(fmt)
        if not is_integer(length) or length < 1:
            raise ValueError(f"length must be a positive integer (steps of amax kept), got {length!r}")
        self.length, self.margin, self.pow2 = int(length), _check_margin(margin), bool(pow2)
        xp = self.xp = backend.resolve_xp(xp)
        self.scale = xp.ones(1, dtype=np.float32)
        self.scale_inv = xp.ones(1, dtype=np.float32)
        self.amax = xp.zeros(1, dtype=np.float32)
        self.history = xp.zeros(self.length, dtype=np.float32)
        self.pos = xp.zeros(1, dtype=np.int32)
        self.group = None  # the AmaxHistories whose buffers hold the arrays above, once grouped

    def update(self):
        """history[pos] = amax, pos = (pos + 1) % length, scale and scale_inv from max(history)."""
        if self.xp is np:
            self.history[self.pos[0]] = self.amax[0]
            self.pos[0] = (self.pos[0] + 1) % self.length
            self.scale[0] = scale_reference(_bits_to_float(amax_bits(self.history).max()), self.scale[0], self.fmt,
                                            self.margin, self.pow2)
            self.scale_inv[0] = np.float32(1.0) / self.scale[0]
            return self
        kern = get_kernel("fp8", "fp8_update_scale_kernel")
        kern((1,), (THREADS,), (self.history, np.int32(self.length), self.pos, self.amax, self.scale, self.scale_inv,
                                np.float32(self.fmt.max), _margin_factor(self.margin), np.int32(self.pow2)))
        return self

    def __repr__(self):
        return (f"AmaxHistory({self.fmt.name}, length={self.length}, margin={self.margin}, pow2={self.pow2}, "
                f"on {'numpy' if self.xp is np else 'cupy'})")


_STATE_ARRAYS = ("pos", "amax", "scale", "scale_inv")  # an AmaxHistory's one-element arrays (history aside)


def _margin_factor(margin) -> np.float32:
    return np.float32(2.0 ** -margin)  # what the update kernels multiply the scale by


class AmaxHistories:
    """``AmaxHistory`` states (E4M3 and E5M2 mixed; one length, margin and pow2) in flat device buffers, updated by
    one launch: ``history`` [S, length], ``pos``, ``amax``, ``scale``, ``scale_inv`` [S, WORDS] (element 0 of
    a row: cuBLASLt takes 16-byte aligned scale pointers only), ``fp8_max`` [S] (each format's largest value). Made
    from existing states: their values are copied in and their arrays become views of their rows, so the casts,
    ``update()`` and checkpoints use them as before. A state joins one group at most; grouping while the stream
    captures a CUDA graph is refused (the captured kernels keep the old arrays).

    ``update_and_clear()``: each state's ``update()``, then its amax zeroed (the end of a delayed-scaling step: the
    next step's casts raise the amaxes again). ``clear_amax()``: the zeroing alone (one memset).
    """

    def __init__(self, states):
        self.states = tuple(states)
        if not self.states or len(set(map(id, self.states))) != len(self.states):
            raise ValueError("AmaxHistories takes at least one state, each once")
        first = self.states[0]
        for st in self.states:
            for what in ("xp", "length", "margin", "pow2"):
                if getattr(st, what) != getattr(first, what):
                    raise ValueError(f"the states of one AmaxHistories share their {what}: {st!r}, {first!r}")
            if st.group is not None:
                raise ValueError(f"{st!r} is already in a group (its arrays are views of that group's buffers)")
        xp = self.xp = first.xp
        if backend.is_capturing(xp):
            raise RuntimeError("AmaxHistories was made while the stream captures a CUDA graph: the captured kernels "
                               "would keep the states' old arrays; group the states in an eager step first")
        self.length, self.margin, self.pow2 = first.length, first.margin, first.pow2
        self.history = xp.stack([st.history for st in self.states])
        for name in _STATE_ARRAYS:  # [S, WORDS], element 0 of a row used: every scale pointer 16-byte aligned
            setattr(self, name, xp.pad(xp.stack([getattr(st, name) for st in self.states]), ((0, 0), (0, WORDS - 1))))
        self.fp8_max = xp.asarray(np.array([st.fmt.max for st in self.states], dtype=np.float32))
        for i, st in enumerate(self.states):  # the states now read and write the buffers
            st.history, st.group = self.history[i], self
            st.pos, st.amax, st.scale, st.scale_inv = (getattr(self, name)[i, :1] for name in _STATE_ARRAYS)

    def update_and_clear(self):
        if self.xp is np:
            for st in self.states:
                st.update()
                st.amax[0] = 0
            return self
        kern = get_kernel("fp8", "fp8_update_scales_kernel")
        kern((len(self.states),), (THREADS,), (self.history, np.int32(self.length), self.pos, self.amax, self.scale,
                                               self.scale_inv, self.fp8_max, _margin_factor(self.margin),
                                               np.int32(self.pow2)))
        return self

    def clear_amax(self):
        self.amax.fill(0)
        return self

    def __repr__(self):
        return f"AmaxHistories({len(self.states)} states, length={self.length}, margin={self.margin}, pow2={self.pow2})"


RECIPES = ("current", "delayed")


def quantize(x, state: AmaxHistory, *, recipe="current", rowwise=True, transpose=False, out=None, out_t=None,
             scale_inv=None, act=None, pre=None, bias=None, column_sums=None) -> Fp8Tensor:
    """``x`` cast with ``state``'s scaling: ``"current"`` measures x, updates the state, then casts (the scale
    fits x); ``"delayed"`` casts with the scale the state holds and records x's amax in ``state.amax`` in the
    same pass (call ``state.update()`` when the step's amaxes are in, e.g. after the backward pass). ``act``,
    ``pre``, ``bias``, ``column_sums``: as ``fp8_cast``'s (the amax is then of the values cast)."""
    check_choice("recipe", recipe, RECIPES)
    if not isinstance(state, AmaxHistory):
        raise TypeError(f"state must be an AmaxHistory (the tensor's scaling state), got {type(state).__name__}")
    if recipe == "current":
        fp8_amax(x, state.amax, act=act, pre=pre, bias=bias)
        state.update()
    amax = state.amax if recipe == "delayed" else None
    return fp8_cast(x, state.scale, state.fmt, rowwise=rowwise, transpose=transpose, out=out, out_t=out_t,
                    amax=amax, scale_inv=scale_inv, act=act, pre=pre, bias=bias, column_sums=column_sums)


__all__ = ["ACTS", "BYTES", "E4M3", "E5M2", "FP8_FORMATS", "NAN_BITS", "RECIPES", "SCALE_EXP_LIMIT", "AmaxHistories",
           "AmaxHistory", "Fp8Format", "Fp8Tensor", "act_reference", "amax_bits", "amax_reference", "dequantize",
           "fp8_amax", "fp8_cast", "fp8_format", "quantize", "quantize_reference", "scale_reference"]
