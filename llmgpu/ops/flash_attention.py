"""Fused (flash) attention: our CUDA kernels on tensor cores, cuDNN's as an optional alternative (chapter 2b).

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

Implementations (``kernel=``), on CuPy arrays:

* ``"ours"``   our kernels: tensor-core MMAs, fp16 or bf16 in, fp32 accumulation, head dims 64 and 128, any T,
  causal or not. The forward is ``"wgmma"`` where that runs (Hopper), else ``"mma"``. The backward
  (``kernels/flash_attention.cu``, ``mma.sync``) is deterministic (no atomics: one kernel over key tiles for dK,
  dV and one over query tiles for dQ), so it is bitwise repeatable; its ``variant=`` picks among candidate tilings
  of those kernels (``BWD_VARIANTS``, ``flash_launch``).
* ``"mma"``    forward only: ``kernels/flash_attention.cu``'s ``flash_fwd`` (inline PTX ``mma.sync``, NVIDIA sm_80+).
* ``"wgmma"``  forward only: ``kernels/flash_attention_wgmma.cu``, Hopper's asynchronous warpgroup MMAs (sm_90a),
  which overlap the softmax of one key tile with the MMAs of the next; an error on other GPUs.
* ``"scalar"`` forward only: the same tiling in plain fp32 arithmetic (no tensor cores), the teaching step.
* ``"cudnn"``  NVIDIA's fused attention through the cuDNN frontend (``llmgpu.ops.cudnn_attention``, an optional
  extra: ``pip install 'llmgpu[fast]'``), with its deterministic backward.
* ``"auto"``   (default, ``DEFAULT_KERNEL``) whichever of ours and cuDNN is faster here, timed once per shape (B, H,
  H_kv, T, D, dtype, causal, direction) on the first call; cuDNN unless ours is at least ``AUTO_MARGIN`` faster;
  ours where cuDNN is not installed or cannot take the shape, cuDNN for head dims ours lacks. What it resolved to is
  written into ``choices=`` (a ``KernelChoices`` the caller owns: ``FastGPT`` keeps one per model, and a training
  run saves it in its checkpoint and pins it on resume, so the resumed steps run the same kernels, bit-exact), else
  into this process's record (``auto_choices()``); a record is read before anything is timed, then the machine's
  cache file (``auto_cache_path``, keyed by GPU name, CUDA and cuDNN versions and our kernel source). The first call
  of a shape syncs the device (it times): make it outside CUDA-graph capture, as a warm-up (inside capture, without
  a decision, ours runs).

NumPy arrays run the reference of the same algorithm (``llmgpu.ops.flash_reference``, tiled online softmax;
float32 math, float64 stays float64), so the math is checked on any machine.

Same call shapes as ``llmgpu.ops.attention``: q, k, v ``[B, H, T, D]``, returning ``(o, stats)`` where ``stats``
is an ``AttentionStats`` holding ``lse`` (fp32 ``[B, H, T]``; cuDNN's "softmax stats" are the same numbers, so
either backward takes either forward's stats). The arrays may be **strided views**: ``split_qkv(qkv, n_head)``
gives q, k, v as views of the ``[B, T, 3C]`` output of the QKV projection and ``heads_view(y, n_head)`` a
``[B, H, T, D]`` view of a ``[B, T, C]`` buffer, so no transposing copies are needed around attention (``out=``,
``dq=``, ``dk=``, ``dv=`` accept such views). On the GPU every array starts on a 16-byte boundary and our kernels
need element strides that are multiples of 8 (what those views give for D = 64 or 128).

Grouped-query attention (GQA): k and v (and dk, dv) may have H_kv heads, H_kv dividing H, query head h reading K/V
head h // (H / H_kv) (the order of chapter 2's ``attention_forward``, which also takes it). Both take such K/V as
they are (no repeated copies) and return dK/dV with H_kv heads: cuDNN natively; ours with the forward and dQ kernels
reading K/V head h // G, and each dK/dV block summing over its K/V head's G query heads in fp32 registers before
one store (deterministic: no atomics; ``kernels/flash_attention.cu``). "auto" times the two per H_kv as for any
shape. The NumPy reference repeats K/V per group and sums dK/dV over it.

Our launches allocate nothing but one fp32 [B, H, T] buffer for D per shape (cached, made on the first call), so
after a warm-up they are capturable in a CUDA graph.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_bool, check_choice, check_float, check_gpu_dtype
from . import cudnn_attention, flash_reference
from .attention import AttentionStats, default_scale, kv_group
from .cudnn_attention import INSTALL_HINT, CudnnUnavailableError
from .flash_auto_cache import (
    AUTO_MARGIN,
    AUTO_RESOLVES_TO,
    KernelChoices,
    auto_cache_path,
    pick_faster,
    read_auto_cache,
    write_auto_choice,
)
from .flash_launch import (
    BWD_VARIANTS,
    DEFAULT_BWD_VARIANT,
    FLASH_DTYPES,
    FWD_IMPLS,
    ROPE_VARIANTS,
    bwd_variant,
    forward_impl,
    ours_backward,
    ours_forward,
    smem_bytes,
)
from .qkv_views import heads_view, split_qkv
from .rope import check_rope_tables, rope_backward_heads

KERNELS = ("auto", *FWD_IMPLS, "cudnn")  # the forward's; the backward takes "auto", "ours", "cudnn"
DEFAULT_KERNEL = "auto"
HEAD_DIMS = (64, 128)  # what our kernels are instantiated for
AUTO_REPS = 3  # timed calls per candidate when "auto" decides


# --------------------------------------------------------------------------- availability


def unavailable_reason() -> str | None:
    """None when fused attention can run here (a GPU: our kernels need nothing else); else one line why not."""
    return backend.gpu_unavailable_reason()


def available() -> bool:
    return unavailable_reason() is None


_BACKWARD_RAN: set = set()  # implementations whose backward has run: "ours", "cudnn"


def backward_is_deterministic() -> bool | None:
    """Whether every backward run so far was bitwise repeatable (ours always is; cuDNN's when its deterministic
    algorithm was built); None when no backward has run."""
    if not _BACKWARD_RAN:
        return None
    return "cudnn" not in _BACKWARD_RAN or bool(cudnn_attention.backward_is_deterministic())


def graph_count() -> int:
    """Number of cached cuDNN attention graphs."""
    return cudnn_attention.graph_count()


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


def _check_inputs(q, k, v):
    """xp for q [B, H, T, D] and k, v [B, H_kv, T, D] (H_kv dividing H)."""
    xp = array_module(q=q, k=k, v=v)
    _check_bhtd("q", q)
    B, H, T, D = q.shape
    _check_bhtd("k", k, dtype=q.dtype)
    if k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"k must have shape [{B}, H_kv, {T}, {D}], got {tuple(k.shape)}")
    _check_bhtd("v", v, shape=k.shape, dtype=q.dtype)
    kv_group(H, k.shape[1])
    if xp is not np:
        check_gpu_dtype("q", q, FLASH_DTYPES, hint="fused attention; fp32 runs on llmgpu.ops.attention")
    return xp


def _check_choices(choices):
    if choices is not None and not isinstance(choices, KernelChoices):
        raise TypeError(f"choices must be a KernelChoices (or None: the process's record), got "
                        f"{type(choices).__name__}")


def _check_gpu_layout(**arrays):
    for n, a in arrays.items():
        if a.data.ptr % 16:
            raise ValueError(f"{n} must start on a 16-byte boundary")


def ours_unsupported(q, *arrays) -> str | None:
    """Why our kernels cannot take these CuPy arrays, q [B, H, T, D] and the others [B, H or H_kv, T, D] (H_kv
    dividing H: grouped K/V heads are fine); None when they can."""
    B, H, T, D = q.shape
    if any(not a.shape[1] or H % a.shape[1] for a in arrays):  # the public calls check it first (kv_group)
        return f"our flash attention kernels take K/V heads dividing H={H}, got {[a.shape[1] for a in arrays]}"
    if D not in HEAD_DIMS:
        return f"our flash attention kernels take head dims {HEAD_DIMS}, got D={D} (kernel='cudnn' takes D % 8 == 0)"
    for a in (q, *arrays):
        st = [s // a.dtype.itemsize for s, n in zip(a.strides[:3], a.shape[:3]) if n > 1]
        if any(s % 8 for s in st):
            return (f"our flash attention kernels need element strides that are multiples of 8 (16-byte rows), got "
                    f"{[s // a.dtype.itemsize for s in a.strides]}: pass a contiguous copy")
    if any(T * (a.strides[2] // a.dtype.itemsize) >= 2**31 for a in (q, *arrays)):  # 32-bit row offsets
        return f"our flash attention kernels take T · (row stride) < 2**31 elements, got T={T}: pass a contiguous copy"
    if B * H >= 2**31 or -(-T // 16) > 65535:
        return f"our flash attention kernels take B·H < 2**31 and T ≤ {65535 * 16}, got B·H={B * H}, T={T}"
    return None


def _require_ours(q, *arrays):
    why = ours_unsupported(q, *arrays)
    if why:
        raise ValueError(why)


# our kernels' launches (tile shapes, shared memory, the backward variants): flash_launch.py


# --------------------------------------------------------------------------- choosing ("auto")

_PROCESS_CHOICES: dict = {}  # device id -> KernelChoices: what "auto" resolved in this process, for every caller


def auto_choices() -> dict:
    """What ``kernel="auto"`` resolved to so far in this process, per (device, direction, B, H, T, D, dtype,
    causal[, H_kv] as in ``KernelChoices``): the process's record, which also holds what callers' own records
    (``choices=``) got."""
    return {(dev, *key): c for dev, rec in _PROCESS_CHOICES.items() for key, c in rec.items()}


def choices_unavailable(choices: KernelChoices) -> dict[str, str]:
    """{kernel: why it cannot run here} for the kernels a record holds that this process cannot run (a record made
    where cuDNN was installed, read where it is not); {} when all can."""
    used = {c for _, c in choices.items()}
    why = {"cudnn": cudnn_attention.unavailable_reason() if "cudnn" in used else None,
           "ours": unavailable_reason() if "ours" in used else None}
    return {k: w for k, w in why.items() if w}


def _machine_key(cp, direction, shape, dtype_name, causal, fwd_impl="mma", kv_heads=None) -> str:
    """The disk-cache key: what the timing depends on (GPU, CUDA, cuDNN, our kernels' source) and the call."""
    try:
        gpu = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        gpu = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
    except Exception:
        gpu = "unknown-gpu"
    try:
        cudnn = int(cudnn_attention._cudnn().backend_version())
    except Exception:
        cudnn = None
    kdir = Path(__file__).resolve().parent.parent / "kernels"
    impl = fwd_impl  # which of ours was timed: the forward's impl, the backward's variant
    files = ["flash_attention.cu", "common.cuh", "flash_common.cuh"] + ["flash_attention_wgmma.cu", "wgmma.cuh"] * (
        impl in ("wgmma", "dkdv-wgmma"))
    try:
        ours = hashlib.sha1(b"".join((kdir / f).read_bytes() for f in files)).hexdigest()[:12]
    except OSError:
        ours = "?"
    ours += f" {impl}"
    kv = f" H_kv={kv_heads}" if kv_heads not in (None, shape[1]) else ""
    return (f"{gpu}|cuda {cp.cuda.runtime.runtimeGetVersion()}|cudnn {cudnn}|ours {ours}|{direction}|{dtype_name}|"
            f"B={shape[0]} H={shape[1]}{kv} T={shape[2]} D={shape[3]}|causal={bool(causal)}")


def _capturing(cp) -> bool:
    try:
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:
        return False


def _time_ms(cp, fn) -> float:
    fn()  # warm-up: compiles the kernels / builds the cuDNN graph
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(AUTO_REPS):
        fn()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / AUTO_REPS


def _timed_bwd_variant(q) -> str:
    """The name the disk cache keys our default backward by ("dkdv-wgmma" for the Hopper one, so that a choice timed
    with it is not confused with one timed with the portable kernels)."""
    return "dkdv-wgmma" if bwd_variant(q) == "wgmma" else "mma"


def _resolve(kernel, direction, q, arrays, causal, run, choices, deterministic=True):
    """The implementation to run: ``kernel`` itself, or for "auto" the recorded / cached / freshly timed faster one
    (module docstring), written into ``choices`` (None: the process's record). ``run(name)`` launches
    implementation ``name`` on the caller's buffers (timing writes them too). A backward that need not be
    deterministic is another contest (cuDNN's faster algorithm), recorded under its own key."""
    check_choice("kernel", kernel, KERNELS if direction == "fwd" else ("auto", *AUTO_RESOLVES_TO))
    if kernel != "auto":
        return kernel
    cp = backend.cupy_module()
    contest = direction if deterministic else f"{direction}-nondeterministic"
    key = (contest, *q.shape, backend.dtype_name(q.dtype), bool(causal))
    if arrays[0].shape[1] != q.shape[1]:  # grouped K/V heads (arrays[0] is k): a shape of its own
        key += (arrays[0].shape[1],)
    process = _PROCESS_CHOICES.setdefault(cp.cuda.Device().id, KernelChoices())
    record = process if choices is None else choices

    def decided(name):
        for r in (record, process):
            r.record(key, name)
        return name

    hit = record.get(key)
    if hit is not None:  # recorded (or pinned from a checkpoint): the same kernel again, nothing timed
        return hit
    if (hit := process.get(key)) is not None:
        return decided(hit)
    cands = [n for n, ok in (("ours", ours_unsupported(q, *arrays) is None),
                             ("cudnn", cudnn_attention.available() and q.shape[-1] % 8 == 0)) if ok]
    if not cands:
        _require_ours(q, *arrays)  # raises with ours' reason
    if len(cands) == 1:  # nothing to compare: the same choice in every process
        return decided(cands[0])
    disk_key = _machine_key(cp, contest, q.shape, backend.dtype_name(q.dtype), causal,
                            forward_impl(q) if direction == "fwd" else _timed_bwd_variant(q),
                            kv_heads=arrays[0].shape[1])
    cached = read_auto_cache().get(disk_key)
    if cached in cands:  # decided before on this machine, maybe by another process: the same choice again
        return decided(cached)
    if _capturing(cp):
        return cands[0]
    times = {}
    for name in cands:
        try:
            times[name] = _time_ms(cp, lambda: run(name))
        except Exception:  # e.g. cuDNN without an engine for this shape
            continue
    if not times:
        return cands[0]
    best = decided(pick_faster(times))
    if len(times) == len(cands):  # a real comparison: worth remembering across processes
        write_auto_choice(disk_key, best)
    return best


# --------------------------------------------------------------------------- public API


def flash_attention_forward(q, k, v, causal=True, *, scale=None, out=None, lse=None, kernel=None, choices=None):
    """``O = softmax(scale · q kᵀ, causal) v`` without materialising the scores; returns ``(o, stats)``.

    q ``[B, H, T, D]``, k, v ``[B, H_kv, T, D]`` with H_kv = H, or H_kv dividing H (grouped-query attention, on
    every kernel); strided views allowed, unit stride along D. ``stats`` is an ``AttentionStats`` with ``lse``
    (fp32 ``[B, H, T]``): what ``flash_attention_backward`` needs.
    ``out`` ([B, H, T, D], may be a view such as ``heads_view(y, H)``) and ``lse`` (contiguous fp32
    [B, H, T]) are written when given (static buffers for CUDA graphs), else allocated.
    ``kernel``: "auto" (default: ``DEFAULT_KERNEL``), "ours", "mma", "wgmma", "scalar" or "cudnn" (GPU only; see
    the module). ``choices``: the ``KernelChoices`` record "auto" reads first and writes what it resolved into
    (None: the process's record).
    """
    xp = _check_inputs(q, k, v)
    _check_choices(choices)
    B, H, T, D = q.shape
    scale = default_scale(D) if scale is None else check_float("scale", scale)
    check_bool("causal", causal)
    o = _out("out", out, q.shape, q.dtype, xp)
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    if lse is None:
        lse = xp.empty((B, H, T), dtype=lse_dtype)
    else:
        if backend.get_array_module(lse) is not xp:
            raise TypeError("lse must live on the same device as q")
        check_array("lse", lse, shape=(B, H, T), dtype=lse_dtype)
    kernel = DEFAULT_KERNEL if kernel is None else kernel
    if xp is np:
        check_choice("kernel", kernel, KERNELS)
        G = H // k.shape[1]
        k, v = (np.repeat(a, G, axis=1) if G > 1 else a for a in (k, v))  # the reference repeats grouped K/V
        ref_o, ref_lse = flash_reference.tiled_forward(q, k, v, scale, causal)
        o[...] = ref_o.astype(o.dtype)
        lse[...] = ref_lse.astype(lse.dtype)
        return o, AttentionStats(lse=lse, scale=scale, causal=causal)
    _check_gpu_layout(q=q, k=k, v=v, out=o)

    def run(name):
        if name == "cudnn":
            cudnn_attention.check_layout(q, k, v)
            cudnn_attention.forward(q, k, v, o, lse, scale, causal)
        else:
            _require_ours(q, k, v, o)
            ours_forward(q, k, v, o, lse, scale, causal, impl=name)

    run(_resolve(kernel, "fwd", q, (k, v, o), causal, run, choices))
    return o, AttentionStats(lse=lse, scale=scale, causal=causal)


def flash_attention_backward(do, q, k, v, o, stats, causal=True, *, dq=None, dk=None, dv=None, kernel=None,
                             variant=None, choices=None, deterministic=True, rope=None):
    """Gradients ``(dq, dk, dv)`` from dO, the inputs, the forward's output and its ``stats`` (lse).

    do, q, o are ``[B, H, T, D]``, k, v and dk, dv ``[B, H_kv, T, D]`` (as for the forward; dk and dv sum over
    each K/V head's group of query heads); strided views allowed. ``dq``/``dk``/``dv`` are written
    when given (e.g. ``split_qkv(dqkv, H)``, so the gradient lands in the [B, T, 3C] layout the QKV
    projection's backward reads), else allocated contiguous. ``kernel``: "auto" (default), "ours" or "cudnn".
    ``variant``: which of our backward kernels (``BWD_VARIANTS``, see ``flash_launch``; default
    ``DEFAULT_BWD_VARIANT``), only with ``kernel="ours"``. ``choices``: as for the forward. ``deterministic``
    (default True): every candidate bitwise repeatable (ours always is; cuDNN's deterministic algorithm);
    False lets cuDNN run its default backward (dQ summed with atomics: faster, the last bits vary run to run;
    what PyTorch's SDPA runs), and "auto" times and records that pair under a key of its own.
    ``rope``: ``rope_tables``' (cos, sin) when q and k were rotated by RoPE (the Llama step): dq, dk are then those of
    the *unrotated* q, k (our wide kernels fold RoPE's backward into their stores; cuDNN, the base variant and NumPy
    run ``rope_backward`` after), and "auto" times each contestant with its RoPE pass (contest "bwd-rope").
    """
    if variant is not None:
        check_choice("variant", variant, BWD_VARIANTS)
        if kernel != "ours":
            raise ValueError(f"variant= picks among our backward kernels: pass kernel='ours' (got kernel={kernel!r})")
    xp = _check_inputs(q, k, v)
    _check_choices(choices)
    array_module(q=q, do=do, o=o)
    _check_bhtd("do", do, shape=q.shape, dtype=q.dtype)
    _check_bhtd("o", o, shape=q.shape, dtype=q.dtype)
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be the AttentionStats returned by flash_attention_forward, got "
                        f"{type(stats).__name__}")
    if stats.lse is None:
        raise ValueError("stats holds no lse (it comes from llmgpu.ops.attention_forward, which keeps P): "
                         "use llmgpu.ops.attention.attention_backward for it")
    if check_bool("causal", causal) != stats.causal:
        raise ValueError(f"stats were computed with causal={stats.causal}, backward called with causal={causal}")
    B, H, T, D = q.shape
    lse = stats.lse
    array_module(q=q, **{"stats.lse": lse})
    check_array("stats.lse", lse, shape=(B, H, T), dtype=np.float64 if q.dtype == np.float64 else np.float32)
    dq = _out("dq", dq, q.shape, q.dtype, xp)
    dk = _out("dk", dk, k.shape, q.dtype, xp)
    dv = _out("dv", dv, k.shape, q.dtype, xp)
    if rope is not None:
        rope = check_rope_tables(rope, T, D, xp)
    kernel = DEFAULT_KERNEL if kernel is None else kernel
    if xp is np:
        check_choice("kernel", kernel, ("auto", "ours", "cudnn"))
        for (a, u), (b, w) in itertools.combinations((("dq", dq), ("dk", dk), ("dv", dv)), 2):
            if np.shares_memory(u, w):  # exact on NumPy; the GPU path (views of one packed buffer) is unchecked
                raise ValueError(f"{a} and {b} share memory: each gradient needs a buffer of its own")
        for g, r in zip((dq, dk, dv), flash_reference.grouped_backward(do, q, k, v, o, lse, stats.scale, causal)):
            g[...] = r.astype(g.dtype)
        for g in (dq, dk) if rope is not None else ():
            rope_backward_heads(g, *rope)
        return dq, dk, dv
    _check_gpu_layout(q=q, k=k, v=v, do=do, o=o, dq=dq, dk=dk, dv=dv)
    variant = bwd_variant(q, variant)
    fold = rope is not None and variant in ROPE_VARIANTS and all(t.data.ptr % 8 == 0 for t in rope)

    def run(name):
        if name == "cudnn":
            cudnn_attention.check_layout(q, k, v)
            cudnn_attention.backward(do, q, k, v, o, lse, stats.scale, causal, dq, dk, dv, deterministic=deterministic)
        else:
            _require_ours(q, k, v, do, o, dq, dk, dv)
            ours_backward(do, q, k, v, o, lse, stats.scale, causal, dq, dk, dv, variant,
                          rope=rope if fold else None)
        if rope is not None and not (name == "ours" and fold):
            for g in (dq, dk):
                rope_backward_heads(g, *rope)
        _BACKWARD_RAN.add(name)

    direction = "bwd" if rope is None else "bwd-rope"
    run(_resolve(kernel, direction, q, (k, v, do, o, dq, dk, dv), causal, run, choices, deterministic))
    return dq, dk, dv


def flash_attention_flops(B, H, T, D, causal=True, direction="fwd") -> float:
    """Useful FLOPs (FlashAttention's convention, as ``attention_flops``): forward 4·B·H·T²·D, halved when
    causal; backward 2.5 × forward (it recomputes the scores)."""
    fwd = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return fwd if direction == "fwd" else 2.5 * fwd


def flash_traffic_bytes(B, H, T, D, dtype, direction="fwd", *, kv_heads=None) -> int:
    """Minimum bytes: forward reads q, k, v and writes o (+ fp32 lse); backward reads q, k, v, o, dO, lse and
    writes dq, dk, dv. ``kv_heads``: H_kv of grouped-query attention (k, v, dk, dv have H_kv heads; None: H)."""
    it = backend.resolve_dtype(dtype).itemsize
    n = B * H * T * D
    n_kv = n if kv_heads is None else B * int(kv_heads) * T * D
    return ((2 * n + 2 * n_kv) * it + 4 * B * H * T) if direction == "fwd" else \
        ((4 * n + 4 * n_kv) * it + 4 * B * H * T)


__all__ = ["AUTO_MARGIN", "AUTO_RESOLVES_TO", "BWD_VARIANTS", "CudnnUnavailableError", "DEFAULT_BWD_VARIANT",
           "DEFAULT_KERNEL", "HEAD_DIMS", "INSTALL_HINT", "KERNELS", "KernelChoices",
           "auto_cache_path", "auto_choices", "choices_unavailable", "pick_faster", "read_auto_cache",
           "write_auto_choice",
           "available", "backward_is_deterministic", "flash_attention_backward", "flash_attention_flops",
           "flash_attention_forward", "flash_traffic_bytes", "graph_count", "heads_view", "ours_unsupported",
           "smem_bytes", "split_qkv", "unavailable_reason"]
