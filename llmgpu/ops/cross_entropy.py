"""Softmax + cross-entropy loss, fused, forward and backward (chapter 3, ``kernels/cross_entropy.cu``).

For logits ``[N, V]`` (or ``[..., V]``) and integer targets ``[N]`` (or ``[...]``)::

    lse_i  = log sum_v exp(logits[i, v])
    loss   = mean over rows i with targets[i] != ignore_index of (lse_i - logits[i, targets[i]])
    dlogits[i, v] = (exp(logits[i, v] - lse_i) - [v == targets[i]]) * dloss / n_valid

``cross_entropy_forward`` returns ``(loss, cache)``: ``loss`` is a 0-d fp32 array on the inputs'
backend (on the GPU a device array: reading it is the caller's choice, nothing here synchronizes);
``cache`` keeps what the backward needs (a reference to the logits, the targets, the per-row
log-sum-exp and the number of counted rows as a device value). ``cross_entropy_backward(cache,
dloss)`` recomputes the softmax from the saved log-sum-exp while it writes dlogits: the logits are
read once and dlogits written once. It may write into the logits buffer itself (``out=cache.logits``).
``cross_entropy_forward_backward(logits, targets, dloss, n_total)`` does both in one pass (one read of
the logits instead of two: the chunked LM head of chapter 8) and returns the loss as a *sum* over the
counted rows, with the gradient divided by ``n_total``, the count of the whole batch (its docstring).

Rules, the same on both backends where possible:

* ``ignore_index`` rows (default -100, as PyTorch) add nothing to the loss, do not count in
  ``n_valid`` and get a zero gradient row. **All rows ignored gives loss 0 and a zero gradient**
  (PyTorch returns NaN there; a batch with nothing to learn from should not poison a loss scaler).
* A target outside ``[0, V)`` (other than ignore_index): the NumPy path raises ValueError; the GPU
  path cannot raise without a host synchronization, so the kernel reads nothing out of bounds,
  sets that row's loss to NaN (the mean loss becomes NaN) and its gradient row to NaN. Loud, not
  silently wrong; a loss scaler skips the step.
* Targets must be int32 or int64; float targets are refused.
* ``method="naive"`` refuses fp16 logits (TypeError), on both backends: it stores the probabilities
  in the logits' dtype, and fp16 flushes every p below ~6e-8 to 0, so at GPT-2 sizes (V = 50257)
  some ``-log p_t`` are inf. The fused methods never form p_t (lse − x_t in fp32) and take fp16.
* Non-finite logits: a NaN or +inf in a counted row makes its lse, the loss and its gradient row
  NaN; −inf logits add nothing (a masked vocabulary), and a −inf at the target gives loss +inf; an
  ignored row is never part of the loss, whatever it holds (its gradient row is 0).

``method`` (default ``"fast"``: 95 % of copy in bf16 on the H200): ``"optimized"`` (fused, online softmax,
16-byte loads), ``"fast"`` (the fused forward
reshaped for 16-bit logits: 4 packs in flight per thread, one online-softmax step per 32 logits, the
target lookups of all rows batched into the final one-block kernel; the same fused backward) or
``"naive"`` (softmax kernel writing the N x V probabilities, then -log p[target], and a backward
reading the probabilities).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_gpu_dtype, check_method, check_out, reference_dtype
from ..kernels import get_kernel, loader
from ..kernels.launch import device_limits, opt_in_shared_memory, stride_grid

METHODS = ("naive", "optimized", "fast")
IGNORE_INDEX = -100  # the default target that takes no part in the loss (PyTorch's)
FUSED_METHODS = ("optimized", "fast")  # keep lse, share cross_entropy_backward_fused
TARGET_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_C_INDEX = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
FAST_THREADS = loader.constant("cross_entropy", "CE_FAST_THREADS")  # the fast forward assumes exactly this block
FB_THREADS = loader.constant("cross_entropy", "CE_FB_THREADS")  # the fused forward + backward kernel's block
FB_STATIC_SMEM = 512  # its static shared memory (block_logsumexp's, 272 B) rounded up


@dataclass
class CrossEntropyCache:
    """What ``cross_entropy_backward`` needs from the forward."""

    logits: object  # [N, V] view of the forward's logits (not a copy)
    targets: object  # [N]
    lse: object  # [N] fp32 log-sum-exp per row (None on the naive GPU path)
    n_valid: object  # 0-d int32: rows whose target is not ignore_index
    ignore_index: int
    shape: tuple  # the logits' original shape
    method: str = "optimized"  # picks the backward kernel: "naive" reads probs, the others lse
    probs: object = None  # [N, V] softmax, naive GPU path only


_compute_dtype = reference_dtype


def _threads(v, dtype):
    """Threads per row block: enough for one 16-byte pack each, a multiple of 32, at most 512."""
    packs = -(-v // (16 // np.dtype(dtype).itemsize))
    return min(512, max(32, -(-packs // 32) * 32))


# --------------------------------------------------------------------------- NumPy reference


@np.errstate(invalid="ignore")  # NaN/+inf logits: a NaN lse is the documented answer
def cross_entropy_forward_reference(logits2, targets1, ignore_index):
    """Returns (loss 0-d, lse [N], n_valid) on NumPy arrays, logits [N, V]."""
    ct = _compute_dtype(logits2.dtype)
    losses, lse, n_valid = _row_losses_reference(logits2, targets1, ignore_index)
    loss = np.asarray(losses.sum() / max(n_valid, 1), dtype=ct)
    return loss, lse, n_valid


@np.errstate(invalid="ignore")
def _row_losses_reference(logits2, targets1, ignore_index):
    """(per-row losses [N] (0 where ignored), lse [N], n_valid) in the compute dtype."""
    ct = _compute_dtype(logits2.dtype)
    x = logits2.astype(ct)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    valid = targets1 != ignore_index
    picked = x[np.arange(x.shape[0]), np.where(valid, targets1, 0)]
    losses = np.where(valid, lse - picked, ct(0.0))
    return losses, lse.astype(ct), int(valid.sum())


@np.errstate(invalid="ignore")  # NaN/+inf logits: a NaN lse is the documented answer
def cross_entropy_backward_reference(logits2, targets1, lse, n_valid, ignore_index, dloss=1.0):
    ct = _compute_dtype(logits2.dtype)
    x = logits2.astype(ct)
    valid = targets1 != ignore_index
    g = np.exp(x - lse.astype(ct)[:, None])
    rows = np.flatnonzero(valid)
    g[rows, targets1[rows]] -= ct(1.0)
    g *= ct(dloss) / ct(max(int(n_valid), 1))
    g[~valid] = 0.0
    return g.astype(logits2.dtype)


# --------------------------------------------------------------------------- public API


def _check_inputs(logits, targets, ignore_index):
    """(xp, logits as [N, V], targets as [N], ignore_index as an int), after the argument checks; on
    NumPy out-of-range targets raise, on the GPU the dtype and size limits are checked."""
    xp = array_module(logits=logits, targets=targets)
    check_array("logits", logits)
    if logits.ndim < 2:
        raise ValueError(f"logits must be at least 2-D ([N, V] or [..., V]), got shape {tuple(logits.shape)}")
    check_array("targets", targets, shape=tuple(logits.shape[:-1]), dtypes=TARGET_DTYPES)
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    ignore_index = int(ignore_index)
    v = logits.shape[-1]
    n = math.prod(logits.shape[:-1])
    lf = logits.reshape(n, v)
    tf = targets.reshape(n)
    if xp is np:
        bad = (tf != ignore_index) & ((tf < 0) | (tf >= v))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"targets must lie in [0, {v}) or equal ignore_index={ignore_index}; "
                f"{int(bad.sum())} do not (first: targets[{i}] = {int(tf[i])})"
            )
    else:
        check_gpu_dtype("logits", logits)
        if n >= 2**31 or v >= 2**31:
            raise ValueError(f"N and V must be below 2**31, got N={n}, V={v}")
    return xp, lf, tf, ignore_index


def _dloss_args(dloss, dummy):
    """(device pointer, use it, host value) kernel arguments for ``dloss``: a number, or a 0-d/size-1
    array (a device array is read on the device: a loss scale never visits the host)."""
    if backend.is_gpu_array(dloss):
        if dloss.size != 1:
            raise ValueError(f"dloss must be a scalar or a size-1 array, got shape {tuple(dloss.shape)}")
        if dloss.dtype.kind != "f":
            raise TypeError(f"dloss must be a float array, got {dloss.dtype}")
        return dloss.reshape(()).astype(np.float32, copy=False), np.int32(1), np.float32(0.0)
    return dummy, np.int32(0), np.float32(float(np.asarray(dloss).reshape(())))  # the pointer is never read


def cross_entropy_forward(logits, targets, ignore_index=IGNORE_INDEX, *, method="fast"):
    """Mean cross-entropy of ``logits [..., V]`` against integer ``targets [...]``: ``(loss, cache)``."""
    check_method("cross_entropy_forward", method, METHODS)
    xp, lf, tf, ignore_index = _check_inputs(logits, targets, ignore_index)
    if method == "naive" and logits.dtype == backend.float16:
        raise TypeError("cross_entropy_forward: method='naive' stores the softmax probabilities in the logits' "
                        "dtype, and in fp16 every p below ~6e-8 becomes 0 (-log p = inf at realistic vocabulary "
                        "sizes); use method='optimized' or 'fast' (log-sum-exp in fp32), or bf16/fp32 logits")
    n, v = lf.shape

    if xp is np:
        loss, lse, n_valid = cross_entropy_forward_reference(lf, tf, ignore_index)
        cache = CrossEntropyCache(lf, tf, lse, np.asarray(n_valid, dtype=np.int32), ignore_index,
                                  tuple(logits.shape), method)
        return loss, cache

    ti = _C_INDEX[targets.dtype]
    loss = xp.empty((), dtype=np.float32)
    n_valid = xp.empty((), dtype=np.int32)
    ign = np.int64(ignore_index)
    lse = probs = None
    if method == "fast":
        lse = xp.empty(n, dtype=np.float32)
        get_kernel("cross_entropy", "cross_entropy_forward_fast", logits.dtype)(
            (n,), (FAST_THREADS,), (lf, lse, np.int32(v))
        )
        get_kernel("cross_entropy", "cross_entropy_loss_fast", logits.dtype, ti)(
            (1,), (1024,), (lf, tf, lse, np.int32(n), np.int32(v), ign, loss, n_valid)
        )
        cache = CrossEntropyCache(lf, tf, lse, n_valid, ignore_index, tuple(logits.shape), method)
        return loss, cache
    loss_rows = xp.empty(n, dtype=np.float32)
    if method == "optimized":
        lse = xp.empty(n, dtype=np.float32)
        get_kernel("cross_entropy", "cross_entropy_forward_fused", logits.dtype, ti)(
            (n,), (_threads(v, logits.dtype),), (lf, tf, lse, loss_rows, np.int32(v), ign)
        )
    else:
        probs = xp.empty((n, v), dtype=logits.dtype)
        get_kernel("cross_entropy", "cross_entropy_softmax_naive", logits.dtype)((n,), (256,), (lf, probs, np.int32(v)))
        get_kernel("cross_entropy", "cross_entropy_nll_naive", logits.dtype, ti)(
            (-(-n // 256),), (256,), (probs, tf, loss_rows, np.int32(n), np.int32(v), ign)
        )
    get_kernel("cross_entropy", "cross_entropy_mean", ti)(
        (1,), (1024,), (loss_rows, tf, np.int32(n), ign, loss, n_valid)
    )
    cache = CrossEntropyCache(lf, tf, lse, n_valid, ignore_index, tuple(logits.shape), method, probs)
    return loss, cache


def cross_entropy_backward(cache, dloss=1.0, *, out=None):
    """dlogits (shape and dtype of the forward's logits) for upstream gradient ``dloss``.

    ``dloss``: a number, or a 0-d/size-1 array (on the GPU a device array is read on the device, so
    a loss scale never has to visit the host). ``out``: shaped like the forward's logits or
    ``[N, V]``; it may be the logits themselves (``out=cache.logits``: in place).
    """
    if not isinstance(cache, CrossEntropyCache):
        raise TypeError(f"cache must be the CrossEntropyCache from cross_entropy_forward, got {type(cache).__name__}")
    lf, tf = cache.logits, cache.targets
    dloss_arr = dloss if (isinstance(dloss, np.ndarray) or backend.is_gpu_array(dloss)) else None
    xp = array_module(logits=lf, dloss=dloss_arr if backend.is_gpu_array(dloss_arr) else None, out=out)
    if dloss_arr is not None and dloss_arr.size != 1:
        raise ValueError(f"dloss must be a scalar or a size-1 array, got shape {tuple(dloss_arr.shape)}")
    n, v = lf.shape

    if out is not None:
        # the forward's shape or its [N, V] view (cache.logits itself, for the in-place update)
        shape = tuple(out.shape) if tuple(out.shape) in (cache.shape, (n, v)) else cache.shape
        check_out(out, shape, lf.dtype, xp)

    if xp is np:
        g = cross_entropy_backward_reference(lf, tf, cache.lse, cache.n_valid, cache.ignore_index,
                                             float(np.asarray(dloss).reshape(())))
        if out is None:
            return g.reshape(cache.shape)
        out[...] = g.reshape(out.shape)
        return out

    result = check_out(out, cache.shape, lf.dtype, xp) if out is None else out
    out2 = result.reshape(n, v)  # a view; the kernel reads each element before writing it (in place is fine)
    if backend.is_gpu_array(dloss_arr):
        if dloss_arr.dtype.kind != "f":
            raise TypeError(f"dloss must be a float array, got {dloss_arr.dtype}")
        dloss_dev, use_dev, dloss_host = dloss_arr.reshape(()).astype(np.float32, copy=False), 1, 0.0
    else:  # a host number; the pointer argument is a dummy the kernel never reads
        dloss_dev, use_dev, dloss_host = cache.n_valid, 0, float(np.asarray(dloss).reshape(()))
    dl = (dloss_dev, np.int32(use_dev), np.float32(dloss_host))
    ti = _C_INDEX[tf.dtype]
    ign = np.int64(cache.ignore_index)
    if cache.method in FUSED_METHODS:
        vec = (out2.data.ptr - lf.data.ptr) % 16 == 0
        get_kernel("cross_entropy", "cross_entropy_backward_fused", lf.dtype, ti, int(vec))(
            (n,), (_threads(v, lf.dtype),),
            (lf, tf, cache.lse, cache.n_valid, *dl, out2, np.int32(v), ign),
        )
    else:
        blocks = stride_grid(n * v, 256, xp)
        get_kernel("cross_entropy", "cross_entropy_backward_naive", lf.dtype, ti)(
            (blocks,), (256,), (cache.probs, tf, cache.n_valid, *dl, out2, np.int64(n), np.int32(v), ign)
        )
    return result


def cross_entropy_forward_backward(logits, targets, dloss=1.0, n_total=None, *, ignore_index=IGNORE_INDEX,
                                   out=None, loss_sum=None):
    """Forward and backward in one pass over the logits: ``(loss_sum, dlogits)``.

    The contract (the chunked LM head of ``FastGPT`` calls it once per chunk of rows of one batch):

    * ``loss_sum``: a 0-d array (fp32 on the GPU, the compute dtype on NumPy) holding the **sum** over
      the counted rows (``targets != ignore_index``) of ``lse_i - logits[i, targets[i]]``: not the
      mean. Given ``loss_sum=`` (such an array), the sum is **added** into it and it is returned, so
      the chunks of one batch accumulate into one scalar; the mean is ``loss_sum / max(n_total, 1)``.
    * ``dlogits[i, v] = (softmax(logits_i)_v - [v == t_i]) * dloss / max(n_total, 1)``, zero rows for
      ignored targets: the gradient of the batch's mean loss when ``n_total`` is the batch's count.
    * ``n_total``: what the gradient divides by. None: this call's counted rows (then ``loss_sum /
      n_total`` is cross_entropy_forward's mean and dlogits its backward); an int; or a 0-d integer
      array (on the GPU a device array, read by the kernel: no host synchronization, capturable).
    * ``dloss``: a number or a 0-d/size-1 float array (a device array is read on the device).
    * ``out``: where dlogits goes, shaped like the logits (or ``[N, V]``); it may be the logits
      themselves (in place: each element is read before it is written). None: a new array.

    The rules of the module docstring hold (ignored rows, out-of-range targets: ValueError on NumPy,
    NaN loss and NaN gradient row on the GPU; NaN/+inf logits make the row's loss and gradient NaN).
    On the GPU one kernel (``cross_entropy_forward_backward_fast``, one block per row) reads each row
    once, keeps it in shared memory between its two sweeps, and writes the row's gradient and loss;
    a one-block kernel then sums the rows' losses in a fixed order (bitwise repeatable). On NumPy it
    computes the reference forward and backward (the same formulas, the same bits as
    ``cross_entropy_forward`` + ``cross_entropy_backward``).
    """
    xp, lf, tf, ignore_index = _check_inputs(logits, targets, ignore_index)
    n, v = lf.shape
    n_arr = n_total if (isinstance(n_total, np.ndarray) or backend.is_gpu_array(n_total)) else None
    dl_arr = dloss if (isinstance(dloss, np.ndarray) or backend.is_gpu_array(dloss)) else None
    array_module(logits=logits, n_total=n_arr if backend.is_gpu_array(n_arr) else None,
                 dloss=dl_arr if backend.is_gpu_array(dl_arr) else None, out=out, loss_sum=loss_sum)
    if n_total is not None:
        if n_arr is not None:
            if n_arr.size != 1 or n_arr.dtype.kind not in "iu":
                raise TypeError(f"n_total must be an int or a size-1 integer array, got {n_arr.dtype} "
                                f"shape {tuple(n_arr.shape)}")
        elif isinstance(n_total, (bool, np.bool_)) or not isinstance(n_total, (int, np.integer)):
            raise TypeError(f"n_total must be None, an int or a size-1 integer array, got {type(n_total).__name__}")
    if out is not None:  # the logits' shape or [N, V] (the logits' [N, V] view itself: in place)
        check_out(out, (n, v) if tuple(out.shape) == (n, v) else tuple(logits.shape), logits.dtype, xp)
    if dl_arr is not None and dl_arr.size != 1:
        raise ValueError(f"dloss must be a scalar or a size-1 array, got shape {tuple(dl_arr.shape)}")

    if xp is np:
        ct = _compute_dtype(lf.dtype)
        if loss_sum is not None:
            check_out(loss_sum, (), ct, xp, name="loss_sum")
        losses, lse, n_valid = _row_losses_reference(lf, tf, ignore_index)
        count = n_valid if n_total is None else int(np.asarray(n_total).reshape(()))
        g = cross_entropy_backward_reference(lf, tf, lse, count, ignore_index, float(np.asarray(dloss).reshape(())))
        part = losses.sum()
        if loss_sum is None:
            loss_sum = np.asarray(part, dtype=ct)
        else:
            loss_sum[...] += part
        if out is None:
            return loss_sum, g.reshape(logits.shape)
        out[...] = g.reshape(out.shape)
        return loss_sum, out

    accumulate = loss_sum is not None
    if accumulate:
        check_out(loss_sum, (), np.float32, xp, name="loss_sum")
    else:
        loss_sum = xp.empty((), dtype=np.float32)
    result = check_out(out, tuple(logits.shape), lf.dtype, xp) if out is None else out
    out2 = result.reshape(n, v)  # a view
    if n_total is None:
        n_arr = (tf != ignore_index).sum(dtype=np.int32)  # on the device
    if n_arr is not None:
        n_args = (n_arr.reshape(()).astype(np.int32, copy=False), np.int32(1), np.int32(0))
    else:  # a host int; the pointer argument is a dummy the kernel never reads
        n_args = (loss_sum, np.int32(0), np.int32(min(int(n_total), 2**31 - 1)))
    dl = _dloss_args(dloss, loss_sum)
    loss_rows = xp.empty(n, dtype=np.float32)
    vec = (out2.data.ptr - lf.data.ptr) % 16 == 0
    w = 16 // lf.dtype.itemsize if vec else 1
    smem = (v // w) * w * lf.dtype.itemsize  # the packs of the longest body a row can have
    kern, staged = _fb_kernel(lf.dtype, _C_INDEX[tf.dtype], int(vec), smem)
    if n:
        kern((n,), (FB_THREADS,), (lf, tf, loss_rows, *n_args, *dl, out2, np.int32(v), np.int64(ignore_index)),
             shared_mem=smem if staged else 0)
    get_kernel("cross_entropy", "cross_entropy_loss_sum")(
        (1,), (1024,), (loss_rows, np.int32(n), loss_sum, np.int32(accumulate))
    )
    return loss_sum, result


def _fb_kernel(dtype, ti, vec, smem):
    """(kernel, staged): the fused kernel that keeps the row in ``smem`` bytes of shared memory when two
    such blocks fit on an SM (opting in to more than 48 KB where needed), else the one that reads the
    row a second time from global memory (L2 if it still holds it)."""
    lim = device_limits()
    per_block = smem + FB_STATIC_SMEM + lim.reserved_smem_per_block
    if 2 * per_block <= lim.smem_per_sm:
        kern = get_kernel("cross_entropy", "cross_entropy_forward_backward_fast", dtype, ti, vec, 1)
        if opt_in_shared_memory(kern, smem):
            return kern, True
    return get_kernel("cross_entropy", "cross_entropy_forward_backward_fast", dtype, ti, vec, 0), False


def traffic_bytes(n, v, dtype, backward=False, target_itemsize=8):
    """Minimum bytes: forward reads logits and targets, writes lse (and a scalar); backward reads
    logits, targets, lse, writes dlogits."""
    s = backend.resolve_dtype(dtype).itemsize
    if backward:
        return 2 * n * v * s + n * (target_itemsize + 4)
    return n * v * s + n * (target_itemsize + 4) + 4


__all__ = [
    "METHODS",
    "CrossEntropyCache",
    "cross_entropy_backward",
    "cross_entropy_backward_reference",
    "cross_entropy_forward",
    "cross_entropy_forward_backward",
    "cross_entropy_forward_reference",
    "traffic_bytes",
]
