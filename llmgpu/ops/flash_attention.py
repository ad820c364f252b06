"""Fused (flash) attention through cuDNN's frontend: an optional fast path next to chapter 2's kernels.

**NVIDIA-only fast path**: cuDNN runs on NVIDIA GPUs only; chapter 2's attention kernels (softmax.cu)
are the portable ones (tools/hip_compile_check.py).

Chapter 2's attention writes the T × T scores and probabilities to memory and reads them back
(B·H·T² elements each way). FlashAttention (Dao et al., 2022; Dao, 2023) never does: it walks over
key/value tiles keeping a running row maximum and row sum (the online softmax of Milakov &
Gimelshein), so the probabilities live only in registers, and it keeps one number per query row for
the backward pass, the log-sum-exp of the scaled scores::

    lse_i = log Σ_j exp(c · q_i·k_j)        (causal: j ≤ i),   c = 1/√D
    o_i   = Σ_j exp(c · q_i·k_j − lse_i) v_j

The backward recomputes ``P = exp(c·S − lse)`` tile by tile and uses ``D_i = Σ_d dO_id · O_id``
(which equals ``Σ_j P_ij dP_ij``) for the softmax gradient, so it needs only q, k, v, o, dO and lse::

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = c · P ⊙ (dP − D),   dQ = dS K,   dK = dSᵀ Q

This module runs NVIDIA's implementation of that algorithm through the cuDNN frontend's Python
graph API (package ``nvidia-cudnn-frontend``, module ``cudnn``; an optional extra:
``pip install 'llmgpu[fast]'``). Same call shapes as ``llmgpu.ops.attention``: q, k, v ``[B, H, T, D]``
(fp16 or bf16 on the GPU), returning ``(o, stats)`` where ``stats`` is an ``AttentionStats`` holding
``lse`` (fp32 ``[B, H, T]``, what cuDNN calls the softmax stats). The arrays may be **strided
views**: ``split_qkv(qkv, n_head)`` gives q, k, v as views of the ``[B, T, 3C]`` output of the QKV
projection and ``heads_view(y, n_head)`` a ``[B, H, T, D]`` view of a ``[B, T, C]`` buffer, so no
transposing copies are needed around attention (``out=``, ``dq=``, ``dk=``, ``dv=`` accept such views).

cuDNN graphs are built once per shape, dtype, strides and mask, and cached with their workspace;
``execute`` allocates nothing and is capturable in a CUDA graph (verified on the H200).
Make the first call of each shape outside capture (a warm-up). NumPy arrays run a reference of the
same algorithm (float32; float64 stays float64), so the math is checked on any machine.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_array,
    check_gpu_dtype,
    gpu_path_unavailable_reason,
    optional_import,
    require_module,
)
from .attention import AttentionStats, default_scale

INSTALL_HINT = ("install the optional fast path: pip install 'llmgpu[fast]' (brings nvidia-cudnn-frontend; "
                "cuDNN 9 itself comes from the nvidia-cudnn-cu12/cu13 wheel or a system install)")
_UID = {"q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "dO": 6, "dQ": 7, "dK": 8, "dV": 9}
_FWD_IO = ("q", "k", "v", "o", "stats")
_BWD_IO = ("q", "k", "v", "o", "dO", "stats", "dQ", "dK", "dV")
FLASH_DTYPES = (backend.float16, backend.bfloat16)  # what cuDNN's fused attention takes on the GPU


class CudnnUnavailableError(backend.GPUUnavailableError):
    """The cuDNN path was asked for but the cudnn frontend (or libcudnn, or a GPU) is missing."""


# --------------------------------------------------------------------------- availability


def _mapped_libs(prefix):
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(prefix))


def _preload_libcudnn():
    """Map libcudnn.so.9 before ``import cudnn`` when it sits in an ``nvidia/cudnn/lib`` directory of any
    sys.path entry (wheels installed with ``--target`` are not where the frontend looks). One cuDNN per
    process: a copy that is already mapped (e.g. by PyTorch) wins."""
    if any(os.path.basename(p).startswith("libcudnn.so") for p in _mapped_libs("libcudnn")):
        return
    for root in sys.path:
        if not root:
            continue
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "cudnn", "lib", "libcudnn.so.*"))):
            suffix = os.path.basename(path)[len("libcudnn.so."):]
            if suffix.isdigit():
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


def _preload_nvrtc():
    """cuDNN compiles some engines at run time with NVRTC, which it finds by soname: make sure one is
    mapped (CuPy's, or the pip wheel's through cuda.pathfinder, as the H200 probe did)."""
    cp = backend.cupy_module()
    try:
        cp.cuda.nvrtc.getVersion()  # maps CuPy's libnvrtc
    except Exception:
        pass
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvrtc")
    except Exception:
        pass


@functools.cache
def _import_cudnn():
    """(cudnn module or None, reason when None)."""
    for preload in (_preload_libcudnn, _preload_nvrtc):
        try:
            preload()
        except Exception:  # best effort only
            pass
    return optional_import("cudnn", "the cuDNN frontend", INSTALL_HINT)


def unavailable_reason() -> str | None:
    """None when the cuDNN path can run here; otherwise one line saying what is missing."""
    return gpu_path_unavailable_reason(_import_cudnn)


def available() -> bool:
    return unavailable_reason() is None


def _cudnn():
    return require_module(_import_cudnn, CudnnUnavailableError)


# --------------------------------------------------------------------------- strided views


def split_qkv(qkv, n_head: int):
    """q, k, v as ``[B, H, T, D]`` views of a contiguous ``[B, T, 3C]`` QKV buffer (no copy).

    Column block 0 of the last axis is q, block 1 k, block 2 v (the layout of GPT-2's ``c_attn``);
    element strides ``(T·3C, D, 3C, 1)``.
    """
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"qkv must be [B, T, 3C] with C a multiple of n_head={n_head}, got {tuple(qkv.shape)}")
    if not qkv.flags.c_contiguous:
        raise ValueError("qkv must be C-contiguous")
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    v5 = qkv.reshape(B, T, 3, n_head, D)
    return tuple(v5[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def heads_view(x, n_head: int):
    """A ``[B, H, T, D]`` view of a contiguous ``[B, T, C]`` buffer (no copy): element strides ``(T·C, D, C, 1)``."""
    if x.ndim != 3 or x.shape[-1] % n_head:
        raise ValueError(f"x must be [B, T, C] with C a multiple of n_head={n_head}, got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous")
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _elem_strides(a):
    it = a.dtype.itemsize
    return tuple(int(s) // it for s in a.strides)


def _check_bhtd(name, a, shape=None, dtype=None):
    """A [B, H, T, D] array, possibly a strided view: positive strides, unit stride along D."""
    if a.ndim != 4:
        raise ValueError(f"{name} must be [B, H, T, D], got shape {tuple(a.shape)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(a.shape)}")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {tuple(a.shape)})")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{name} must be {backend.dtype_name(dtype)}, got {a.dtype}")
    if a.dtype not in (backend.float16, backend.bfloat16, backend.float32, backend.float64):
        raise TypeError(f"{name} has dtype {a.dtype}; supported: fp16, bf16 (GPU), fp32, fp64 (NumPy)")
    st = a.strides
    if any(s <= 0 for s, n in zip(st, a.shape) if n > 1) or (a.shape[-1] > 1 and st[-1] != a.dtype.itemsize):
        raise ValueError(f"{name} must have positive strides and a unit stride along D (got byte strides {st}); "
                         "use split_qkv / heads_view or a contiguous array")
    return a


def _out(name, arr, shape, dtype, xp):
    if arr is None:
        return xp.empty(shape, dtype=dtype)
    if backend.get_array_module(arr) is not xp:
        raise TypeError(f"{name} must live on the same device as q")
    return _check_bhtd(name, arr, shape=shape, dtype=dtype)


# --------------------------------------------------------------------------- NumPy reference


def _ref_scores(q, k, scale, causal, ct):
    s = np.matmul(q.astype(ct), np.swapaxes(k.astype(ct), -1, -2)) * ct(scale)
    if causal:
        T = s.shape[-1]
        s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    return s


def _forward_numpy(q, k, v, scale, causal, o, lse):
    ct = np.float64 if q.dtype == np.float64 else np.float32
    s = _ref_scores(q, k, scale, causal, ct)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    o[...] = np.matmul(p / den, v.astype(ct)).astype(o.dtype)
    lse[...] = (m + np.log(den))[..., 0].astype(lse.dtype)


def _backward_numpy(do, q, k, v, o, lse, scale, causal, dq, dk, dv):
    ct = np.float64 if q.dtype == np.float64 else np.float32
    p = np.exp(_ref_scores(q, k, scale, causal, ct) - lse.astype(ct)[..., None])  # recomputed, masked → 0
    dof = do.astype(ct)
    dv[...] = np.matmul(np.swapaxes(p, -1, -2), dof).astype(dv.dtype)
    dp = np.matmul(dof, np.swapaxes(v.astype(ct), -1, -2))
    d_row = (dof * o.astype(ct)).sum(axis=-1, keepdims=True)  # D_i = dO_i · O_i = Σ_j P_ij dP_ij
    ds = p * (dp - d_row) * ct(scale)
    dq[...] = np.matmul(ds, k.astype(ct)).astype(dq.dtype)
    dk[...] = np.matmul(np.swapaxes(ds, -1, -2), q.astype(ct)).astype(dk.dtype)


# --------------------------------------------------------------------------- cuDNN graphs


class _Device:
    def __init__(self, cudnn, device_id):
        self.handle = cudnn.create_handle()
        self.device_id = device_id


_DEVICES: dict = {}
_GRAPHS: dict = {}  # key -> _Entry


def _device(cudnn, cp):
    dev = cp.cuda.Device().id
    d = _DEVICES.get(dev)
    if d is None:
        d = _DEVICES[dev] = _Device(cudnn, dev)
    return d


class _Entry:
    __slots__ = ("graph", "ws", "ws_ptr", "form", "describe", "deterministic")


# The backward graph asks cuDNN for its deterministic algorithm (``use_deterministic_algorithm``): the
# default one accumulates dQ with atomics, so two runs from the same inputs differ in the last bits
# (seen on the H200: every weight gradient of the blocks below the first attention then differs), and
# a resumed training run could not reproduce the uninterrupted one bit for bit. A frontend without the
# option builds the default graph; ``backward_is_deterministic()`` says which one ran.
DETERMINISTIC_BACKWARD = True


def _mask_variants(cudnn, causal):
    if not causal:
        return [("none", {})]
    return [("band", {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}),
            ("causal", {"use_causal_mask": True})]  # the older spelling, still accepted by 1.32


def _build(cudnn, cp, handle, which, dims, strides, io_name, scale, causal, describe, deterministic=False):
    """Build (validate, plan, compile) one forward or backward SDPA graph with fixed uids."""
    io = cudnn.data_type.BFLOAT16 if io_name == "bf16" else cudnn.data_type.HALF
    f32 = cudnn.data_type.FLOAT
    B, H, T, _ = dims
    sdims, sstr = [B, H, T, 1], [H * T, T, 1, 1]
    errors = []
    for label, mask in _mask_variants(cudnn, causal):
        try:
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            t = {n: g.tensor(name=n, dim=list(dims), stride=list(strides[n]), data_type=io, uid=_UID[n])
                 for n in ("q", "k", "v")}
            if which == "fwd":
                o, stats = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale,
                                  **mask)
                o.set_output(True).set_dim(list(dims)).set_stride(list(strides["o"])).set_data_type(io).set_uid(
                    _UID["o"])
                stats.set_output(True).set_dim(sdims).set_stride(sstr).set_data_type(f32).set_uid(_UID["stats"])
            else:
                t["o"] = g.tensor(name="o", dim=list(dims), stride=list(strides["o"]), data_type=io, uid=_UID["o"])
                t["dO"] = g.tensor(name="dO", dim=list(dims), stride=list(strides["dO"]), data_type=io,
                                   uid=_UID["dO"])
                t["stats"] = g.tensor(name="stats", dim=sdims, stride=sstr, data_type=f32, uid=_UID["stats"])
                kw = dict(name="sdpa_bwd", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                          attn_scale=scale, **mask)
                try:
                    grads = g.sdpa_backward(**kw, use_deterministic_algorithm=True) if deterministic else \
                        g.sdpa_backward(**kw)
                except TypeError:  # a frontend without the option
                    deterministic = False
                    grads = g.sdpa_backward(**kw)
                for tensor, n in zip(grads, ("dQ", "dK", "dV")):
                    tensor.set_output(True).set_dim(list(dims)).set_stride(list(strides[n])).set_data_type(
                        io).set_uid(_UID[n])
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as e:
            errors.append(f"mask {label}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
            continue
        e = _Entry()
        e.graph = g
        size = int(g.get_workspace_size())
        e.ws = cp.empty(max(size, 1), dtype=cp.uint8)
        e.ws_ptr = int(e.ws.data.ptr)
        e.form = None  # which variant-pack form execute() took: decided on the first call
        e.describe = describe
        e.deterministic = which == "fwd" or deterministic
        return e
    raise RuntimeError(f"cuDNN could not build the {which} attention graph for {describe}: " + " | ".join(errors))


def _execute(cudnn, dev, entry, arrays: dict):
    """Run a built graph on CuPy's current stream. Variant pack {uid: device pointer} (the form the probe
    used); if the first call rejects it, {uid: cupy array} is tried and remembered."""
    cp = backend.cupy_module()
    cudnn.set_stream(dev.handle, cp.cuda.get_current_stream().ptr)  # cached by the handle when unchanged
    first = None
    if entry.form != "arrays":
        pack = {_UID[n]: int(a.data.ptr) for n, a in arrays.items()}
        try:
            entry.graph.execute(pack, entry.ws_ptr, handle=dev.handle)
            entry.form = "ptr"
            return
        except Exception as e:
            if entry.form == "ptr":
                raise RuntimeError(f"cuDNN attention failed for {entry.describe}: {type(e).__name__}: {e}") from e
            first = e
    try:
        entry.graph.execute({_UID[n]: a for n, a in arrays.items()}, entry.ws, handle=dev.handle)
    except Exception as e:
        extra = f" (with device pointers: {type(first).__name__}: {first})" if first is not None else ""
        raise RuntimeError(f"cuDNN attention failed for {entry.describe}: {type(e).__name__}: {e}{extra}") from e
    entry.form = "arrays"


def _entry(cudnn, cp, dev, which, arrays, dtype, scale, causal):
    dims = tuple(int(s) for s in arrays["q"].shape)
    strides = {n: _elem_strides(a) for n, a in arrays.items() if n != "stats"}
    io_name = backend.dtype_name(dtype)
    key = (dev.device_id, which, dims, io_name, float(scale), bool(causal), tuple(sorted(strides.items())),
           which == "bwd" and DETERMINISTIC_BACKWARD)
    e = _GRAPHS.get(key)
    if e is None:
        describe = (f"B,H,T,D={list(dims)} {io_name} causal={causal} scale={scale:.6g} strides "
                    + ", ".join(f"{n}{list(s)}" for n, s in strides.items()))
        det = which == "bwd" and DETERMINISTIC_BACKWARD
        try:
            e = _build(cudnn, cp, dev.handle, which, dims, strides, io_name, scale, causal, describe, det)
        except RuntimeError:
            if not det:
                raise
            # no deterministic engine for this shape: the default one, and backward_is_deterministic() says so
            e = _build(cudnn, cp, dev.handle, which, dims, strides, io_name, scale, causal, describe, False)
        _GRAPHS[key] = e
    return e


def backward_is_deterministic() -> bool | None:
    """Whether every backward graph built so far runs cuDNN's deterministic algorithm (None: none built)."""
    entries = [e for k, e in _GRAPHS.items() if k[1] == "bwd"]
    return all(e.deterministic for e in entries) if entries else None


def graph_count() -> int:
    """Number of cached cuDNN attention graphs."""
    return len(_GRAPHS)


# --------------------------------------------------------------------------- public API


def _check_inputs(q, k, v):
    xp = array_module(q=q, k=k, v=v)
    _check_bhtd("q", q)
    _check_bhtd("k", k, shape=q.shape, dtype=q.dtype)
    _check_bhtd("v", v, shape=q.shape, dtype=q.dtype)
    if xp is not np:
        check_gpu_dtype("q", q, FLASH_DTYPES, hint="cuDNN flash attention; fp32 runs on llmgpu.ops.attention")
        if q.shape[-1] % 8:
            raise ValueError(f"cuDNN flash attention needs a head dimension D divisible by 8, got {q.shape[-1]}")
        for n, a in (("q", q), ("k", k), ("v", v)):
            if a.data.ptr % 16:
                raise ValueError(f"{n} must start on a 16-byte boundary")
    return xp


def flash_attention_forward(q, k, v, causal=True, *, scale=None, out=None, lse=None):
    """``O = softmax(scale · q kᵀ, causal) v`` without materialising the scores; returns ``(o, stats)``.

    q, k, v ``[B, H, T, D]`` (strided views allowed, unit stride along D). ``stats`` is an
    ``AttentionStats`` with ``lse`` (fp32 ``[B, H, T]``): what ``flash_attention_backward`` needs.
    ``out`` ([B, H, T, D], may be a view such as ``heads_view(y, H)``) and ``lse`` (contiguous fp32
    [B, H, T]) are written when given (static buffers for CUDA graphs), else allocated.
    """
    xp = _check_inputs(q, k, v)
    B, H, T, D = q.shape
    scale = default_scale(D) if scale is None else float(scale)
    o = _out("out", out, q.shape, q.dtype, xp)
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    if lse is None:
        lse = xp.empty((B, H, T), dtype=lse_dtype)
    else:
        if backend.get_array_module(lse) is not xp:
            raise TypeError("lse must live on the same device as q")
        check_array("lse", lse, shape=(B, H, T), dtype=lse_dtype)
    if xp is np:
        _forward_numpy(q, k, v, scale, causal, o, lse)
    else:
        cudnn = _cudnn()
        dev = _device(cudnn, xp)
        arrays = {"q": q, "k": k, "v": v, "o": o, "stats": lse}
        e = _entry(cudnn, xp, dev, "fwd", arrays, q.dtype, scale, causal)
        _execute(cudnn, dev, e, arrays)
    return o, AttentionStats(lse=lse, scale=scale, causal=causal)


def flash_attention_backward(do, q, k, v, o, stats, causal=True, *, dq=None, dk=None, dv=None):
    """Gradients ``(dq, dk, dv)`` from dO, the inputs, the forward's output and its ``stats`` (lse).

    All of do, q, k, v, o are ``[B, H, T, D]`` (strided views allowed); ``dq``/``dk``/``dv`` are written
    when given (e.g. ``split_qkv(dqkv, H)``, so the gradient lands in the [B, T, 3C] layout the QKV
    projection's backward reads), else allocated contiguous.
    """
    xp = _check_inputs(q, k, v)
    array_module(q=q, do=do, o=o)
    _check_bhtd("do", do, shape=q.shape, dtype=q.dtype)
    _check_bhtd("o", o, shape=q.shape, dtype=q.dtype)
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be the AttentionStats returned by flash_attention_forward, got "
                        f"{type(stats).__name__}")
    if stats.lse is None:
        raise ValueError("stats holds no lse (it comes from llmgpu.ops.attention_forward, which keeps P): "
                         "use llmgpu.ops.attention.attention_backward for it")
    if stats.causal != causal:
        raise ValueError(f"stats were computed with causal={stats.causal}, backward called with causal={causal}")
    B, H, T, D = q.shape
    lse = stats.lse
    array_module(q=q, **{"stats.lse": lse})
    check_array("stats.lse", lse, shape=(B, H, T), dtype=np.float64 if q.dtype == np.float64 else np.float32)
    dq = _out("dq", dq, q.shape, q.dtype, xp)
    dk = _out("dk", dk, q.shape, q.dtype, xp)
    dv = _out("dv", dv, q.shape, q.dtype, xp)
    if xp is np:
        _backward_numpy(do, q, k, v, o, lse, stats.scale, causal, dq, dk, dv)
        return dq, dk, dv
    for n, a in (("do", do), ("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        if a.data.ptr % 16:
            raise ValueError(f"{n} must start on a 16-byte boundary")
    if T == 1:
        # One position: softmax over a single score is 1, so o = v and the scores get no gradient
        # (dS = P ⊙ (dP − Σ P⊙dP) = 0): dq = dk = 0, dv = dO. cuDNN (frontend 1.32, seen on the H200)
        # builds no backward graph for T = 1, so this exact special case stands in for it.
        dq[...] = 0
        dk[...] = 0
        dv[...] = do
        return dq, dk, dv
    cudnn = _cudnn()
    dev = _device(cudnn, xp)
    arrays = {"q": q, "k": k, "v": v, "o": o, "dO": do, "stats": lse, "dQ": dq, "dK": dk, "dV": dv}
    e = _entry(cudnn, xp, dev, "bwd", arrays, q.dtype, stats.scale, causal)
    _execute(cudnn, dev, e, arrays)
    return dq, dk, dv


def flash_attention_flops(B, H, T, D, causal=True, direction="fwd") -> float:
    """Useful FLOPs (FlashAttention's convention, as ``attention_flops``): forward 4·B·H·T²·D, halved when
    causal; backward 2.5 × forward (it recomputes the scores)."""
    fwd = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return fwd if direction == "fwd" else 2.5 * fwd


def flash_traffic_bytes(B, H, T, D, dtype, direction="fwd") -> int:
    """Minimum bytes: forward reads q, k, v and writes o (+ fp32 lse); backward reads q, k, v, o, dO, lse and
    writes dq, dk, dv."""
    it = backend.resolve_dtype(dtype).itemsize
    n = B * H * T * D
    return (4 * n * it + 4 * B * H * T) if direction == "fwd" else (8 * n * it + 4 * B * H * T)


__all__ = ["CudnnUnavailableError", "DETERMINISTIC_BACKWARD", "INSTALL_HINT", "available",
           "backward_is_deterministic", "flash_attention_backward", "flash_attention_flops",
           "flash_attention_forward", "flash_traffic_bytes", "graph_count", "heads_view", "split_qkv",
           "unavailable_reason"]

