"""Row-major GEMMs through cuBLASLt, with fused epilogues, capturable in a CUDA graph (chapter 8).

**NVIDIA-only fast path**: cuBLASLt through nvmath-python exists for NVIDIA GPUs only (on an AMD GPU
the book step's ``llmgpu.gemm`` would be the one to port: CuPy's ROCm build maps its cuBLAS to hipBLAS).

Why a second GEMM module next to ``llmgpu.gemm``:

* **CUDA graphs.** CuPy refuses its own cuBLAS calls while a stream is capturing, so a training step
  whose GEMMs go through ``cupy.cublas`` (``llmgpu.gemm.gemm``, ``cupy.matmul``) cannot become one
  graph. cuBLASLt called directly (through ``nvmath-python``'s low-level bindings,
  ``nvmath.bindings.cublasLt``) can: one ``cublasLtMatmul`` is one kernel launch on the stream we
  name, with nothing allocated and nothing waited for.
* **Epilogues.** cuBLASLt fuses cheap element-wise work into the GEMM's store: adding a bias,
  applying GELU (and keeping the pre-activation for the backward pass), multiplying by GELU' in the
  backward, and summing the bias gradient while the weight gradient is computed. Each one saves a
  full read and write of an [N, 4C] activation.

Same row-major ↔ column-major identity as ``llmgpu.gemm`` (read its docstring): for row-major
``C[M, N] = op(a)[M, K] @ op(b)[K, N]`` we ask cuBLASLt for the column-major ``Cᵀ = op(b)ᵀ op(a)ᵀ``,
so cuBLASLt's ``A`` operand is our ``b`` and its ``B`` operand is our ``a``. Epilogues in row-major
terms (all arithmetic in fp32, whatever the storage type):

===============  =============================================================  ===================
``epilogue``     what is written                                                cuBLASLt epilogue
===============  =============================================================  ===================
``"none"``       ``out = alpha·op(a)op(b) + beta·out``                          DEFAULT
``"bias"``       ``out = alpha·op(a)op(b) + beta·out + bias[None, :]``          BIAS
``"gelu_bias"``  ``aux = op(a)op(b) + bias``; ``out = GELU(aux)``               GELU_AUX_BIAS
                 without ``aux`` (inference: the pre-activation is not kept)    GELU_BIAS
``"dgelu"``      ``out = (op(a)op(b)) · GELU'(aux)``, aux = forward's pre-act   DGELU
``"bgradb"``     ``out = alpha·op(a)op(b) + beta·out``; ``dbias = Σ_k op(a)``   BGRADB
===============  =============================================================  ===================

``bias`` has N entries (one per output column), ``aux`` is [M, N] like ``out``, ``dbias`` has M
entries. For a linear layer ``y = x Wᵀ + b`` (x [T, Cin], W [Cout, Cin]):

* forward with GELU:  ``lt_gemm(x, W, trans_b=True, out=h, bias=b, epilogue="gelu_bias", aux=pre)``
* dgrad through GELU: ``lt_gemm(dh_next, W_next, out=dpre, epilogue="dgelu", aux=pre)``
* wgrad + bias grad:  ``lt_gemm(dy, x, trans_a=True, out=dW, epilogue="bgradb", dbias=db)``
  (BGRADB reduces cuBLASLt's B operand over K; under the identity that is our ``op(a) = dyᵀ``, so
  ``db = Σ_rows dy``.) ``dbias`` is *overwritten*; accumulate it yourself when needed.

cuBLASLt's GELU is the tanh approximation, the same function as ``llmgpu.ops.gelu`` (GPT-2's). The
H200 probe found all four epilogues correct, and DGELU_BGRAD (dgrad + bias gradient in
one call) *slower* than DGELU followed by a separate bias-gradient reduction, so it is not offered.

**Capturable.** Per call: a dictionary lookup for the plan (matmul descriptor, matrix layouts and
the heuristic's algorithm, cached per shape / dtype / epilogue / pointer alignment), at most two
descriptor attribute writes (the bias and aux pointers, host memory only), and the launch on
CuPy's current stream with a preallocated per-device workspace (``WORKSPACE_BYTES``). No device
allocation happens when ``out`` (and ``aux`` / ``dbias``) are given, no host synchronisation ever.
Make the first call of every shape outside stream capture (a warm-up): it builds the plan, and the
very first call on a device allocates the workspace.

**Split-K, per problem.** A GEMM whose output has few tiles and whose K is long (a weight gradient) can
run one of the heuristic's algorithms with K split in parts that are added in a fixed order: ``llmgpu.gemm.lt_splitk``
holds the table of problems that do (measured), ``set_split_k`` installs another; a plan applies it
when it is built, so launches and captures are unchanged.

NumPy arrays run a reference of the same math (float32; float64 stays float64), so everything here
is testable without a GPU. Without ``nvmath-python`` the CuPy path raises ``LtUnavailableError``
naming the extra to install: ``pip install 'llmgpu[fast]'``.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np

from .. import backend
from ..checks import (
    array_module,
    check_array,
    check_choice,
    gpu_path_unavailable_reason,
    optional_import,
    require_module,
)
from ..ops.gelu import gelu_backward_reference, gelu_forward_reference
from . import lt_splitk
from .cublas import CUBLAS_COMPUTE_32F, CUDA_DATA_TYPES, check_operands, prepare_out, scalar_ptr
from .lt_plan import LtPlan, alignment, set_attr

EPILOGUES = ("none", "bias", "gelu_bias", "dgelu", "bgradb")
LT_EPILOGUE = {"none": "DEFAULT", "bias": "BIAS", "gelu_bias": "GELU_AUX_BIAS", "dgelu": "DGELU", "bgradb": "BGRADB",
                "gelu_bias_noaux": "GELU_BIAS"}  # the last: "gelu_bias" called without aux (lt_gemm picks it)

CUDA_R_32F = CUDA_DATA_TYPES[backend.float32]  # the scale type: alpha and beta are fp32 (cublas.py has the codes;
# its CUBLAS_COMPUTE_32F is cublasComputeType_t, not nvmath.ComputeType, which is cuTENSOR's)

WORKSPACE_BYTES = 32 * 2**20  # NVIDIA's recommendation for Hopper; one buffer per device

INSTALL_HINT = ("install the optional fast path: pip install 'llmgpu[fast]' "
                "(brings nvmath-python==1.0.*, whose nvmath.bindings.cublasLt this module calls)")


class LtUnavailableError(backend.GPUUnavailableError):
    """The cuBLASLt path was asked for but nvmath-python (or a GPU) is missing."""


# --------------------------------------------------------------------------- availability


@functools.cache
def _import_lt():
    """(nvmath.bindings.cublasLt module or None, reason when None)."""
    return optional_import("nvmath.bindings.cublasLt", "nvmath-python", INSTALL_HINT)


def unavailable_reason() -> str | None:
    """None when the cuBLASLt path can run here; otherwise one line saying what is missing."""
    return gpu_path_unavailable_reason(_import_lt)


def available() -> bool:
    return unavailable_reason() is None


def lt_module():
    """The nvmath.bindings.cublasLt module, or LtUnavailableError saying what to install."""
    return require_module(_import_lt, LtUnavailableError)


# --------------------------------------------------------------------------- per-device state


class _DeviceState:
    """The cuBLASLt handle and the workspace of one device (created once, outside capture)."""

    def __init__(self, lt, cp, device_id: int):
        if _is_capturing(cp):
            raise RuntimeError(
                "the first lt_gemm call on a device allocates its cuBLASLt workspace and cannot run while "
                "the stream is capturing: call every GEMM shape once before capture (a warm-up step)")
        self.device_id = device_id
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.ws_ptr = int(self.workspace.data.ptr)
        self.ws_size = int(self.workspace.nbytes)
        self.attr_bias_pointer = int(lt.MatmulDescAttribute.BIAS_POINTER)
        self.attr_aux_pointer = int(lt.MatmulDescAttribute.EPILOGUE_AUX_POINTER)
        try:
            self.handle = lt.create()
        except Exception as e:
            raise LtUnavailableError(f"cublasLtCreate failed ({type(e).__name__}: {e}); {INSTALL_HINT}") from e


_DEVICES: dict = {}  # device id -> _DeviceState
_PLANS: dict = {}  # problem key -> _Plan


def _is_capturing(cp) -> bool:
    try:
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:  # the legacy default stream may refuse the query while another stream captures
        return False


def device_state(lt, cp) -> _DeviceState:
    """The current device's handle and workspace (made on the first call, which must not be in a capture)."""
    dev = cp.cuda.Device().id
    st = _DEVICES.get(dev)
    if st is None:
        st = _DEVICES[dev] = _DeviceState(lt, cp, dev)
    return st


# --------------------------------------------------------------------------- plans


class _Plan(LtPlan):
    """lt_gemm's problem: transposes, epilogue, bias / aux pointers (rewritten when a call brings others)."""

    __slots__ = ("ptr_buf", "ptr_addr", "last_bias", "last_aux", "has_bias", "has_aux")

    def __init__(self, lt, st: _DeviceState, spec: dict, bias_ptr: int, aux_ptr: int):
        super().__init__(lt, st, spec["describe"], spec["align"])
        A = lt.MatmulDescAttribute
        L = lt.MatrixLayoutAttribute
        set_lay = functools.partial(set_attr, lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype)
        self.ptr_buf = np.zeros(2, dtype=np.int64)  # [bias ptr, aux ptr] staging for attribute writes
        self.ptr_addr = int(self.ptr_buf.ctypes.data)
        self.has_bias = spec["bias_code"] is not None
        self.has_aux = spec["aux_ld"] is not None
        try:
            self.desc = lt.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F)
            # cuBLASLt's A is our b and its B is our a (the row-major identity): transposes swap too
            self.set_desc(A.TRANSA, 1 if spec["trans_b"] else 0)
            self.set_desc(A.TRANSB, 1 if spec["trans_a"] else 0)
            self.set_desc(A.EPILOGUE, int(getattr(lt.Epilogue, LT_EPILOGUE[spec["epilogue"]])))
            if self.has_bias:
                self.set_desc(A.BIAS_DATA_TYPE, spec["bias_code"])
                self.set_desc(A.BIAS_POINTER, bias_ptr)
            if self.has_aux:
                self.set_desc(A.EPILOGUE_AUX_POINTER, aux_ptr)
                self.set_desc(A.EPILOGUE_AUX_LD, spec["aux_ld"])
                self.set_desc(A.EPILOGUE_AUX_DATA_TYPE, spec["out_code"])
            m, n, count = spec["m"], spec["n"], spec["count"]
            (ar, ac), (br, bc) = spec["a_rc"], spec["b_rc"]
            # column-major views of the row-major buffers: a [r, c] row-major is c x r with ld = c
            self.la = self.new_layout(spec["in_code"], bc, br, bc)  # our b
            self.lb = self.new_layout(spec["in_code"], ac, ar, ac)  # our a
            self.lc = self.new_layout(spec["out_code"], n, m, n)  # out (C and D)
            if count > 1:
                for lay, stride in ((self.la, spec["b_stride"]), (self.lb, ar * ac), (self.lc, m * n)):
                    set_lay(lay, L.BATCH_COUNT, count)
                    set_lay(lay, L.STRIDED_BATCH_OFFSET, stride)
            self.ask_heuristic(1)  # its first choice is what runs
        except BaseException:
            self.destroy()
            raise
        self.last_bias, self.last_aux = bias_ptr, aux_ptr


def clear_plans():
    """Destroy every cached plan (call after the GPU finished the work that used them)."""
    for p in _PLANS.values():
        p.destroy()
    _PLANS.clear()


def cached_plan(key: tuple, build):
    """The cached plan of ``key``, or ``build()``'s, kept under ``key`` (``clear_plans`` destroys them all)."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = build()
    return plan


def _problem_of(plan_key_: tuple) -> tuple:
    """The split-K table's ``problem_key`` of a cached plan's key."""
    _dev, epilogue, a_dt, o_dt, _bias, ta, tb, m, n, k = plan_key_[:10]
    return lt_splitk.problem_key(m, n, k, a_dt, o_dt, trans_a=ta, trans_b=tb, epilogue=epilogue)


def _configure_split_k(plan, problem: tuple):
    """Switch a new plan to the split-K table's configuration for its problem, if any (asking the heuristic for more
    candidates when the entry names a later one). One cuBLASLt refuses (another GPU, another library version) runs
    the heuristic's pick instead, with a warning: the same product, slower."""
    choice = lt_splitk.lookup(problem)
    if choice is None:
        return
    splits, reduction, base = choice
    try:
        if base >= plan.n_algos:
            plan.ask_heuristic(base + 1)
        plan.use_split_k(splits, reduction, base)
    except (ValueError, IndexError, RuntimeError) as e:
        warnings.warn(f"split-K table entry not used: {e}", RuntimeWarning, stacklevel=3)


def set_split_k(table: dict | None) -> dict:
    """Install a split-K table (``lt_splitk``: ``problem_key(...) -> (splits, reduction[, base])``; None: the
    default, the measured winners) and return the previous one. Cached plans of the problems either table
    names are rebuilt on their next call, so call this outside stream capture, before a step's warm-up (a graph
    captured earlier keeps the algorithm it captured)."""
    old = lt_splitk.replace_table(table)
    touched = set(old) | set(lt_splitk.table())
    for key in [k for k, p in _PLANS.items() if isinstance(p, _Plan) and _problem_of(k) in touched]:
        _PLANS.pop(key).destroy()
    return old


def plan_count() -> int:
    """Number of cached cuBLASLt plans (one per distinct problem seen)."""
    return len(_PLANS)


# --------------------------------------------------------------------------- the public call


def lt_gemm(a, b, *, trans_a=False, trans_b=False, out=None, bias=None, epilogue="none", aux=None, dbias=None,
            alpha=1.0, beta=0.0, out_dtype=None):
    """``out = epilogue(alpha · op(a) @ op(b) + beta · out)`` for row-major arrays via cuBLASLt; returns out.

    ``a`` is [..., M, K] (or [..., K, M] with ``trans_a``), ``b`` is [..., K, N] (or [..., N, K]).
    Batched (leading axes) only with ``epilogue="none"``; ``b`` may then be 2-D and shared (without
    ``trans_a`` the batch is folded into M: one 2-D product). ``out``
    defaults to a new array of ``out_dtype`` (default: the input dtype; fp32 also allowed, e.g. fp32
    weight gradients from bf16 inputs). Epilogues (module docstring): ``"bias"`` needs ``bias`` [N];
    ``"gelu_bias"`` needs ``bias`` [N] and takes ``aux`` [M, N] (written: the pre-activation; without it the
    pre-activation is not kept, cuBLASLt's GELU_BIAS, for a forward that has no backward);
    ``"dgelu"`` needs ``aux`` [M, N] (read: the forward's pre-activation); ``"bgradb"`` needs
    ``dbias`` [M] (written, in ``out``'s dtype). ``aux`` has ``out``'s dtype. ``alpha`` must be
    1 for the GELU and bias-gradient epilogues and ``beta`` 0 for the GELU ones.
    """
    check_choice("epilogue", epilogue, EPILOGUES)
    xp = array_module(a=a, b=b, out=out, bias=bias, aux=aux, dbias=dbias)
    on_np = xp is np
    m, n, k, batch = check_operands(a, b, trans_a, trans_b, xp, op="lt_gemm")
    if batch and epilogue != "none":
        raise ValueError(f"epilogue {epilogue!r} takes 2-D a and b; batched products support epilogue='none' only")
    out_shape = (*batch, m, n)
    out = prepare_out(out, out_shape, a.dtype, xp, beta=beta, out_dtype=out_dtype)
    alpha, beta = float(alpha), float(beta)

    # ---- epilogue operands
    need = {"none": (), "bias": ("bias",), "gelu_bias": ("bias",), "dgelu": ("aux",), "bgradb": ("dbias",)}
    takes = {"gelu_bias": ("aux",)}  # optional operands
    given = {"bias": bias, "aux": aux, "dbias": dbias}
    for name, arr in given.items():
        if name in need[epilogue] and arr is None:
            raise ValueError(f"epilogue {epilogue!r} needs {name}=")
        if name not in need[epilogue] + takes.get(epilogue, ()) and arr is not None:
            raise ValueError(f"{name}= was given but epilogue {epilogue!r} does not use it")
    if bias is not None:
        check_array("bias", bias, shape=(n,))
        if bias.dtype not in (a.dtype, out.dtype, backend.float32):
            raise TypeError(f"bias must be {backend.dtype_name(a.dtype)} or fp32, got {bias.dtype}")
    if aux is not None:
        check_array("aux", aux, shape=(m, n), dtype=out.dtype)
    if dbias is not None:
        check_array("dbias", dbias, shape=(m,))
        # cuBLASLt writes the bias gradient in the output's type: on the H200, bf16/fp16 inputs with a
        # 16-bit out and an fp32 dbias found no algorithm (CUBLAS_STATUS_INVALID_VALUE), while fp32
        # out + fp32 dbias and 16-bit out + 16-bit dbias ran. Refuse the rest here, on both backends.
        if dbias.dtype != out.dtype and not (on_np and dbias.dtype == backend.float64):
            raise TypeError(
                f"dbias must have out's dtype ({backend.dtype_name(out.dtype)}), got {dbias.dtype}; "
                "for an fp32 bias gradient pass an fp32 out (as the fp32 weight-gradient buffers are)"
            )
    if epilogue in ("gelu_bias", "dgelu", "bgradb") and alpha != 1.0:
        raise ValueError(f"epilogue {epilogue!r} requires alpha == 1, got {alpha}")
    if epilogue in ("gelu_bias", "dgelu") and beta != 0.0:
        raise ValueError(f"epilogue {epilogue!r} requires beta == 0, got {beta}")

    if batch and b.ndim == 2 and not trans_a:
        # a shared b and row-major a: the batch folds into M, one 2-D product instead of a strided batch
        a2, o2 = a.reshape(-1, a.shape[-1]), out.reshape(-1, n)
        if on_np:
            _lt_numpy(a2, b, False, trans_b, o2, None, "none", None, None, alpha, beta)
        else:
            _lt_cupy(xp, a2, b, False, trans_b, o2, None, "none", None, None, alpha, beta, a2.shape[0], n, k, ())
        return out
    if on_np:
        return _lt_numpy(a, b, trans_a, trans_b, out, bias, epilogue, aux, dbias, alpha, beta)
    if aux is not None and n % 8:
        raise ValueError(f"cuBLASLt's GELU aux buffer needs a leading dimension (N = {n}) divisible by 8")
    if epilogue == "gelu_bias" and aux is None:
        epilogue = "gelu_bias_noaux"  # its own plan: another cuBLASLt epilogue
    return _lt_cupy(xp, a, b, trans_a, trans_b, out, bias, epilogue, aux, dbias, alpha, beta, m, n, k, batch)


gemm = lt_gemm  # drop-in name: same arguments as llmgpu.gemm.gemm (plus the epilogue ones)


def plan_key(device_id, a, b, trans_a, trans_b, out, bias, epilogue, dbias, m, n, k, batch) -> tuple:
    """The key of a call's cached plan: device, epilogue, dtypes, flags, the problem's sizes and the pointers'
    alignment (not alpha, beta or the pointers themselves). ``tools/probes/probe_lt_algos.py`` finds plans by it."""
    ptrs = (int(a.data.ptr), int(b.data.ptr), int(out.data.ptr))
    return _plan_key(device_id, a, b, trans_a, trans_b, out, bias if bias is not None else dbias, epilogue, m, n, k,
                     batch, ptrs)


def _plan_key(device_id, a, b, trans_a, trans_b, out, bias_arr, epilogue, m, n, k, batch, ptrs) -> tuple:
    """``plan_key`` from the pointers and the bias (or dbias) array the launch reads anyway."""
    count = math.prod(batch) if batch else 1
    b_stride = k * n if b.ndim > 2 else 0
    a_ptr, b_ptr, o_ptr = ptrs
    if count > 1:
        align = (alignment(a_ptr, m * k * a.dtype.itemsize), alignment(b_ptr, b_stride * a.dtype.itemsize),
                 alignment(o_ptr, m * n * out.dtype.itemsize))
    else:
        align = (alignment(a_ptr), alignment(b_ptr), alignment(o_ptr))
    bias_code = CUDA_DATA_TYPES[bias_arr.dtype] if bias_arr is not None else None
    return (device_id, epilogue, a.dtype.name, out.dtype.name, bias_code, bool(trans_a), bool(trans_b), m, n, k,
            count, b.ndim > 2, align)


def _lt_cupy(cp, a, b, trans_a, trans_b, out, bias, epilogue, aux, dbias, alpha, beta, m, n, k, batch):
    lt = lt_module()
    st = device_state(lt, cp)
    a_ptr, b_ptr, o_ptr = ptrs = (int(a.data.ptr), int(b.data.ptr), int(out.data.ptr))
    bias_arr = bias if bias is not None else dbias
    key = _plan_key(st.device_id, a, b, trans_a, trans_b, out, bias_arr, epilogue, m, n, k, batch, ptrs)
    plan = _PLANS.get(key)
    bias_ptr = int(bias_arr.data.ptr) if bias_arr is not None else 0
    aux_ptr = int(aux.data.ptr) if aux is not None else 0
    if plan is None:
        bias_code, (count, b_batched, align) = key[4], key[-3:]
        b_stride = k * n if b_batched else 0
        spec = {
            "epilogue": epilogue, "trans_a": trans_a, "trans_b": trans_b, "m": m, "n": n, "k": k, "count": count,
            "a_rc": a.shape[-2:], "b_rc": b.shape[-2:], "b_stride": b_stride, "align": align,
            "in_code": CUDA_DATA_TYPES[a.dtype], "out_code": CUDA_DATA_TYPES[out.dtype], "bias_code": bias_code,
            "aux_ld": n if aux is not None else None,
            "describe": (f"{'batch ' + str(count) + ' x ' if count > 1 else ''}op(a)[{m}x{k}] @ op(b)[{k}x{n}] "
                         f"{backend.dtype_name(a.dtype)}->{backend.dtype_name(out.dtype)} epilogue={epilogue}"
                         f" (trans_a={trans_a}, trans_b={trans_b}, alignment a/b/out {align} B)"),
        }
        plan = _PLANS[key] = _Plan(lt, st, spec, bias_ptr, aux_ptr)
        if count == 1:
            _configure_split_k(plan, _problem_of(key))
    if plan.has_bias and bias_ptr != plan.last_bias:  # a host-side descriptor write, no device work
        plan.ptr_buf[0] = bias_ptr
        lt.matmul_desc_set_attribute(plan.desc, st.attr_bias_pointer, plan.ptr_addr, 8)
        plan.last_bias = bias_ptr
    if plan.has_aux and aux_ptr != plan.last_aux:
        plan.ptr_buf[1] = aux_ptr
        lt.matmul_desc_set_attribute(plan.desc, st.attr_aux_pointer, plan.ptr_addr + 8, 8)
        plan.last_aux = aux_ptr
    plan.launch(st, scalar_ptr(alpha), b_ptr, a_ptr, scalar_ptr(beta), o_ptr, o_ptr,
                cp.cuda.get_current_stream().ptr)
    return out


# --------------------------------------------------------------------------- NumPy reference


def gelu_reference(x):
    """tanh-GELU (the function of cuBLASLt's epilogues), computed as ``ops.gelu`` does (in float64)."""
    return gelu_forward_reference(x)


def gelu_grad_reference(x):
    """d GELU(x) / dx for the tanh approximation, as ``ops.gelu`` computes it."""
    return gelu_backward_reference(np.ones_like(x), x)


def _lt_numpy(a, b, trans_a, trans_b, out, bias, epilogue, aux, dbias, alpha, beta):
    """The same math in float32 (float64 stays float64); results cast to the output dtypes."""
    acc = np.float64 if a.dtype == np.float64 else np.float32
    A = a.astype(acc, copy=False)
    B = b.astype(acc, copy=False)
    A = np.swapaxes(A, -1, -2) if trans_a else A
    B = np.swapaxes(B, -1, -2) if trans_b else B
    r = np.matmul(A, B)
    if epilogue in ("none", "bias", "bgradb"):
        r = alpha * r
        if beta != 0.0:
            r = r + beta * out.astype(acc)
    if epilogue == "bias":
        r = r + bias.astype(acc)
    elif epilogue == "gelu_bias":
        r = r + bias.astype(acc)
        if aux is not None:
            aux[...] = r.astype(aux.dtype)
        r = gelu_reference(r)
    elif epilogue == "dgelu":
        r = r * gelu_grad_reference(aux.astype(acc))
    elif epilogue == "bgradb":
        dbias[...] = A.sum(axis=-1).astype(dbias.dtype)  # Σ_k op(a)[m, k]
    out[...] = r.astype(out.dtype)
    return out


def lt_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    return 2.0 * m * n * k * batch


__all__ = ["EPILOGUES", "INSTALL_HINT", "LtUnavailableError", "WORKSPACE_BYTES", "available", "cached_plan",
           "clear_plans", "device_state", "gelu_grad_reference", "gelu_reference", "gemm", "lt_flops", "lt_gemm",
           "lt_module", "plan_count", "plan_key", "set_split_k", "unavailable_reason"]
