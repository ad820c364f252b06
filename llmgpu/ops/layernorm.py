"""LayerNorm forward and backward with saved statistics (chapter 3, ``kernels/layernorm.cu``).

Over the last axis of ``x`` (C channels; all leading axes are rows, N of them)::

    mean = sum(x) / C,   rstd = 1 / sqrt(sum((x - mean)**2) / C + eps)
    y    = (x - mean) * rstd * gamma + beta

The forward returns ``mean`` and ``rstd`` (fp32, shaped like ``x.shape[:-1]``) next to ``y``: the
backward needs ``xhat = (x - mean) * rstd`` and with the statistics saved it is one subtract and one
multiply away, instead of two fresh reductions per row::

    g  = dy * gamma
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (means over the C channels of a row)
    dgamma = sum over rows of dy * xhat,   dbeta = sum over rows of dy

``method`` picks the CUDA kernels (NumPy arrays always run the reference):

* ``"naive"``      one thread per row (and one per column for dgamma/dbeta);
* ``"optimized"``  one warp per row, 16-byte loads, the row kept in registers (one read of x in the
  forward), dgamma/dbeta reduced in a fixed order (bitwise identical run to run, no atomics).

Storage dtypes fp32, fp16, bf16 (x, gamma, beta, dy share one dtype); all arithmetic is fp32. The
NumPy reference computes in fp32 (float64 for float64 input, used by the finite-difference checks).
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_choice, check_out, check_same_dtype, reference_dtype
from ..kernels import get_kernel

METHODS = ("naive", "optimized")
GPU_DTYPES = (backend.float32, backend.float16, backend.bfloat16)

# Packs per lane (of 16 bytes each) the register variants are instantiated for; see layernorm.cu.
_REGISTER_PACKS = (1, 2, 3, 4, 6, 8)
_SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
_FWD_WARPS = 4  # rows (warps) per block in the forward
_BWD_WARPS = 8  # rows (warps) per block in the backward
_FORCE_SMEM_ACCUMULATORS = False  # benchmark hook: take the shared-memory variant even where registers fit


# --------------------------------------------------------------------------- validation


def _check_method(method):
    check_choice("method", method, METHODS)


def _rows(x):
    if x.ndim < 2:
        raise ValueError(f"x must be at least 2-D ([N, C] or [..., C]), got shape {tuple(x.shape)}")
    return math.prod(x.shape[:-1]), x.shape[-1]


def _check_gpu(x, n_rows, c):
    if x.dtype not in GPU_DTYPES:
        raise TypeError(f"the CUDA kernels take fp32, fp16 or bf16, got {x.dtype} (float64 runs on NumPy only)")
    if n_rows >= 2**31 or c >= 2**31:
        raise ValueError(f"N and C must be below 2**31, got N={n_rows}, C={c}")


def _check_stats(name, a, x, n_rows):
    check_array(name, a, dtypes=(backend.float32, backend.float64))
    if tuple(a.shape) not in (tuple(x.shape[:-1]), (n_rows,)):
        raise ValueError(f"{name} must have shape {tuple(x.shape[:-1])} (or ({n_rows},)), got {tuple(a.shape)}")


# --------------------------------------------------------------------------- NumPy reference


_compute_dtype = reference_dtype


def layernorm_forward_reference(x2, gamma, beta, eps):
    """The math of the forward on NumPy arrays, rows ``x2 [N, C]``: returns (y, mean, rstd)."""
    ct = _compute_dtype(x2.dtype)
    xf = x2.astype(ct)
    mean = xf.mean(axis=1)
    xc = xf - mean[:, None]
    var = (xc * xc).mean(axis=1)
    rstd = 1.0 / np.sqrt(var + ct(eps))
    y = xc * rstd[:, None] * gamma.astype(ct) + beta.astype(ct)
    return y.astype(x2.dtype), mean.astype(ct), rstd.astype(ct)


def layernorm_backward_reference(dy2, x2, gamma, mean, rstd):
    """The math of the backward on NumPy arrays: returns (dx, dgamma, dbeta)."""
    ct = _compute_dtype(x2.dtype)
    xhat = (x2.astype(ct) - mean.astype(ct)[:, None]) * rstd.astype(ct)[:, None]
    d = dy2.astype(ct)
    g = d * gamma.astype(ct)
    dx = rstd.astype(ct)[:, None] * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    dgamma = (d * xhat).sum(axis=0)
    dbeta = d.sum(axis=0)
    return dx.astype(x2.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


# --------------------------------------------------------------------------- public API


def layernorm_forward(x, gamma, beta, eps=1e-5, *, out=None, method="optimized"):
    """LayerNorm over the last axis: returns ``(y, mean, rstd)``.

    ``x [..., C]`` (at least 2-D), ``gamma [C]``, ``beta [C]`` of one dtype. ``y`` has x's shape and
    dtype (written into ``out`` when given); ``mean`` and ``rstd`` are fp32 shaped ``x.shape[:-1]``
    (float64 on the NumPy path for float64 input).
    """
    _check_method(method)
    xp = array_module(x=x, gamma=gamma, beta=beta, out=out)
    check_array("x", x)
    n_rows, c = _rows(x)
    check_array("gamma", gamma, shape=(c,))
    check_array("beta", beta, shape=(c,))
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    lead = tuple(x.shape[:-1])

    if xp is np:
        y, mean, rstd = layernorm_forward_reference(x.reshape(n_rows, c), gamma, beta, eps)
        y = y.reshape(x.shape)
        if out is not None:
            check_out(out, x.shape, x.dtype, xp)[...] = y
            y = out
        return y, mean.reshape(lead), rstd.reshape(lead)

    _check_gpu(x, n_rows, c)
    out = check_out(out, x.shape, x.dtype, xp)
    mean = xp.empty(lead, dtype=np.float32)
    rstd = xp.empty(lead, dtype=np.float32)
    args = (x, gamma, beta, out, mean, rstd, np.int32(n_rows), np.int32(c), np.float32(eps))
    if method == "naive":
        threads = 128
        get_kernel("layernorm", "layernorm_forward_naive", x.dtype)((-(-n_rows // threads),), (threads,), args)
        return out, mean, rstd

    vec, packs = _vector_plan(c, x.dtype, (x, gamma, beta, out))
    wpb = _FWD_WARPS
    smem = 0
    if packs == 0:  # the row cached in shared memory: wpb * C floats
        wpb = max(1, min(_FWD_WARPS, _SMEM_DEFAULT // (4 * c)))
        smem = wpb * 4 * c
        if smem > _SMEM_DEFAULT:
            packs, smem, wpb = -1, 0, _FWD_WARPS  # too long to cache: re-read x from L1/L2
    kern = get_kernel("layernorm", "layernorm_forward_warp", x.dtype, int(vec), packs)
    kern((-(-n_rows // wpb),), (32 * wpb,), args, shared_mem=smem)
    return out, mean, rstd


def layernorm_backward(dy, x, gamma, mean, rstd, *, method="optimized", dx_out=None, dgamma_out=None,
                       dbeta_out=None):
    """Gradients of LayerNorm from the saved statistics: returns ``(dx, dgamma, dbeta)``.

    ``dy`` and ``x`` share shape ``[..., C]`` and dtype with ``gamma [C]``; ``mean``, ``rstd`` are what
    ``layernorm_forward`` returned. dgamma/dbeta have gamma's dtype and are summed in fp32 in an
    order fixed by the shapes: on the GPU the same inputs give the same bits every run.
    """
    _check_method(method)
    xp = array_module(dy=dy, x=x, gamma=gamma, mean=mean, rstd=rstd, dx_out=dx_out, dgamma_out=dgamma_out,
                      dbeta_out=dbeta_out)
    check_array("x", x)
    n_rows, c = _rows(x)
    check_array("dy", dy, shape=tuple(x.shape))
    check_array("gamma", gamma, shape=(c,))
    check_same_dtype(dy=dy, x=x, gamma=gamma)
    _check_stats("mean", mean, x, n_rows)
    _check_stats("rstd", rstd, x, n_rows)

    if xp is np:
        dx, dgamma, dbeta = layernorm_backward_reference(
            dy.reshape(n_rows, c), x.reshape(n_rows, c), gamma, mean.reshape(n_rows), rstd.reshape(n_rows)
        )
        dx = dx.reshape(x.shape)
        res = []
        outs = (("dx_out", dx, dx_out), ("dgamma_out", dgamma, dgamma_out), ("dbeta_out", dbeta, dbeta_out))
        for name, val, o in outs:
            if o is not None:
                check_out(o, val.shape, val.dtype, xp, name=name)[...] = val
                val = o
            res.append(val)
        return tuple(res)

    _check_gpu(x, n_rows, c)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.dtype != np.float32:
            raise TypeError(f"{name} must be fp32 on the GPU path, got {a.dtype}")
    dx = check_out(dx_out, x.shape, x.dtype, xp, name="dx_out")
    dgamma = check_out(dgamma_out, (c,), gamma.dtype, xp, name="dgamma_out")
    dbeta = check_out(dbeta_out, (c,), gamma.dtype, xp, name="dbeta_out")

    if method == "optimized":
        vec, packs = _vector_plan(c, x.dtype, (dy, x, gamma, dx))
        if _FORCE_SMEM_ACCUMULATORS:
            packs = 0
        wpb = _BWD_WARPS
        if packs > 0:
            smem = 2 * c * 4  # the block's in-order sum at the end
        else:  # per-warp accumulators in shared memory: wpb * 2C floats
            wpb = max(1, min(_BWD_WARPS, _SMEM_DEFAULT // (8 * c)))
            smem = wpb * 8 * c
        kern = get_kernel("layernorm", "layernorm_backward_warp", x.dtype, int(vec), max(packs, 0))
        if smem > _SMEM_DEFAULT and not _opt_in_shared_memory(kern, smem, xp):
            method = "naive"  # rows too long for any shared-memory plan: the naive kernels handle any C
        else:
            blocks = min(-(-n_rows // wpb), _resident_blocks(kern, 32 * wpb, smem, xp))
            partial = xp.empty((blocks, 2, c), dtype=np.float32)
            kern((blocks,), (32 * wpb,), (dy, x, gamma, mean, rstd, dx, partial, np.int32(n_rows), np.int32(c)),
                 shared_mem=smem)
            red = get_kernel("layernorm", "layernorm_param_grad_reduce", gamma.dtype)
            red((-(-2 * c // 32),), (32, 16), (partial, np.int32(blocks), np.int32(c), dgamma, dbeta))
            return dx, dgamma, dbeta

    threads = 128
    get_kernel("layernorm", "layernorm_backward_naive_dx", x.dtype)(
        (-(-n_rows // threads),), (threads,), (dy, x, gamma, mean, rstd, dx, np.int32(n_rows), np.int32(c))
    )
    get_kernel("layernorm", "layernorm_backward_naive_dparams", x.dtype)(
        (-(-c // threads),), (threads,), (dy, x, mean, rstd, dgamma, dbeta, np.int32(n_rows), np.int32(c))
    )
    return dx, dgamma, dbeta


# --------------------------------------------------------------------------- launch planning


def _vector_plan(c, dtype, arrays):
    """(vec, packs): 16-byte packs when C is a multiple of the pack width and every pointer is
    16-byte aligned; packs = registers per lane (1..8), 0 for the shared-memory variant."""
    width = 16 // np.dtype(dtype).itemsize
    vec = c % width == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    if not vec:
        return False, 0
    per_lane = -(-(c // width) // 32)
    for p in _REGISTER_PACKS:
        if p >= per_lane:
            return True, p
    return True, 0


def _opt_in_shared_memory(kern, nbytes, xp):
    """Raise the kernel's dynamic shared-memory limit to ``nbytes`` if the device allows it."""
    limit = backend.device_info(xp).shared_memory_per_block_optin or _SMEM_DEFAULT
    if nbytes > limit:
        return False
    try:
        kern.max_dynamic_shared_size_bytes = nbytes
    except Exception:
        return False
    return True


def _resident_blocks(kern, threads, smem, xp):
    """How many blocks fill the GPU once (SMs x blocks per SM by registers, threads, shared memory)."""
    sms = backend.device_info(xp).sm_count or 1
    try:
        regs = int(kern.attributes["num_regs"])
    except Exception:
        regs = 64
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * (threads // 32))
    by_threads = 2048 // threads
    by_smem = (228 * 1024) // (smem + 1024) if smem else 32
    return sms * max(1, min(by_regs, by_threads, by_smem, 32))


# --------------------------------------------------------------------------- bandwidth accounting


def traffic_bytes(n_rows, c, dtype, backward=False):
    """Minimum bytes a LayerNorm pass moves: each input read once, each output written once."""
    s = backend.resolve_dtype(dtype).itemsize
    if backward:  # read dy, x, gamma, mean, rstd; write dx, dgamma, dbeta
        return 3 * n_rows * c * s + 3 * c * s + 8 * n_rows
    return 2 * n_rows * c * s + 2 * c * s + 8 * n_rows  # read x, gamma, beta; write y, mean, rstd


__all__ = [
    "METHODS",
    "layernorm_backward",
    "layernorm_backward_reference",
    "layernorm_forward",
    "layernorm_forward_reference",
    "traffic_bytes",
]
