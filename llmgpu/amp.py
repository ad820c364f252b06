"""Chapter 5: mixed precision. Casts, the inf/nan check, the dynamic loss scaler, precision policies.

The policy of the training loop: fp32 *master* weights and AdamW state; the forward and
backward passes read a bf16 (default) or fp16 *working* copy and accumulate every GEMM and
reduction in fp32. bf16 keeps fp32's exponent range, so its gradients do not underflow; fp16 has 5
exponent bits, so small gradients flush to zero unless the loss is multiplied by a *loss scale*
before the backward pass and the gradients divided by it afterwards. A dynamic scaler grows the
scale while steps are clean and halves it (skipping the step) when a gradient overflows to inf.

Nothing here reads the device from the host inside a step: the scale, its inverse, the good-step
counter and the overflow flag are 0-d device arrays, updated by small kernels.

* ``cast(x, dtype, out=None)``: fp32 ↔ bf16 ↔ fp16, round-to-nearest-even (``llmgpu.ops.cast``,
  ``kernels/cast.cu``; it sits with the ops because the flat parameters of chapter 4 cast too).
* ``has_inf_or_nan(x)``: 0-d fp32 flag (1.0 / 0.0).
* ``LossScaler(kind="dynamic"|"static"|"none", ...)``.
* ``Policy(compute="bf16")``: names the compute dtype and whether a scaler is needed.
* ``fp16_fate(x, scale)`` and ``log2_histogram(x, edges)``: where gradient values fall on the fp16 axis
  (chapter 5's census; these read results on the host, they are for inspection, not for a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import backend
from .checks import array_module, check_array, check_choice
from .kernels import get_kernel
from .ops.cast import CAST_DTYPES, cast
from .optim.clip import GradClipper, grad_norm_fused

_F32 = backend.float32


def has_inf_or_nan(x):
    """0-d fp32 array on x's device: 1.0 when any element of x is inf or nan, else 0.0 (no host sync)."""
    array_module(x=x)
    check_array("x", x, dtypes=CAST_DTYPES)
    return grad_norm_fused(x.reshape(-1), 0.0).found_inf


# --------------------------------------------------------------------------- loss scaling


class LossScaler:
    """Loss scaling with the scale, its inverse and the clean-step counter on the device.

    ``kind``: 'dynamic' (grow ×``growth_factor`` after ``growth_interval`` clean steps, multiply by
    ``backoff_factor`` on overflow: PyTorch GradScaler's rule), 'static' (fixed scale, default 1024)
    or 'none' (scale 1). ``init_scale`` defaults to 2**16 (dynamic) / 1024 (static) / 1 (none).

    A step with loss scaling::

        loss_grad = dlogits * scaler.loss_scale_for_backward()     # before backward
        res = scaler.check_and_clip(params.grad, max_norm=1.0)      # one launch: norm, scale, found_inf
        opt.step(grad_scale=res.scale, found_inf=res.found_inf)     # skipped on the device on overflow
        scaler.update(res.found_inf)                                # new scale, on the device
    """

    KINDS = ("dynamic", "static", "none")

    def __init__(self, kind: str = "dynamic", init_scale: float | None = None, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, *, xp=None):
        check_choice("kind", kind, self.KINDS)
        if init_scale is None:
            init_scale = {"dynamic": 2.0**16, "static": 1024.0, "none": 1.0}[kind]
        if kind == "none" and init_scale != 1.0:
            raise ValueError("kind='none' has scale 1; use kind='static' for a fixed scale")
        if not init_scale > 0 or not np.isfinite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0 or int(growth_interval) < 1:
            raise ValueError(f"need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; got "
                             f"{growth_factor}, {backoff_factor}, {growth_interval}")
        self.kind = kind
        self.xp = xp or backend.default_xp()
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._buf = self.xp.asarray(np.array([init_scale, 1.0 / init_scale], dtype=np.float32))
        self.scale = self._buf[0:1].reshape(())  # 0-d views: the kernel updates them in place
        self.inv_scale = self._buf[1:2].reshape(())
        self.good_steps = self.xp.zeros((), dtype=np.int32)
        self._clipper = GradClipper(None, xp=self.xp)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def loss_scale_for_backward(self):
        """0-d fp32 device array: multiply the loss gradient (e.g. dlogits) by it before backward."""
        return self.scale

    def unscale_factor(self):
        """0-d fp32 device array 1/scale: pass as AdamW's grad_scale (or the norm kernel's prescale)."""
        return self.inv_scale

    def check(self, grad_flat):
        """0-d fp32 device flag, 1.0 when the (scaled) gradient holds an inf or nan."""
        return self.check_and_clip(grad_flat).found_inf

    def check_and_clip(self, grad_flat, max_norm: float | None = None, out=None):
        """One launch over the scaled gradient: GradNorm with the *unscaled* norm, the factor
        1/scale × clip coefficient for AdamW's grad_scale, and the found_inf flag. The result
        lives in buffers owned by the scaler (overwritten by the next call) unless ``out`` is given."""
        array_module(grad_flat=grad_flat, scale=self.scale)
        return grad_norm_fused(grad_flat, max_norm or 0.0, prescale=self.inv_scale, out=out or self._clipper.result)

    def update(self, found_inf):
        """Advance the scale after a step (dynamic only; static/none: nothing to do). No host sync."""
        if self.kind != "dynamic":
            return
        xp = array_module(found_inf=found_inf, scale=self.scale)
        if found_inf.size != 1 or found_inf.dtype != _F32:
            raise TypeError(f"found_inf must be a 0-d fp32 array, got shape {tuple(found_inf.shape)} {found_inf.dtype}")
        if xp is np:
            s, good = float(self.scale), int(self.good_steps)
            if float(found_inf.reshape(())) != 0.0:
                s, good = s * self.backoff_factor, 0
            else:
                good += 1
                if good >= self.growth_interval:
                    with np.errstate(over="ignore"):
                        grown = np.float32(s * self.growth_factor)
                    if np.isfinite(grown):
                        s = float(grown)
                    good = 0
            self.scale[...] = np.float32(s)
            self.inv_scale[...] = np.float32(1.0) / np.float32(s)
            self.good_steps[...] = good
            return
        get_kernel("amp", "scaler_update")(
            (1,), (32,),
            (self.scale, self.inv_scale, self.good_steps, found_inf, np.float32(self.growth_factor),
             np.float32(self.backoff_factor), np.int32(self.growth_interval)),
        )

    def scale_value(self) -> float:
        """The current scale on the host (a sync: call it outside the step, for logging)."""
        return float(backend.to_numpy(self.scale))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "scale": self.scale_value(), "good_steps": int(backend.to_numpy(self.good_steps)),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict):
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"state is for a {state['kind']!r} scaler, this one is {self.kind!r}")
        s = np.float32(state["scale"])
        self._buf[...] = self.xp.asarray(np.array([s, np.float32(1.0) / s], dtype=np.float32))
        self.good_steps[...] = int(state.get("good_steps", 0))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))

    def __repr__(self):
        return f"LossScaler(kind={self.kind!r}, growth_interval={self.growth_interval})"


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class Policy:
    """Which precision does what. ``compute``: the working dtype of weights/activations ('bf16',
    'fp16' or 'fp32'); master weights and optimizer state are always fp32; GEMMs and reductions
    accumulate in fp32. fp16 needs dynamic loss scaling; bf16 and fp32 do not."""

    compute: str = "bf16"

    def __post_init__(self):
        d = backend.resolve_dtype(self.compute)
        if d not in CAST_DTYPES:
            raise ValueError(f"compute must be bf16, fp16 or fp32, got {self.compute!r}")
        object.__setattr__(self, "compute", backend.dtype_name(d))

    @property
    def compute_dtype(self) -> np.dtype:
        return backend.resolve_dtype(self.compute)

    @property
    def master_dtype(self) -> np.dtype:
        return _F32

    @property
    def needs_scaler(self) -> bool:
        return self.compute == "fp16"

    @property
    def scaler_kind(self) -> str:
        return "dynamic" if self.needs_scaler else "none"

    def make_scaler(self, xp=None, **kwargs) -> LossScaler:
        return LossScaler(self.scaler_kind, xp=xp, **kwargs)


# --------------------------------------------------------------------------- the fp16 census (chapter 5)

FP16_MIN_SUBNORMAL = 2.0**-24  # smallest positive fp16; below half of it a value rounds to 0
FP16_MIN_NORMAL = 2.0**-14  # below it fp16 is subnormal: fewer mantissa bits, down to none
FP16_MAX = 65504.0


def fp16_fate(x, scale=1.0) -> dict:
    """What casting ``x × scale`` to fp16 does to the *nonzero* values of ``x`` (any float dtype).

    Fractions of them that become 0 (``"zero"``: the gradient is lost), fp16 subnormals
    (``"subnormal"``: below 2^-14, precision shrinking to nothing), normal fp16 numbers (``"normal"``) and
    ±inf (``"overflow"``); plus ``"n"``, how many values were counted. The product is formed in fp32 and
    rounded by the cast kernel (nearest, ties to even), as the backward pass rounds. Reads the counts on
    the host.
    """
    xp = array_module(x=x)
    check_array("x", x, dtypes=CAST_DTYPES)
    v = x.reshape(-1)
    v = v[v != 0].astype(_F32) * np.float32(scale)
    n = int(v.size)
    if n == 0:
        return {"n": 0, "zero": 0.0, "subnormal": 0.0, "normal": 0.0, "overflow": 0.0}
    a = xp.abs(cast(v, "fp16")).astype(_F32)
    zero, over = int((a == 0).sum()), int(xp.isinf(a).sum())
    sub = int(((a > 0) & (a < np.float32(FP16_MIN_NORMAL))).sum())
    return {"n": n, "zero": zero / n, "subnormal": sub / n, "normal": (n - zero - sub - over) / n,
            "overflow": over / n}


def log2_histogram(x, edges) -> np.ndarray:
    """Counts (host int64) of ``log2 |x|`` over the nonzero values of ``x`` in the bins ``edges`` (ascending,
    host), computed on x's device; values outside the edges are not counted."""
    xp = array_module(x=x)
    v = x.reshape(-1)
    v = xp.abs(v[v != 0].astype(_F32))
    counts, _ = xp.histogram(xp.log2(v), bins=xp.asarray(np.asarray(edges, dtype=np.float32)))
    return backend.to_numpy(counts).astype(np.int64)


__all__ = ["FP16_MAX", "FP16_MIN_NORMAL", "FP16_MIN_SUBNORMAL", "LossScaler", "Policy", "cast", "fp16_fate",
           "has_inf_or_nan", "log2_histogram"]
