"""AdamW: the NumPy reference, the fused single-launch CUDA step, and the per-tensor baseline.

``adamw_update`` updates one parameter tensor (any shape) in place; it is the building block and
the package's stable signature. ``AdamW`` drives a whole ``FlatParams``: one kernel launch updates
every parameter, applies weight decay by the decay split, writes the working-precision copy, can
zero the gradient, and can skip the step on the device when the loss scaler found an overflow.
``AdamW(per_tensor=True)`` launches ``adamw_update`` once per tensor instead: the naive version
chapter 4 measures against.

The update (``t`` = 1-based step, ``g`` = grad · grad_scale)::

    m ← β1 m + (1 − β1) g
    v ← β2 v + (1 − β2) g²
    p ← p (1 − lr·wd)                                   decoupled weight decay (decayed tensors)
    p ← p − lr / (1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)  bias-corrected Adam step
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import GPU_DTYPES, array_module, check_array, check_float
from ..kernels import get_kernel, loader
from ..kernels.launch import elements_aligned, resident_grid
from .params import FlatParams

THREADS = 256
_F32 = backend.float32

# flag bits of adamw_kernel, read from the #defines of kernels/adamw.cu (ADAMW_LR_PTR, ...)
LR_PTR, GS_PTR, FOUND_INF, STEP_PTR, INCREMENT, ZERO_GRAD, WRITE_WORKING, VEC = (
    loader.constant("adamw", "ADAMW_" + name)
    for name in ("LR_PTR", "GS_PTR", "FOUND_INF", "STEP_PTR", "INCREMENT", "ZERO_GRAD", "WRITE_WORKING", "VEC"))


# --------------------------------------------------------------------------- helpers


def _is_device_scalar(x) -> bool:
    return backend.is_gpu_array(x) or isinstance(x, np.ndarray)


def _check_hyperparameters(where, *, beta1, beta2, eps, weight_decay):
    """The float hyperparameters: finite and in range (ValueError naming the one that is not)."""
    check_float("betas[0] (beta1)", beta1, low=0.0, high=1.0, high_open=True, where=where)
    check_float("betas[1] (beta2)", beta2, low=0.0, high=1.0, high_open=True, where=where)
    check_float("eps", eps, low=0.0, low_open=True, where=where)
    check_float("weight_decay", weight_decay, low=0.0, where=where)


def _check_step_scalars(lr, grad_scale, found_inf, xp):
    """lr and grad_scale may be floats (finite, >= 0) or 0-d fp32 device arrays (their values stay on
    the device: reading them would synchronize); found_inf is a 0-d fp32 device flag."""
    for name, val in (("lr", lr), ("grad_scale", grad_scale)):
        if _is_device_scalar(val):
            _check_scalar_array(name, val, xp)
        else:
            check_float(name, val, low=0.0, where="adamw")
    if found_inf is not None:
        _check_scalar_array("found_inf", found_inf, xp)


def _check_scalar_array(name, x, xp, dtype=_F32):
    """A 0-d (or 1-element) array used as a device scalar: right backend, right dtype."""
    if backend.get_array_module(x) is not xp:
        raise TypeError(f"{name} must live on the same device as the parameters "
                        f"({'cupy' if xp is not np else 'numpy'}), got {type(x).__module__}.{type(x).__name__}")
    if x.size != 1:
        raise ValueError(f"{name} must be a 0-d (single element) array, got shape {tuple(x.shape)}")
    if x.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {x.dtype}")
    return x


def _host_value(x):
    """Host value of a float or a 0-d NumPy array (NumPy path only; never called with CuPy)."""
    return float(np.asarray(x).reshape(()))


# --------------------------------------------------------------------------- the reference


def _adamw_numpy(param, grad, m, v, *, t, lr, beta1, beta2, eps, decay, grad_scale):
    """The update in float64 arithmetic (fp32 storage): the spec the kernel is checked against.

    ``decay`` is a scalar weight decay or a per-element array (0 where not decayed).
    """
    f64 = np.float64
    g = grad.astype(f64) * f64(grad_scale)
    m64 = beta1 * m.astype(f64) + (1.0 - beta1) * g
    v64 = beta2 * v.astype(f64) + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1**t
    bc2 = 1.0 - beta2**t
    p64 = param.astype(f64) * (1.0 - lr * np.asarray(decay, dtype=f64))
    p64 = p64 - (lr / bc1) * m64 / (np.sqrt(v64) / np.sqrt(bc2) + eps)
    param[...] = p64.astype(param.dtype)
    m[...] = m64.astype(m.dtype)
    v[...] = v64.astype(v.dtype)


# --------------------------------------------------------------------------- one tensor


def adamw_update(param, grad, m, v, *, step, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                 grad_scale=1.0, working=None, zero_grad=False, found_inf=None):
    """One AdamW step for one tensor, in place on ``param``, ``m``, ``v`` (all fp32, same shape).

    ``step``: the 1-based number of this update (bias corrections use β^step): an int, or on CuPy a
    0-d int32 device array holding it. ``grad``: fp32, fp16 or bf16, same shape. ``lr`` and
    ``grad_scale``: floats, or 0-d fp32 arrays on the same device (the unscale × clip factor stays
    on the GPU). Extras: ``working`` (same shape, fp32/fp16/bf16) receives the updated weights cast
    to its dtype; ``zero_grad`` zeroes ``grad`` after use; ``found_inf`` (0-d fp32) skips the update
    when nonzero.
    """
    xp = array_module(param=param, grad=grad, m=m, v=v, working=working)
    check_array("param", param, dtype=_F32)
    check_array("grad", grad, shape=param.shape, dtypes=GPU_DTYPES)
    check_array("m", m, shape=param.shape, dtype=_F32)
    check_array("v", v, shape=param.shape, dtype=_F32)
    if working is not None:
        check_array("working", working, shape=param.shape, dtypes=GPU_DTYPES)
    _check_hyperparameters("adamw_update", beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step_dev = _is_device_scalar(step)
    if step_dev:
        _check_scalar_array("step", step, xp, np.int32)
    elif int(step) < 1:
        raise ValueError(f"step is 1-based (the number of this update), got {step}")
    _check_step_scalars(lr, grad_scale, found_inf, xp)

    if xp is np:
        if found_inf is not None and _host_value(found_inf) != 0.0:
            if zero_grad:
                grad[...] = 0
            return param
        t = int(np.asarray(step).reshape(())) if step_dev else int(step)
        _adamw_numpy(param, grad, m, v, t=t, lr=_host_value(lr), beta1=beta1, beta2=beta2, eps=eps,
                     decay=weight_decay, grad_scale=_host_value(grad_scale))
        if working is not None and working is not param:
            working[...] = param.astype(working.dtype)
        if zero_grad:
            grad[...] = 0
        return param

    n = param.size
    launch_flat(
        xp, p=param, g=grad, m=m, v=v, w=working, n=n, decay_end=n if weight_decay else 0,
        lr=lr, grad_scale=grad_scale, found_inf=found_inf,
        step=step if step_dev else None, step_value=0 if step_dev else int(step), step_is_next=True,
        counter=None, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        zero_grad=zero_grad,
    )
    return param


def launch_flat(xp, *, p, g, m, v, w, n, decay_end, lr, grad_scale, found_inf, step, step_value,
                step_is_next, counter, beta1, beta2, eps, weight_decay, zero_grad, extra_flags=0):
    """Launch adamw_kernel once over n elements (CuPy arrays; validation done by the caller).

    ``step``: None (use ``step_value`` as t), or a 0-d int32 device array. With ``step_is_next`` the
    array holds t itself and is only read; otherwise it holds the completed steps (t − 1), and when
    ``counter`` (a 1-element uint32 device array, zero between launches) is given the kernel's last
    block advances it.
    """

    flags = extra_flags
    dummy = p  # any device pointer for the unused pointer arguments
    lr_val, lr_ptr = (0.0, lr) if _is_device_scalar(lr) else (float(lr), dummy)
    flags |= LR_PTR if _is_device_scalar(lr) else 0
    gs_val, gs_ptr = (1.0, grad_scale) if _is_device_scalar(grad_scale) else (float(grad_scale), dummy)
    flags |= GS_PTR if _is_device_scalar(grad_scale) else 0
    if found_inf is not None:
        flags |= FOUND_INF
    step_ptr = dummy
    if step is not None:
        # the kernel uses t = step[0] + step_value: +1 for a counter of completed steps
        step_ptr, step_value = step, (0 if step_is_next else 1)
        flags |= STEP_PTR
    if counter is not None:
        flags |= INCREMENT
    if zero_grad:
        flags |= ZERO_GRAD
    write_w = w is not None and w is not p
    if write_w:
        flags |= WRITE_WORKING
    if elements_aligned(4, p, g, m, v, w if write_w else None):  # the kernel's 4-wide groups
        flags |= VEC
    wt = w.dtype if write_w else _F32
    kern = get_kernel("adamw", "adamw_kernel", g.dtype, wt)
    kern(
        (resident_grid(kern, -(-n // 8), THREADS, xp),), (THREADS,),  # 2 groups of 4 per thread
        (p, g, m, v, w if write_w else dummy, np.int64(n), np.int64(decay_end),
         np.float32(lr_val), lr_ptr, np.float32(gs_val), gs_ptr,
         found_inf if found_inf is not None else dummy,
         step_ptr, np.int32(step_value),
         counter if counter is not None else dummy,
         np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(weight_decay), np.int32(flags)),
    )


# --------------------------------------------------------------------------- the optimizer


class AdamW:
    """AdamW over a ``FlatParams``: one kernel launch per step (``per_tensor=True``: one per tensor).

    ``step(lr=None, grad_scale=1.0, found_inf=None, zero_grad=False)``: ``lr`` overrides the
    default (a float from the schedule, or a 0-d fp32 device array); ``grad_scale`` multiplies the
    gradient (1/loss-scale × clip coefficient; float or 0-d fp32 device array); ``found_inf`` (0-d
    fp32 device flag) skips the step on the device when nonzero: weights, moments, working copy and
    step count are left bit-identical (the gradient is still zeroed when ``zero_grad``). Nothing in
    ``step`` waits for the GPU.

    The step counter (completed steps) lives on the device in ``.step_count`` (0-d int32); read it
    with ``int(opt.step_count)`` outside the step, or use ``.steps_taken()``.
    """

    def __init__(self, params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, *, per_tensor=False):

        if not isinstance(params, FlatParams):
            raise TypeError(f"params must be a llmgpu.optim.FlatParams, got {type(params).__name__}")
        beta1, beta2 = betas
        _check_hyperparameters("AdamW", beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        check_float("lr", lr, low=0.0, where="AdamW")
        self.params = params
        self.xp = params.xp
        params.moments()  # the flat m and v exist from here on (FlatParams allocates them on first use)
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = float(lr), float(beta1), float(beta2), \
            float(eps), float(weight_decay)
        self.per_tensor = bool(per_tensor)
        self.step_count = self.xp.zeros((), dtype=np.int32)  # completed steps, on the device
        self._counter = self.xp.zeros(1, dtype=np.uint32)  # the kernel's last-block ticket (stays 0)

    # ---------------------------------------------------------------- step

    def step(self, lr=None, grad_scale=1.0, found_inf=None, zero_grad=False):
        P, xp = self.params, self.xp
        lr = self.lr if lr is None else lr
        _check_step_scalars(lr, grad_scale, found_inf, xp)
        if xp is np:
            return self._step_numpy(lr, grad_scale, found_inf, zero_grad)
        if self.per_tensor:
            return self._step_per_tensor(lr, grad_scale, found_inf, zero_grad)
        launch_flat(
            xp, p=P.data, g=P.grad, m=P.m, v=P.v, w=P.working, n=P.numel, decay_end=P.decay_end,
            lr=lr, grad_scale=grad_scale, found_inf=found_inf, step=self.step_count, step_value=0,
            step_is_next=False, counter=self._counter, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, zero_grad=zero_grad,
        )

    def _step_numpy(self, lr, grad_scale, found_inf, zero_grad):
        P = self.params
        if found_inf is not None and _host_value(found_inf) != 0.0:
            if zero_grad:
                P.zero_grad()
            return
        t = int(self.step_count) + 1
        if self.per_tensor:
            for name in P.names:
                adamw_update(P.param(name), P.grad_of(name), P.m_of(name), P.v_of(name), step=t, lr=lr,
                             beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                             weight_decay=self.weight_decay if P.decay[name] else 0.0, grad_scale=grad_scale)
        else:
            # the flat buffer in two slices: [0, decay_end) with decay, the rest without
            for sl, wd in ((slice(0, P.decay_end), self.weight_decay), (slice(P.decay_end, P.numel), 0.0)):
                _adamw_numpy(P.data[sl], P.grad[sl], P.m[sl], P.v[sl], t=t, lr=_host_value(lr), beta1=self.beta1,
                             beta2=self.beta2, eps=self.eps, decay=wd, grad_scale=_host_value(grad_scale))
        self.step_count[...] = t
        P.sync_working()
        if zero_grad:
            P.zero_grad()

    def _step_per_tensor(self, lr, grad_scale, found_inf, zero_grad):
        """The naive baseline: one launch per parameter tensor (148 for GPT-2 small)."""
        P, xp = self.params, self.xp
        order = [s[0] for s in P.segments()]
        for k, name in enumerate(order):
            last = k == len(order) - 1
            launch_flat(
                xp, p=P.param(name), g=P.grad_of(name), m=P.m_of(name), v=P.v_of(name),
                w=P.weight(name) if P.working is not P.data else None, n=P.sizes[name],
                decay_end=P.sizes[name] if P.decay[name] else 0, lr=lr, grad_scale=grad_scale,
                found_inf=found_inf, step=self.step_count, step_value=0, step_is_next=False,
                # only the last launch advances the counter: the others must all read the old value
                counter=self._counter if last else None,
                beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                zero_grad=zero_grad,
            )

    # ---------------------------------------------------------------- state

    def steps_taken(self) -> int:
        """Completed (not skipped) steps. Reads the device: call it outside the training step."""
        return int(backend.to_numpy(self.step_count))

    def state_dict(self) -> dict:
        """m, v (name → NumPy fp32), the step count and the hyperparameters (host copies)."""
        P = self.params
        m, v = backend.to_numpy(P.m), backend.to_numpy(P.v)

        def split(buf):
            return {n: buf[P.offsets[n]: P.offsets[n] + P.sizes[n]].reshape(P.shapes[n]).copy() for n in P.names}

        return {"m": split(m), "v": split(v), **self.scalars_state()}

    def scalars_state(self) -> dict:
        """The state without the moments: the step count and the hyperparameters."""
        return {"step": self.steps_taken(), "lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state_dict(self, state: dict):
        P = self.params
        for key, buf in (("m", P.m), ("v", P.v)):
            buf[...] = backend.to_device(P.flatten(state[key], what=f"load_state_dict: {key}"), self.xp)
        self.load_scalars_state(state)

    def load_scalars_state(self, state: dict):
        """The step count and the hyperparameters of a ``state_dict`` (checked), without the moments."""
        lr, (b1, b2) = state.get("lr", self.lr), state.get("betas", (self.beta1, self.beta2))
        eps, wd = state.get("eps", self.eps), state.get("weight_decay", self.weight_decay)
        _check_hyperparameters("AdamW.load_state_dict", beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        check_float("lr", lr, low=0.0, where="AdamW.load_state_dict")
        self.step_count[...] = int(state["step"])
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = float(lr), float(b1), float(b2), float(eps), \
            float(wd)
