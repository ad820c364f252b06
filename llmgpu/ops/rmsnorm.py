"""RMSNorm forward and backward with the saved statistic (Llama's normalization, ``kernels/rmsnorm.cu``).

Over the last axis of ``x`` (C channels; all leading axes are rows, N of them)::

    inv_rms = 1 / sqrt(mean(x**2) + eps)          (mean over the C channels of a row)
    y       = x * inv_rms * w

LayerNorm without the mean subtraction and without the bias. The forward returns ``inv_rms`` (fp32, one
per row, shaped ``x.shape[:-1]``) next to ``y``: with it saved, the backward needs no reduction over
x again, as chapter 3's LayerNorm tip says for ``mean``/``rstd``.

The backward, derived. Write ``r = inv_rms``, ``xhat = x r``, ``g = dy * w`` (for one row). Then
``y_i = w_i x_i r`` and, since ``r = (sum_k x_k**2 / C + eps) ** -1/2``, ``dr/dx_j = -r**3 x_j / C``. So::

    dx_j = sum_i dy_i w_i d(x_i r)/dx_j = g_j r + sum_i g_i x_i (-r**3 x_j / C)
         = r (g_j - xhat_j * mean(g * xhat))
    dw_i = sum over rows of dy_i * xhat_i

(LayerNorm's ``dx`` has one more term, ``- mean(g)``, from the mean it subtracts.)

Storage fp32, fp16 or bf16 (x, w, dy share one dtype), arithmetic fp32; float64 on the NumPy path
(the finite-difference checks). Against ``transformers``' ``LlamaRMSNorm``: it also computes in fp32,
but rounds ``x * inv_rms`` to the input dtype before multiplying by the weight (two roundings in bf16);
here ``y`` is rounded once, so the two differ by at most about one bf16 unit in the last place.

``dw`` is summed in fp32 in an order fixed by the shapes (bitwise identical run to run on the GPU, no
atomics: layernorm.cu's scheme). It has w's dtype, or fp32 when the caller passes an fp32 ``dweight``
buffer; ``accumulate=True`` adds into ``dweight`` (then required) instead of overwriting it, so a model
accumulates straight into its fp32 gradient buffer.

The residual stream around the norm, fused (chapter 8's ``add_layernorm_forward`` and ``dresidual`` for
RMSNorm; the same kernels with a template flag, one pass over memory each):

* ``add_rmsnorm_forward(x, a, w)`` writes ``s = x + a`` (rounded to the storage dtype; it may go over ``a``)
  and ``y = rmsnorm(s)`` computed from that rounded ``s``. The sums run in ``rmsnorm_forward``'s order, so
  on the GPU ``(s, y, inv_rms)`` are bitwise those of an add in the same dtype (any correctly rounded one:
  fp32 arithmetic rounded once to fp16/bf16 is, 24 >= 2 * 11 + 2 bits) followed by ``rmsnorm_forward(s)``,
  whenever both take the same kernel variant: every pointer 16-byte aligned or neither (fresh CuPy
  buffers are).
* ``rmsnorm_backward(..., dresidual=r)`` returns ``dx = rmsnorm's input gradient + r``, summed in fp32 and
  rounded once (``dx=r``: written over it). In fp32 storage that is bitwise the backward followed by an
  add; in fp16/bf16 the pair rounds twice and may differ from the fused result by a unit in the last
  place of the larger term.

Non-finite input: a NaN in row r of x makes ``inv_rms[r]`` and the whole row of y NaN; ±inf in a row
gives ``mean(x**2) = inf``, ``inv_rms = 0``, and y = 0 at the finite entries, NaN at the infinite ones
(``inf · 0``), as ``LlamaRMSNorm``; so does a finite ``|x| > ~1.8e19`` (its square overflows fp32; the
row of y becomes 0, as in PyTorch). ``eps = 0`` and a row of zeros give ``inv_rms = inf`` and a NaN row.
Backward: NaN in ``dy[r, c]`` makes row r of dx and ``dw[c]`` NaN, the rest finite. The fused forms
apply these rules to ``s`` (a NaN in x or a makes that element of s NaN, so row r of y and ``inv_rms[r]``;
an fp16 sum past 65504 is inf); NaN in ``dresidual[r, c]`` makes ``dx[r, c]`` NaN alone.
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
from ..kernels.launch import (
    SMEM_WITHOUT_OPT_IN,
    opt_in_shared_memory,
    persistent_grid,
    resident_blocks,
    vector_width,
)

FWD_WARPS = loader.constant("rmsnorm", "RMSNORM_FWD_WARPS")  # rows (warps) per block in the forward
BWD_WARPS = loader.constant("rmsnorm", "RMSNORM_BWD_WARPS")  # rows (warps) per block in the backward
FAST_WARPS = loader.constant("rmsnorm", "RMSNORM_FAST_WARPS")  # warps per block of the "fast" backward
# The backward's kernels: "optimized" (rmsnorm_backward, one row per warp at a time) or "fast"
# (rmsnorm_backward_fast: two rows in flight per warp; 16-bit rows of whole 16-byte packs up to FAST_PACKS[-1]
# packs per lane, others run "optimized"). BACKWARD_METHOD is what method=None runs: "fast", 1.11x "optimized" with
# dresidual at SmolLM-360M's shapes on an H100, dx bitwise equal (benchmarks/results/ch10/llama_kernels.json)
METHODS = ("optimized", "fast")
BACKWARD_METHOD = "fast"
# Packs per lane (16 bytes each) the register variants are instantiated for (template argument 2 of
# rmsnorm_forward<T, VEC, P, ADD>); 0 is the other variant.
REGISTER_PACKS = tuple(sorted({int(e.split(",")[2]) for e in loader.name_expressions("rmsnorm")
                               if e.startswith("rmsnorm_forward<")} - {0}))
FAST_PACKS = tuple(sorted({int(e.split(",")[1]) for e in loader.name_expressions("rmsnorm")
                           if e.startswith("rmsnorm_backward_fast<")}))
_FAST_PLANS: dict = {}  # (device, dtype, packs, residual, n_rows) -> (blocks, smem): no driver queries per call


def _rows(x, name="x"):
    if x.ndim < 2:
        raise ValueError(f"{name} must be at least 2-D ([N, C] or [..., C]), got shape {tuple(x.shape)}")
    n_rows, c = math.prod(x.shape[:-1]), x.shape[-1]
    return n_rows, c


def _check_gpu(x, n_rows, c):
    check_gpu_dtype("x", x)
    if n_rows >= 2**31 or c >= 2**31:
        raise ValueError(f"N and C must be below 2**31, got N={n_rows}, C={c}")


def _plan(c, dtype, arrays):
    """(vec, packs): 16-byte packs and the register variant's packs per lane, or packs 0 (the other)."""
    width = vector_width(dtype, c, *arrays)
    if width == 1:
        return 0, 0
    per_lane = -(-(c // width) // 32)
    return 1, next((p for p in REGISTER_PACKS if p >= per_lane), 0)


# --------------------------------------------------------------------------- NumPy reference


@np.errstate(invalid="ignore", over="ignore", divide="ignore")  # non-finite rows: the documented NaN / 0
def rmsnorm_forward_reference(x2, w, eps):
    """The math of the forward on NumPy rows ``x2 [N, C]``: returns (y, inv_rms)."""
    ct = reference_dtype(x2.dtype)
    xf = x2.astype(ct)
    inv = ct(1.0) / np.sqrt((xf * xf).mean(axis=1) + ct(eps))
    return (xf * inv[:, None] * w.astype(ct)).astype(x2.dtype), inv.astype(ct)


@np.errstate(invalid="ignore", over="ignore")
def add_rmsnorm_forward_reference(x2, a2, w, eps):
    """The fused residual add + forward on NumPy rows: ``(s, y, inv_rms)``, ``s = x + a`` rounded to the
    storage dtype first and normalized as it is (what the next layer and the backward read)."""
    ct = reference_dtype(x2.dtype)
    s = (x2.astype(ct) + a2.astype(ct)).astype(x2.dtype)
    return (s, *rmsnorm_forward_reference(s, w, eps))


@np.errstate(invalid="ignore", over="ignore")
def rmsnorm_backward_reference(dy2, x2, w, inv_rms, dresidual=None):
    """(dx, dw) of rows ``[N, C]`` in the compute dtype (float32; float64 for float64 input), not rounded;
    ``dresidual [N, C]`` is added to dx."""
    ct = reference_dtype(x2.dtype)
    r = inv_rms.astype(ct)[:, None]
    xhat = x2.astype(ct) * r
    d = dy2.astype(ct)
    g = d * w.astype(ct)
    dx = r * (g - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if dresidual is not None:
        dx = dx + dresidual.astype(ct)
    return dx, (d * xhat).sum(axis=0)


# --------------------------------------------------------------------------- public API


def rmsnorm_forward(x, weight, eps=1e-5, *, out=None):
    """RMSNorm over the last axis: returns ``(y, inv_rms)``.

    ``x [..., C]`` (at least 2-D) and ``weight [C]`` of one dtype; ``y`` has x's shape and dtype (written
    into ``out`` when given, its own buffer); ``inv_rms`` is fp32 shaped ``x.shape[:-1]`` (float64 on the
    NumPy path for float64 input). ``eps`` >= 0 (Llama: 1e-5; Llama 3 configs say 1e-5 or 1e-6).
    """
    xp = array_module(x=x, weight=weight, out=out)
    check_array("x", x)
    n_rows, c = _rows(x)
    check_array("weight", weight, shape=(c,))
    check_same_dtype(x=x, weight=weight)
    eps = check_float("eps", eps, low=0.0)
    if out is not None:
        check_out(out, x.shape, x.dtype, xp)
        for name, a in (("x", x), ("weight", weight)):
            _check_separate("out", out, name, a)
    lead = tuple(x.shape[:-1])
    if xp is np:
        y, inv = rmsnorm_forward_reference(x.reshape(n_rows, c), weight, eps)
        y = y.reshape(x.shape)
        if out is not None:
            out[...] = y
            y = out
        return y, inv.reshape(lead)

    _check_gpu(x, n_rows, c)
    out = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    return out, _launch_forward(x, None, None, weight, out, eps, n_rows, c, xp)


def _launch_forward(x, a, s, weight, y, eps, n_rows, c, xp):
    """rmsnorm_forward's kernel (ADD = 1 when ``a`` is given: s = x + a, then the norm of s); returns inv_rms."""
    inv = xp.empty(x.shape[:-1], dtype=np.float32)
    add = a is not None
    vec, packs = _plan(c, x.dtype, (x, weight, y) + ((a, s) if add else ()))
    kern = get_kernel("rmsnorm", "rmsnorm_forward", x.dtype, vec, packs, int(add))
    kern((-(-n_rows // FWD_WARPS),), (32 * FWD_WARPS,),
         (x, a if add else x, s if add else y, weight, y, inv, np.int32(n_rows), np.int32(c), np.float32(eps)))
    return inv


def add_rmsnorm_forward(x, a, weight, eps=1e-5, *, residual_out=None, out=None):
    """Residual add and RMSNorm in one pass: returns ``(s, y, inv_rms)``.

    ``s = x + a`` (the residual stream, rounded to x's dtype) and ``y = rmsnorm(s)`` from that rounded ``s``
    (bitwise the unfused pair on the GPU: module docstring). ``x``, ``a`` share shape ``[..., C]`` and dtype
    with ``weight [C]``. ``s`` goes to ``residual_out`` when given, which may be ``a`` itself (in place; not
    ``x``, which a model keeps for its backward); ``y`` goes to ``out`` (its own buffer). ``inv_rms`` and
    ``eps`` as in ``rmsnorm_forward``.
    """
    xp = array_module(x=x, a=a, weight=weight, residual_out=residual_out, out=out)
    check_array("x", x)
    n_rows, c = _rows(x)
    check_array("a", a, shape=tuple(x.shape))
    check_array("weight", weight, shape=(c,))
    check_same_dtype(x=x, a=a, weight=weight)
    eps = check_float("eps", eps, low=0.0)
    if residual_out is not None:
        check_out(residual_out, x.shape, x.dtype, xp, name="residual_out")
        check_alias("residual_out", residual_out, "a", a)
        for name, b in (("x", x), ("weight", weight)):
            _check_separate("residual_out", residual_out, name, b)
    if out is not None:
        check_out(out, x.shape, x.dtype, xp)
        for name, b in (("x", x), ("a", a), ("weight", weight), ("residual_out", residual_out)):
            _check_separate("out", out, name, b)
    if xp is np:
        s, y, inv = add_rmsnorm_forward_reference(x.reshape(n_rows, c), a.reshape(n_rows, c), weight, eps)
        res = []
        for val, buf in ((s, residual_out), (y, out)):
            if buf is not None:
                buf[...] = val.reshape(x.shape)
            res.append(val.reshape(x.shape) if buf is None else buf)
        return res[0], res[1], inv.reshape(x.shape[:-1])

    _check_gpu(x, n_rows, c)
    s = xp.empty(x.shape, dtype=x.dtype) if residual_out is None else residual_out
    y = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    return s, y, _launch_forward(x, a, s, weight, y, eps, n_rows, c, xp)


def _check_separate(out_name, out, in_name, inp):
    """The kernels read rows through __restrict__ pointers while writing others: no output may share a byte
    with an input."""
    if overlaps(out, inp):
        raise ValueError(f"{out_name} overlaps {in_name}: it needs a buffer of its own")


def rmsnorm_backward(dy, x, weight, inv_rms, *, dx=None, dweight=None, accumulate=False, dresidual=None,
                     method=None):
    """Gradients of RMSNorm from the saved ``inv_rms``: returns ``(dx, dweight)``.

    ``dy`` and ``x`` share shape ``[..., C]`` and dtype with ``weight [C]``; ``inv_rms`` is what
    ``rmsnorm_forward`` returned (shape ``x.shape[:-1]`` or ``(N,)``). ``dx`` and ``dweight`` are
    optional output buffers (``dweight`` in weight's dtype or fp32); ``accumulate=True`` adds the weight
    gradient into ``dweight`` instead of overwriting it (sum in fp32, rounded once). ``dresidual`` (dy's
    shape and dtype): the gradient of a residual branch around the norm, added to dx in the same kernel
    (rounded once); ``dx`` may be ``dresidual`` itself (in place). ``method`` ("optimized" or "fast"; None:
    ``BACKWARD_METHOD``) picks the GPU kernels: the same dx expressions in the same order (the two agree to the
    last bit unless the compiler contracts them differently), dweight summed in another fixed order; "fast"
    takes fp16/bf16 rows of whole 16-byte packs with C <= 32 * 8 * FAST_PACKS[-1] and runs "optimized" for
    the rest. NumPy arrays run the reference whatever the method.
    """
    method = BACKWARD_METHOD if method is None else method
    check_method("rmsnorm_backward", method, METHODS)
    xp = array_module(dy=dy, x=x, weight=weight, inv_rms=inv_rms, dx=dx, dweight=dweight, dresidual=dresidual)
    check_array("x", x)
    n_rows, c = _rows(x)
    check_array("dy", dy, shape=tuple(x.shape))
    check_array("weight", weight, shape=(c,))
    if dresidual is not None:
        check_array("dresidual", dresidual, shape=tuple(x.shape))
    check_same_dtype(dy=dy, x=x, weight=weight, dresidual=dresidual)
    check_row_stats("inv_rms", inv_rms, x, n_rows)
    check_bool("accumulate", accumulate)
    if accumulate and dweight is None:
        raise ValueError("accumulate=True adds into dweight: pass the buffer")
    check_param_grad_dtype("dweight", dweight, "weight", weight)
    pdt = weight.dtype if dweight is None else dweight.dtype
    if dx is not None:
        check_out(dx, x.shape, x.dtype, xp, name="dx")
        for name, a in (("dy", dy), ("x", x), ("weight", weight)):
            _check_separate("dx", dx, name, a)
        check_alias("dx", dx, "dresidual", dresidual)
    if dweight is not None:
        check_out(dweight, (c,), pdt, xp, name="dweight")
        for name, a in (("dy", dy), ("x", x), ("weight", weight), ("dx", dx), ("dresidual", dresidual)):
            _check_separate("dweight", dweight, name, a)

    if xp is np:
        gx, gw = rmsnorm_backward_reference(dy.reshape(n_rows, c), x.reshape(n_rows, c), weight,
                                            inv_rms.reshape(n_rows),
                                            None if dresidual is None else dresidual.reshape(n_rows, c))
        gx = gx.astype(x.dtype).reshape(x.shape)
        if dx is not None:
            dx[...] = gx
            gx = dx
        if dweight is None:
            return gx, gw.astype(pdt)
        dweight[...] = (dweight.astype(gw.dtype) + gw if accumulate else gw).astype(pdt)
        return gx, dweight

    _check_gpu(x, n_rows, c)
    if inv_rms.dtype != np.float32:
        raise TypeError(f"inv_rms must be fp32 on the GPU path, got {inv_rms.dtype}")
    dx = xp.empty(x.shape, dtype=x.dtype) if dx is None else dx
    dweight = xp.empty((c,), dtype=pdt) if dweight is None else dweight
    res = dresidual is not None
    if method == "fast" and _backward_fast(dy, x, weight, inv_rms, dresidual, dx, dweight, accumulate, n_rows, c,
                                           xp):
        return dx, dweight
    vec, packs = _plan(c, x.dtype, (dy, x, weight, dx) + ((dresidual,) if res else ()))
    wpb = BWD_WARPS
    if packs > 0:
        smem = 4 * c  # the block's in-order sum at the end
    else:  # per-warp dw accumulators in shared memory: wpb * C floats
        wpb = max(1, min(BWD_WARPS, SMEM_WITHOUT_OPT_IN // (4 * c)))
        smem = 4 * wpb * c
    kern = get_kernel("rmsnorm", "rmsnorm_backward", x.dtype, vec, packs, int(res))
    if not opt_in_shared_memory(kern, smem, xp):
        raise ValueError(f"C={c} is too long for rmsnorm_backward's GPU kernel: its dweight accumulators need "
                         f"{smem} bytes of shared memory per block, more than this GPU allows")
    blocks = min(-(-n_rows // wpb), resident_blocks(kern, 32 * wpb, smem, xp))
    partial = xp.empty((blocks, c), dtype=np.float32)
    kern((blocks,), (32 * wpb,),
         (dy, x, weight, inv_rms, dresidual if res else dy, dx, partial, np.int32(n_rows), np.int32(c)),
         shared_mem=smem)
    red = get_kernel("rmsnorm", "rmsnorm_weight_grad_reduce", pdt, int(bool(accumulate)))
    red((-(-c // 32),), (32, 16), (partial, np.int32(blocks), np.int32(c), dweight))
    return dx, dweight


def fast_backward_plan(n_rows, c, dtype, *, residual=False, xp=None):
    """``(kernel, blocks, threads, shared_mem)`` of the "fast" backward for ``[n_rows, c]`` rows of ``dtype`` (16-byte
    aligned arrays), or None when it does not take them (fp32, C not a multiple of 8, rows longer than
    ``FAST_PACKS[-1]`` packs per lane, row indices past 32 bits). Its second stage then adds ``blocks`` partial
    rows; the benchmark reads the grid from here."""
    xp = backend.default_xp() if xp is None else xp
    dtype = backend.resolve_dtype(dtype)
    if dtype.itemsize != 2 or c % 8:
        return None
    per_lane = -(-(c // 8) // 32)
    packs = next((p for p in FAST_PACKS if p >= per_lane), None)
    if packs is None:
        return None
    kern = get_kernel("rmsnorm", "rmsnorm_backward_fast", dtype, packs, int(residual))
    threads = 32 * FAST_WARPS
    key = (xp.cuda.Device().id, dtype, packs, bool(residual), n_rows)
    plan = _FAST_PLANS.get(key)
    if plan is None:
        smem = 16 * 32 * packs * 2 * (1 + FAST_WARPS)  # w (fp32 float4s), then every warp's dw slots
        if not opt_in_shared_memory(kern, smem, xp):
            return None
        blocks = persistent_grid(kern, n_rows, threads, smem, xp)
        plan = _FAST_PLANS[key] = (blocks, smem)
    blocks, smem = plan
    if n_rows + blocks * FAST_WARPS >= 2**31:  # the kernel's row indices are 32-bit
        return None
    return kern, blocks, threads, smem


def _backward_fast(dy, x, weight, inv_rms, dres, dx, dweight, accumulate, n_rows, c, xp):
    """rmsnorm_backward_fast + rmsnorm_weight_grad_finish; False when the rows do not suit it."""
    res = dres is not None
    if vector_width(x.dtype, c, dy, x, weight, dx, *((dres,) if res else ())) == 1:
        return False
    plan = fast_backward_plan(n_rows, c, x.dtype, residual=res, xp=xp)
    if plan is None:
        return False
    kern, blocks, threads, smem = plan
    partial = xp.empty((blocks, c), dtype=np.float32)
    kern((blocks,), (threads,), (dy, x, weight, inv_rms, dres if res else dy, dx, partial, np.int32(n_rows),
                                 np.int32(c)), shared_mem=smem)
    fin = get_kernel("rmsnorm", "rmsnorm_weight_grad_finish", dweight.dtype, int(bool(accumulate)))
    fin((-(-c // 32),), (32, 32), (partial, np.int32(blocks), np.int32(c), dweight))
    return True


def traffic_bytes(n_rows, c, dtype, backward=False, *, residual=False):
    """Minimum bytes: forward reads x, writes y (+ inv_rms); backward reads dy, x, writes dx (+ inv_rms).
    ``residual=True``: the fused forms (the forward also reads a and writes s, the backward reads dresidual).
    The weight and its gradient (C elements) are left out."""
    s = backend.resolve_dtype(dtype).itemsize
    rows = 3 + int(residual) if backward else 2 + 2 * int(residual)
    return rows * n_rows * c * s + 4 * n_rows


__all__ = ["BACKWARD_METHOD", "METHODS", "add_rmsnorm_forward", "add_rmsnorm_forward_reference", "fast_backward_plan",
           "rmsnorm_backward", "rmsnorm_backward_reference", "rmsnorm_forward", "rmsnorm_forward_reference",
           "traffic_bytes"]
