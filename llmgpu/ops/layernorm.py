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
  forward), dgamma/dbeta reduced in a fixed order (bitwise identical run to run, no atomics);
* ``"fast"``       the backward written for bandwidth: the row in registers and read once, the next
  row's loads in flight while the current one is reduced (two rows per warp), gamma in shared
  memory, optional ``dresidual`` added into dx and ``accumulate_params`` added into fp32 gradient
  buffers in the same kernels; deterministic too. Rows it cannot take (C not a multiple of 8 for
  fp16/bf16 or 4 for fp32, unaligned pointers, C above 2048 (16-bit) or 768 (fp32)) run the
  "optimized" kernels. Its forward is the "optimized" one.

``add_layernorm_forward(a, b, gamma, beta)`` fuses the residual add in front of the forward (the
transformer's ``x = x + attn(...)`` followed by ``ln_2(x)``): one pass that writes both the new
residual stream ``s = a + b`` (rounded to the storage dtype) and ``y = LayerNorm(s)``.

Storage dtypes fp32, fp16, bf16 (x, gamma, beta, dy share one dtype); all arithmetic is fp32. The
NumPy reference computes in fp32 (float64 for float64 input, used by the finite-difference checks).

This module is long because it holds the three backward variants chapter 3 compares (naive → optimized →
fast), the fused residual forms chapter 8 uses, their launch plans and one NumPy reference for all of them:
splitting it would separate each kernel's launcher from the variants it is measured against.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_alias,
    check_array,
    check_bool,
    check_choice,
    check_float,
    check_gpu_dtype,
    check_method,
    check_out,
    check_param_grad_dtype,
    check_row_stats,
    check_same_dtype,
    overlaps,
    reference_dtype,
)
from ..kernels import get_kernel, loader
from ..kernels.launch import SMEM_WITHOUT_OPT_IN, opt_in_shared_memory, persistent_grid, resident_blocks, vector_width

METHODS = ("naive", "optimized", "fast")
ACCUMULATORS = ("registers", "shared")  # where the backward kernels sum dgamma/dbeta (``accumulators=``)



def _declared(function: str, index: int) -> dict[str, list[int]]:
    """{C type (the first template argument): sorted values of template argument ``index``} over the instantiations
    of ``function`` that layernorm.cu's ``// llmgpu:kernel`` lines declare."""
    out: dict = {}
    for e in loader.name_expressions("layernorm"):
        if e.startswith(function + "<"):
            args = [a.strip() for a in e[len(function) + 1:-1].split(",")]
            out.setdefault(args[0], set()).add(int(args[index]))
    return {t: sorted(v) for t, v in out.items()}


# Packs per lane (of 16 bytes each) the register variants are instantiated for (forward, backward, add + LN: the
# packs all three declare; 0 and -1 are the shared-memory and re-read variants)
_REGISTER_PACKS = tuple(sorted(set.intersection(*(
    {p for ps in _declared(f, i).values() for p in ps if p > 0}
    for f, i in (("layernorm_forward_warp", 2), ("layernorm_backward_warp", 2), ("add_layernorm_forward_warp", 1))))))
_SMEM_DEFAULT = SMEM_WITHOUT_OPT_IN
_FWD_WARPS = 4  # rows (warps) per block in the forward
_BWD_WARPS = 8  # rows (warps) per block in the backward
# "fast" backward: packs per lane it is instantiated for, by element size (C <= 32 * W * P_max), and warps
# per block (layernorm_backward_fast assumes 8: its launch bounds and shared-memory plan are written for it).
_C_SIZE = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
_FAST_PACKS = {size: tuple(sorted(set.intersection(*(set(p) for t, p in _declared("layernorm_backward_fast", 1).items()
                                                      if _C_SIZE[t] == size)))) for size in (2, 4)}
_FAST_WARPS = 8
# 16-bit "fast" backward: dgamma/dbeta accumulators in shared memory by default (SACC, blocks of 4 warps,
# <= 80 registers: 6 blocks per SM) instead of registers (blocks of 8 warps, ~128 registers: 2 per SM);
# accumulators="registers" times the other variant where it exists (P <= 4: C <= 1024). fp32 has the
# register variant only.
_FAST_SACC_WARPS = 4
_FAST_REGISTER_PACKS = 4
_PLANS = {}  # (kernel expression, device, n_rows, C) -> (blocks, threads, smem): no driver queries per call
ADD_WARPS = 4  # rows (warps) per block in add_layernorm_forward


# --------------------------------------------------------------------------- validation


def rows_of(x, name="x"):
    if x.ndim < 2:
        raise ValueError(f"{name} must be at least 2-D ([N, C] or [..., C]), got shape {tuple(x.shape)}")
    return math.prod(x.shape[:-1]), x.shape[-1]


def check_gpu_rows(x, n_rows, c, name="x"):
    check_gpu_dtype(name, x)
    if n_rows >= 2**31 or c >= 2**31:
        raise ValueError(f"N and C must be below 2**31, got N={n_rows}, C={c}")


def _param_grad_dtype(gamma, dgamma_out, dbeta_out):
    """dtype of dgamma/dbeta: gamma's, or fp32 when the caller passes fp32 buffers (both alike)."""
    for name, o in (("dgamma_out", dgamma_out), ("dbeta_out", dbeta_out)):
        check_param_grad_dtype(name, o, "gamma", gamma)
    if dgamma_out is not None and dbeta_out is not None and dgamma_out.dtype != dbeta_out.dtype:
        raise TypeError(f"dgamma_out and dbeta_out must share one dtype, got {dgamma_out.dtype} and {dbeta_out.dtype}")
    for o in (dgamma_out, dbeta_out):
        if o is not None:
            return o.dtype
    return gamma.dtype


# --------------------------------------------------------------------------- NumPy reference


_compute_dtype = reference_dtype


def layernorm_forward_reference(x2, gamma, beta, eps, *, rounded=True):
    """The math of the forward on NumPy arrays, rows ``x2 [N, C]``: returns (y, mean, rstd); ``rounded=False``
    leaves y in the compute dtype (what ``ops.fp8_layernorm`` casts to FP8)."""
    ct = _compute_dtype(x2.dtype)
    xf = x2.astype(ct)
    mean = xf.mean(axis=1)
    xc = xf - mean[:, None]
    var = (xc * xc).mean(axis=1)
    rstd = 1.0 / np.sqrt(var + ct(eps))
    y = xc * rstd[:, None] * gamma.astype(ct) + beta.astype(ct)
    return (y.astype(x2.dtype) if rounded else y), mean.astype(ct), rstd.astype(ct)


def _backward_math(dy2, x2, gamma, mean, rstd, dresidual=None):
    """(dx, dgamma, dbeta) in the compute dtype (float32, float64 for float64 input), not rounded."""
    ct = _compute_dtype(x2.dtype)
    xhat = (x2.astype(ct) - mean.astype(ct)[:, None]) * rstd.astype(ct)[:, None]
    d = dy2.astype(ct)
    g = d * gamma.astype(ct)
    dx = rstd.astype(ct)[:, None] * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if dresidual is not None:
        dx = dx + dresidual.astype(ct)
    dgamma = (d * xhat).sum(axis=0)
    dbeta = d.sum(axis=0)
    return dx, dgamma, dbeta


def layernorm_backward_reference(dy2, x2, gamma, mean, rstd, dresidual=None):
    """The math of the backward on NumPy arrays: returns (dx, dgamma, dbeta).

    With ``dresidual [N, C]`` the gradient of a residual branch around the LayerNorm is added to dx
    before the one rounding to x's dtype.
    """
    dx, dgamma, dbeta = _backward_math(dy2, x2, gamma, mean, rstd, dresidual)
    return dx.astype(x2.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


def add_layernorm_forward_reference(a2, b2, gamma, beta, eps, *, rounded=True):
    """The math of the fused residual add + forward on NumPy arrays ``[N, C]``: returns (s, y, mean, rstd).

    ``s = a + b`` rounded to the storage dtype first; the LayerNorm reads that rounded ``s`` (what the
    next layer and the backward will see), so y equals ``layernorm_forward_reference(s)``.
    """
    ct = _compute_dtype(a2.dtype)
    s = (a2.astype(ct) + b2.astype(ct)).astype(a2.dtype)
    return (s, *layernorm_forward_reference(s, gamma, beta, eps, rounded=rounded))


# --------------------------------------------------------------------------- public API


def layernorm_forward(x, gamma, beta, eps=1e-5, *, out=None, method="optimized"):
    """LayerNorm over the last axis: returns ``(y, mean, rstd)``.

    ``x [..., C]`` (at least 2-D), ``gamma [C]``, ``beta [C]`` of one dtype. ``y`` has x's shape and
    dtype (written into ``out`` when given); ``mean`` and ``rstd`` are fp32 shaped ``x.shape[:-1]``
    (float64 on the NumPy path for float64 input). ``method="fast"`` runs the "optimized" forward (a
    forward shaped like the fast backward did not beat it: dev/cuda/layernorm_forward_fast.py).
    """
    check_method("layernorm_forward", method, METHODS)
    xp = array_module(x=x, gamma=gamma, beta=beta, out=out)
    check_array("x", x)
    n_rows, c = rows_of(x)
    check_array("gamma", gamma, shape=(c,))
    check_array("beta", beta, shape=(c,))
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    eps = check_float("eps", eps, low=0.0)
    lead = tuple(x.shape[:-1])

    if xp is np:
        y, mean, rstd = layernorm_forward_reference(x.reshape(n_rows, c), gamma, beta, eps)
        y = y.reshape(x.shape)
        if out is not None:
            check_out(out, x.shape, x.dtype, xp)[...] = y
            y = out
        return y, mean.reshape(lead), rstd.reshape(lead)

    check_gpu_rows(x, n_rows, c)
    out = check_out(out, x.shape, x.dtype, xp)
    mean = xp.empty(lead, dtype=np.float32)
    rstd = xp.empty(lead, dtype=np.float32)
    args = (x, gamma, beta, out, mean, rstd, np.int32(n_rows), np.int32(c), np.float32(eps))
    if method == "naive":
        threads = 128
        get_kernel("layernorm", "layernorm_forward_naive", x.dtype)((-(-n_rows // threads),), (threads,), args)
        return out, mean, rstd

    vec, packs = vector_plan(c, x.dtype, (x, gamma, beta, out))
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
                       dbeta_out=None, dresidual=None, accumulate_params=False, accumulators=None):
    """Gradients of LayerNorm from the saved statistics: returns ``(dx, dgamma, dbeta)``.

    ``dy`` and ``x`` share shape ``[..., C]`` and dtype with ``gamma [C]``; ``mean``, ``rstd`` are what
    ``layernorm_forward`` returned. dgamma/dbeta have gamma's dtype and are summed in fp32 in an
    order fixed by the shapes: on the GPU the same inputs give the same bits every run.

    ``dresidual`` (shape and dtype of dy): the gradient of a residual branch around the LayerNorm,
    added to dx (``dx = LN backward + dresidual``, rounded once; in the same kernel on "fast").
    ``dx_out`` may be ``dresidual`` itself (in place).
    ``accumulate_params=True`` adds the parameter gradients into ``dgamma_out``/``dbeta_out`` (then
    required) instead of overwriting them. Those buffers may be fp32 when gamma is fp16/bf16 (both
    the same dtype), so a model accumulates straight into its fp32 gradient buffers.
    ``accumulators`` ("registers" or "shared", for benchmarks comparing the variants): where the
    "optimized" and "fast" kernels sum dgamma/dbeta; None (default) takes each kernel's faster one.
    A kernel without the variant asked for runs the one it has (the naive kernels; the fp32 "fast"
    kernel: registers only; the 16-bit "fast" kernel for C above 1024 and "optimized" rows too long to
    hold in registers: shared memory only).
    """
    check_method("layernorm_backward", method, METHODS)
    if accumulators is not None:
        check_choice("accumulators", accumulators, ACCUMULATORS)
    xp = array_module(dy=dy, x=x, gamma=gamma, mean=mean, rstd=rstd, dx_out=dx_out, dgamma_out=dgamma_out,
                      dbeta_out=dbeta_out, dresidual=dresidual)
    check_array("x", x)
    n_rows, c = rows_of(x)
    check_array("dy", dy, shape=tuple(x.shape))
    check_array("gamma", gamma, shape=(c,))
    if dresidual is not None:
        check_array("dresidual", dresidual, shape=tuple(x.shape))
    check_same_dtype(dy=dy, x=x, gamma=gamma, dresidual=dresidual)
    check_row_stats("mean", mean, x, n_rows)
    check_row_stats("rstd", rstd, x, n_rows)
    accumulate = check_bool("accumulate_params", accumulate_params)
    if accumulate and (dgamma_out is None or dbeta_out is None):
        raise ValueError("accumulate_params=True adds into dgamma_out and dbeta_out: pass both buffers")
    pdt = _param_grad_dtype(gamma, dgamma_out, dbeta_out)
    if dx_out is not None:
        check_out(dx_out, x.shape, x.dtype, xp, name="dx_out")
    for name, o in (("dgamma_out", dgamma_out), ("dbeta_out", dbeta_out)):
        if o is not None:
            check_out(o, (c,), pdt, xp, name=name)
    check_alias("dx_out", dx_out, "dresidual", dresidual)
    if overlaps(dgamma_out, dbeta_out):
        raise ValueError("dgamma_out and dbeta_out must be separate buffers")

    if xp is np:
        dres2 = None if dresidual is None else dresidual.reshape(n_rows, c)
        dx, dgamma, dbeta = _backward_math(dy.reshape(n_rows, c), x.reshape(n_rows, c), gamma,
                                           mean.reshape(n_rows), rstd.reshape(n_rows), dres2)
        dx = dx.astype(x.dtype).reshape(x.shape)
        if dx_out is not None:
            dx_out[...] = dx
            dx = dx_out
        grads = []
        for val, o in ((dgamma, dgamma_out), (dbeta, dbeta_out)):
            if accumulate:
                o[...] = (o.astype(val.dtype) + val).astype(o.dtype)
            elif o is not None:
                o[...] = val.astype(pdt)
            else:
                o = val.astype(pdt)
            grads.append(o)
        return dx, grads[0], grads[1]

    check_gpu_rows(x, n_rows, c)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.dtype != np.float32:
            raise TypeError(f"{name} must be fp32 on the GPU path, got {a.dtype}")
    dx = xp.empty(x.shape, dtype=x.dtype) if dx_out is None else dx_out
    dgamma = xp.empty((c,), dtype=pdt) if dgamma_out is None else dgamma_out
    dbeta = xp.empty((c,), dtype=pdt) if dbeta_out is None else dbeta_out

    if method == "fast":
        if _backward_fast(dy, x, gamma, mean, rstd, dresidual, dx, dgamma, dbeta, accumulate, n_rows, c, xp,
                          accumulators):
            return dx, dgamma, dbeta
        method = "optimized"  # rows the fast kernel does not take

    # "naive" / "optimized" (and "fast"'s fallback): the LayerNorm gradients from their kernels, then
    # the residual gradient and the accumulation with plain array operations (fp32 math, one rounding).
    ln_dx = xp.empty_like(dx) if overlaps(dx, dresidual) else dx
    kg, kb = (xp.empty((c,), dtype=np.float32), xp.empty((c,), dtype=np.float32)) if accumulate else (dgamma, dbeta)
    _backward_kernels(method, dy, x, gamma, mean, rstd, ln_dx, kg, kb, n_rows, c, xp, accumulators)
    if dresidual is not None:
        dx[...] = ln_dx.astype(np.float32, copy=False) + dresidual.astype(np.float32, copy=False)
    if accumulate:
        for o, k in ((dgamma, kg), (dbeta, kb)):
            o[...] = o.astype(np.float32, copy=False) + k
    return dx, dgamma, dbeta


def _backward_kernels(method, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, n_rows, c, xp, accumulators=None):
    """The "naive" or "optimized" kernels: dx into ``dx``; dgamma/dbeta (gamma's dtype or fp32) overwritten."""
    if method == "optimized":
        vec, packs = vector_plan(c, x.dtype, (dy, x, gamma, dx))
        if accumulators == "shared":  # the shared-memory variant even where the row fits in registers
            packs = 0
        wpb = _BWD_WARPS
        if packs > 0:
            smem = 2 * c * 4  # the block's in-order sum at the end
        else:  # per-warp accumulators in shared memory: wpb * 2C floats
            wpb = max(1, min(_BWD_WARPS, _SMEM_DEFAULT // (8 * c)))
            smem = wpb * 8 * c
        kern = get_kernel("layernorm", "layernorm_backward_warp", x.dtype, int(vec), max(packs, 0))
        if not (smem > _SMEM_DEFAULT and not opt_in_shared_memory(kern, smem, xp)):
            blocks = min(-(-n_rows // wpb), resident_blocks(kern, 32 * wpb, smem, xp))
            partial = xp.empty((blocks, 2, c), dtype=np.float32)
            kern((blocks,), (32 * wpb,), (dy, x, gamma, mean, rstd, dx, partial, np.int32(n_rows), np.int32(c)),
                 shared_mem=smem)
            red = get_kernel("layernorm", "layernorm_param_grad_reduce", dgamma.dtype)
            red((-(-2 * c // 32),), (32, 16), (partial, np.int32(blocks), np.int32(c), dgamma, dbeta))
            return
        # rows too long for any shared-memory plan: the naive kernels handle any C

    threads = 128
    get_kernel("layernorm", "layernorm_backward_naive_dx", x.dtype)(
        (-(-n_rows // threads),), (threads,), (dy, x, gamma, mean, rstd, dx, np.int32(n_rows), np.int32(c))
    )
    tg, tb = (dgamma, dbeta) if dgamma.dtype == x.dtype else (xp.empty((c,), x.dtype), xp.empty((c,), x.dtype))
    get_kernel("layernorm", "layernorm_backward_naive_dparams", x.dtype)(
        (-(-c // threads),), (threads,), (dy, x, mean, rstd, tg, tb, np.int32(n_rows), np.int32(c))
    )
    if tg is not dgamma:
        dgamma[...] = tg
        dbeta[...] = tb


def _fast_packs(c, dtype, arrays):
    """Packs per lane for the "fast" kernels, or None when C or a pointer does not suit them."""
    width = vector_width(dtype, c, *arrays)
    if width == 1:
        return None
    per_lane = -(-(c // width) // 32)
    return next((p for p in _FAST_PACKS[dtype.itemsize] if p >= per_lane), None)


def _persistent_plan(key, kern, threads, smem, n_rows, xp):
    """(blocks, threads, smem) of ``launch.persistent_grid``, cached per kernel, device and shape (the
    launch then costs no attribute queries)."""
    dev = xp.cuda.Device().id
    full = (key, dev, n_rows, threads, smem)
    plan = _PLANS.get(full)
    if plan is None:
        plan = _PLANS[full] = (persistent_grid(kern, n_rows, threads, smem, xp), threads, smem)
    return plan


def backward_fast_plan(n_rows, c, dtype, *, residual=False, xp=None):
    """The "fast" backward's launch for ``[n_rows, c]`` rows of ``dtype`` (16-byte aligned arrays):
    ``(kernel, blocks, threads, shared_mem)`` of layernorm_backward_fast, or None when the rows do not
    suit it (C not a multiple of the pack width, rows too long, row indices past 32 bits). The second
    stage, layernorm_param_grad_finish, then adds ``blocks`` partial rows. The launcher's plan with the
    default accumulators (``_fast_backward_plan`` takes the choice); used by
    tools/probes/probe_layernorm_backward.py."""
    return _fast_backward_plan(n_rows, c, dtype, residual, None, xp)


def _fast_backward_plan(n_rows, c, dtype, residual, accumulators, xp):
    """``backward_fast_plan`` with ``accumulators`` (None, "registers", "shared") as in layernorm_backward."""
    xp = backend.default_xp() if xp is None else xp
    dtype = backend.resolve_dtype(dtype)
    packs = _fast_packs(c, dtype, ())
    if packs is None:
        return None
    width = 16 // dtype.itemsize
    sacc = int(dtype.itemsize == 2 and (accumulators != "registers" or packs > _FAST_REGISTER_PACKS))
    kern = get_kernel("layernorm", "layernorm_backward_fast", dtype, packs, int(residual), sacc)
    if sacc:  # gamma (fp32 float4 table), then every warp's dgamma/dbeta slots (above 48 KB from P = 6)
        warps = _FAST_SACC_WARPS
        smem = 16 * 32 * packs * (width // 4) * (1 + 2 * warps)
    else:  # gamma (fp32), then the block's dgamma/dbeta slab
        warps = _FAST_WARPS
        smem = 4 * max(32 * packs * width, warps * c)
    if not opt_in_shared_memory(kern, smem, xp):
        return None
    # As many rows per warp as one wave of resident warps needs, then as few blocks as give every
    # warp that many: all warps finish together and there are fewer partial rows to add.
    blocks, threads, smem = _persistent_plan(("bwd", dtype, packs, residual, sacc, c), kern, 32 * warps, smem,
                                             n_rows, xp)
    if n_rows + blocks * warps >= 2**31:  # the kernel's row indices are 32-bit
        return None
    return kern, blocks, threads, smem


def _backward_fast(dy, x, gamma, mean, rstd, dres, dx, dgamma, dbeta, accumulate, n_rows, c, xp, accumulators=None):
    """Launch layernorm_backward_fast + layernorm_param_grad_finish; False if the rows do not fit it."""
    if vector_width(x.dtype, c, *((dy, x, dx) if dres is None else (dy, x, dx, dres))) == 1:
        return False
    plan = _fast_backward_plan(n_rows, c, x.dtype, dres is not None, accumulators, xp)
    if plan is None:
        return False
    kern, blocks, threads, smem = plan
    partial = xp.empty((blocks, 2, c), dtype=np.float32)
    kern((blocks,), (threads,),
         (dy, x, gamma, mean, rstd, dy if dres is None else dres, dx, partial, np.int32(n_rows), np.int32(c)),
         shared_mem=smem)
    fin = get_kernel("layernorm", "layernorm_param_grad_finish", dgamma.dtype, int(accumulate))
    fin((-(-2 * c // 32),), (32, 32), (partial, np.int32(blocks), np.int32(c), dgamma, dbeta))
    return True


def add_layernorm_forward(a, b, gamma, beta, eps=1e-5, *, residual_out=None, out=None):
    """Residual add and LayerNorm in one pass: returns ``(s, y, mean, rstd)``.

    ``s = a + b`` (the residual stream, rounded to a's dtype) and ``y = LayerNorm(s)`` computed from
    that rounded ``s``, so ``y`` equals ``layernorm_forward(s)`` up to the order of the sums.
    ``a``, ``b`` share shape ``[..., C]`` and dtype with ``gamma [C]`` and ``beta [C]``. ``s`` goes to
    ``residual_out`` when given, which may be ``a`` or ``b`` itself (in place); ``y`` goes to ``out``
    (its own buffer). ``mean``/``rstd`` as in ``layernorm_forward``. On the GPU one kernel reads a, b
    and writes s, y, mean, rstd (rows it cannot take, see ``"fast"``, run an add and the forward).
    """
    xp = array_module(a=a, b=b, gamma=gamma, beta=beta, residual_out=residual_out, out=out)
    check_array("a", a)
    n_rows, c = rows_of(a, "a")
    check_array("b", b, shape=tuple(a.shape))
    check_array("gamma", gamma, shape=(c,))
    check_array("beta", beta, shape=(c,))
    check_same_dtype(a=a, b=b, gamma=gamma, beta=beta)
    eps = check_float("eps", eps, low=0.0)
    if residual_out is not None:
        check_out(residual_out, a.shape, a.dtype, xp, name="residual_out")
    if out is not None:
        check_out(out, a.shape, a.dtype, xp, name="out")
    check_alias("residual_out", residual_out, "a", a)
    check_alias("residual_out", residual_out, "b", b)
    for name, other in (("a", a), ("b", b), ("residual_out", residual_out)):
        if overlaps(out, other):
            raise ValueError(f"out overlaps {name}: y needs a buffer of its own")
    lead = tuple(a.shape[:-1])

    if xp is np:
        s, y, mean, rstd = add_layernorm_forward_reference(a.reshape(n_rows, c), b.reshape(n_rows, c), gamma, beta,
                                                           eps)
        s, y = s.reshape(a.shape), y.reshape(a.shape)
        if residual_out is not None:
            residual_out[...] = s
            s = residual_out
        if out is not None:
            out[...] = y
            y = out
        return s, y, mean.reshape(lead), rstd.reshape(lead)

    check_gpu_rows(a, n_rows, c, name="a")
    s = xp.empty(a.shape, dtype=a.dtype) if residual_out is None else residual_out
    y = xp.empty(a.shape, dtype=a.dtype) if out is None else out
    vec, packs = vector_plan(c, a.dtype, (a, b, s, y, gamma, beta))
    if vec and packs > 0:
        mean = xp.empty(lead, dtype=np.float32)
        rstd = xp.empty(lead, dtype=np.float32)
        kern = get_kernel("layernorm", "add_layernorm_forward_warp", a.dtype, packs)
        kern((-(-n_rows // ADD_WARPS),), (32 * ADD_WARPS,),
             (a, b, gamma, beta, s, y, mean, rstd, np.int32(n_rows), np.int32(c), np.float32(eps)))
        return s, y, mean, rstd
    # unaligned, C not a multiple of the pack width, or rows too long to hold: add (fp32, one rounding),
    # then the forward on the rounded sum
    s[...] = a.astype(np.float32, copy=False) + b.astype(np.float32, copy=False)
    y, mean, rstd = layernorm_forward(s, gamma, beta, eps, out=y)
    return s, y, mean, rstd


# --------------------------------------------------------------------------- launch planning


def vector_plan(c, dtype, arrays):
    """(vec, packs): 16-byte packs when C is a multiple of the pack width and every pointer is
    16-byte aligned; packs = registers per lane (1..8), 0 for the shared-memory variant."""
    width = vector_width(dtype, c, *arrays)
    if width == 1:
        return False, 0
    per_lane = -(-(c // width) // 32)
    for p in _REGISTER_PACKS:
        if p >= per_lane:
            return True, p
    return True, 0


# --------------------------------------------------------------------------- bandwidth accounting


def traffic_bytes(n_rows, c, dtype, backward=False, *, residual=False):
    """Minimum bytes a LayerNorm pass moves: each input read once, each output written once.

    ``residual=True``: the fused variants, ``add_layernorm_forward`` (also reads b, writes s) and the
    backward with ``dresidual`` (also reads dresidual).
    """
    s = backend.resolve_dtype(dtype).itemsize
    rows = n_rows * c * s
    if backward:  # read dy, x, gamma, mean, rstd (, dresidual); write dx, dgamma, dbeta
        return (4 if residual else 3) * rows + 3 * c * s + 8 * n_rows
    # read x (a, b), gamma, beta; write y (, s), mean, rstd
    return (4 if residual else 2) * rows + 2 * c * s + 8 * n_rows


__all__ = [
    "ACCUMULATORS",
    "METHODS",
    "add_layernorm_forward",
    "add_layernorm_forward_reference",
    "backward_fast_plan",
    "layernorm_backward",
    "layernorm_backward_reference",
    "layernorm_forward",
    "layernorm_forward_reference",
    "traffic_bytes",
]
