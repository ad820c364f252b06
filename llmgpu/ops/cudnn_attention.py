"""cuDNN's fused (flash) attention through its frontend: an optional fast path next to our own kernels.

**NVIDIA-only fast path**: cuDNN runs on NVIDIA GPUs only. ``llmgpu.ops.flash_attention`` is the public
entry point (``kernel="cudnn" | "ours" | "auto"``); this module holds what is specific to cuDNN: finding the
library, building one SDPA graph per shape, dtype, strides and mask (cached with its workspace), and running it.

The cuDNN frontend's Python graph API comes from the package ``nvidia-cudnn-frontend`` (module ``cudnn``; an
optional extra: ``pip install 'llmgpu[fast]'``). Its ``stats`` output is the per-row log-sum-exp of the scaled
scores (fp32 [B, H, T]), the same convention as our kernels' ``lse``, so either backward takes either forward's
stats. ``execute`` allocates nothing and is capturable in a CUDA graph (verified on the H200); make the first
call of each shape outside capture (a warm-up: that call builds the graph).

Grouped-query attention is native to cuDNN's SDPA: K and V (and dK, dV) are described with their own H_kv heads
(as the frontend's own GQA/MQA tests do), and the backward returns dK, dV summed over each K/V head's query heads.
The grouping must be ours, query head h on K/V head h // (H / H_kv): tests/test_gqa.py checks it against the
NumPy reference.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

from .. import backend
from ..checks import gpu_path_unavailable_reason, optional_import, require_module

INSTALL_HINT = ("install the optional fast path: pip install 'llmgpu[fast]' (brings nvidia-cudnn-frontend; "
                "cuDNN 9 itself comes from the nvidia-cudnn-cu12/cu13 wheel or a system install)")
_UID = {"q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "dO": 6, "dQ": 7, "dK": 8, "dV": 9}


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


# The backward graph asks cuDNN for its deterministic algorithm (``use_deterministic_algorithm``, ``backward``'s
# ``deterministic=True``): the default one accumulates dQ with atomics, so two runs from the same inputs differ in
# the last bits (seen on the H200: every weight gradient of the blocks below the first attention then differs),
# and a resumed training run could not reproduce the uninterrupted one bit for bit. A frontend without the option
# builds the default graph; ``backward_is_deterministic()`` says which one ran.


def _mask_variants(cudnn, causal):
    if not causal:
        return [("none", {})]
    return [("band", {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}),
            ("causal", {"use_causal_mask": True})]  # the older spelling, still accepted by 1.32


def _build(cudnn, cp, handle, which, dims, kv_heads, strides, io_name, scale, causal, describe, deterministic=False):
    """Build (validate, plan, compile) one forward or backward SDPA graph with fixed uids. ``dims`` are q's
    [B, H, T, D]; k, v, dK, dV have ``kv_heads`` heads."""
    io = cudnn.data_type.BFLOAT16 if io_name == "bf16" else cudnn.data_type.HALF
    f32 = cudnn.data_type.FLOAT
    B, H, T, D = dims
    sdims, sstr = [B, H, T, 1], [H * T, T, 1, 1]
    shape = {n: [B, kv_heads, T, D] if n in ("k", "v", "dK", "dV") else list(dims) for n in _UID}
    errors = []
    for label, mask in _mask_variants(cudnn, causal):
        try:
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            t = {n: g.tensor(name=n, dim=shape[n], stride=list(strides[n]), data_type=io, uid=_UID[n])
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
                    tensor.set_output(True).set_dim(shape[n]).set_stride(list(strides[n])).set_data_type(
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


def _entry(cudnn, cp, dev, which, arrays, dtype, scale, causal, deterministic=False):
    dims = tuple(int(s) for s in arrays["q"].shape)
    kv_heads = int(arrays["k"].shape[1])
    strides = {n: _elem_strides(a) for n, a in arrays.items() if n != "stats"}
    io_name = backend.dtype_name(dtype)
    det = which == "bwd" and bool(deterministic)
    key = (dev.device_id, which, dims, kv_heads, io_name, float(scale), bool(causal), tuple(sorted(strides.items())),
           det)
    e = _GRAPHS.get(key)
    if e is None:
        describe = (f"B,H,T,D={list(dims)}" + (f" H_kv={kv_heads}" if kv_heads != dims[1] else "")
                    + f" {io_name} causal={causal} scale={scale:.6g} strides "
                    + ", ".join(f"{n}{list(s)}" for n, s in strides.items()))
        build = (cudnn, cp, dev.handle, which, dims, kv_heads, strides, io_name, scale, causal, describe)
        try:
            e = _build(*build, det)
        except RuntimeError:
            if not det:
                raise
            # no deterministic engine for this shape: the default one, and backward_is_deterministic() says so
            e = _build(*build, False)
        _GRAPHS[key] = e
    return e


def backward_is_deterministic() -> bool | None:
    """Whether every backward graph built so far runs cuDNN's deterministic algorithm (None: none built)."""
    entries = [e for k, e in _GRAPHS.items() if k[1] == "bwd"]
    return all(e.deterministic for e in entries) if entries else None


def graph_count() -> int:
    """Number of cached cuDNN attention graphs."""
    return len(_GRAPHS)


def _elem_strides(a):
    it = a.dtype.itemsize
    return tuple(int(s) // it for s in a.strides)


def check_layout(q, k, v):
    """What cuDNN needs beyond the common checks (16-byte aligned pointers, done by the caller): D divisible by 8."""
    if q.shape[-1] % 8:
        raise ValueError(f"cuDNN flash attention needs a head dimension D divisible by 8, got {q.shape[-1]}")


def forward(q, k, v, o, lse, scale, causal):
    """o, lse = cuDNN SDPA forward on CuPy arrays (already checked by the caller)."""
    cp = backend.cupy_module()
    cudnn = _cudnn()
    dev = _device(cudnn, cp)
    arrays = {"q": q, "k": k, "v": v, "o": o, "stats": lse}
    _execute(cudnn, dev, _entry(cudnn, cp, dev, "fwd", arrays, q.dtype, scale, causal), arrays)


def backward(do, q, k, v, o, lse, scale, causal, dq, dk, dv, *, deterministic=True):
    """dq, dk, dv = cuDNN SDPA backward (``deterministic``: cuDNN's deterministic algorithm where it has one for the
    shape, see above; False: its default, faster one, whose dQ differs run to run in the last bits)."""
    if q.shape[2] == 1:
        # One position: softmax over a single score is 1, so o = v and the scores get no gradient
        # (dS = P ⊙ (dP − Σ P⊙dP) = 0): dq = dk = 0, dv = dO. cuDNN (frontend 1.32, seen on the H200)
        # builds no backward graph for T = 1, so this exact special case stands in for it. With grouped K/V,
        # dV of a K/V head is the sum of dO over its query heads (fp32, rounded once).
        dq[...] = 0
        dk[...] = 0
        if dv.shape == do.shape:
            dv[...] = do
        else:
            B, H, _, D = do.shape
            dv[...] = do.astype(backend.float32).reshape(B, dv.shape[1], H // dv.shape[1], 1, D).sum(axis=2).astype(
                dv.dtype)
        return
    cp = backend.cupy_module()
    cudnn = _cudnn()
    dev = _device(cudnn, cp)
    arrays = {"q": q, "k": k, "v": v, "o": o, "dO": do, "stats": lse, "dQ": dq, "dK": dk, "dV": dv}
    _execute(cudnn, dev, _entry(cudnn, cp, dev, "bwd", arrays, q.dtype, scale, causal, deterministic), arrays)


__all__ = ["CudnnUnavailableError", "INSTALL_HINT", "available", "backward",
           "backward_is_deterministic", "check_layout", "forward", "graph_count", "unavailable_reason"]
