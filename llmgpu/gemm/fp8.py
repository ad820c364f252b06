"""FP8 GEMMs through cuBLASLt (chapter 5, Hopper): ``out = alpha · (sa·A) @ (sb·B)ᵀ + beta · out``, fp32 accumulation.

``A`` [M, K] and ``B`` [N, K] are FP8 bytes (``llmgpu.ops.fp8.fp8_cast``'s ``uint8`` arrays), ``sa`` / ``sb``
their ``scale_inv`` (fp32 [1] device arrays, read by the GPU when the GEMM runs: a scale picked on the device
needs no host round trip, and a captured graph reads the new values on every replay).

**Only one layout.** cuBLASLt's FP8 kernels on Hopper take only the "TN" form: its A transposed, its B not
(NVIDIA's cublasLtMatmul documentation, FP8 requirements). Through the row-major identity of
``llmgpu.gemm.cublaslt`` (cuBLASLt's A is our ``b``, its B our ``a``) that is, in row-major words,
``out = a @ bᵀ`` with *both operands contiguous along K*: a linear layer's forward ``y = x Wᵀ`` as it
stands. The backward GEMMs need transposed copies: ``dx = dy @ W = dy @ (Wᵀ)ᵀ`` takes ``Wᵀ`` [Cin, Cout],
``dW = dyᵀ @ x = dyᵀ @ (xᵀ)ᵀ`` takes ``dyᵀ`` and ``xᵀ``; ``fp8_cast(..., transpose=True)`` writes them in the
same pass as the cast. Further requirements: K and N multiples of 16 (16-byte rows for the FP8 operands and
an FP8 output; PyTorch's ``_scaled_mm`` asks the same), every pointer 16-byte aligned, E5M2 × E5M2 refused
(cuBLASLt has no such kernel: one operand is E4M3, in training the weights or activations; the E5M2 one
is the gradient).

**Epilogues** (16/32-bit outputs only), as ``lt_gemm`` names them: ``"bias"`` adds ``bias`` [N] (bf16 or the
output's type) in the store, ``"gelu_bias"`` writes ``GELU(result + bias)`` and, into ``aux`` [M, N], the
pre-activation; ``"dgelu"`` multiplies the result by GELU'(``aux``). A linear layer's forward and the MLP's
backward then need no extra pass in FP8 either. Whether cuBLASLt has an FP8 kernel for an epilogue is its
heuristic's answer: a missing one is a ``RuntimeError`` when the plan is built (the first call, outside any
capture); ``model/fp8_linear.py`` then runs the unfused form.

**Outputs.** bf16, fp16 or fp32 (``beta`` may accumulate into them: fp32 weight gradients), or FP8
(``out_dtype="e4m3"`` / ``"e5m2"``, bytes): then ``out = fp8(result · out_scale)`` and ``amax_out`` receives
max |result| before ``out_scale`` (what the next scale is made from). ``amax_out`` is offered for FP8
outputs only, as nvmath-python's own FP8 matmul does: an amax is for making the next FP8 scale.
``fast_accum`` turns on cuBLASLt's FAST_ACCUM: faster, but partial sums stay in the tensor cores' narrower
accumulator (Transformer Engine uses it for the forward GEMMs, not the backward ones).

**Error.** The products of two FP8 values are exact in fp32, so the error is the accumulation's and the
output rounding's: ``|out − R| ≤ u_out·|R| + K · 2^-13 · (|A||B|ᵀ)·sa·sb`` elementwise, with R the exact
product of the dequantized operands and u_out the output's unit roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32,
2^-4 E4M3). The K·2^-13 term is a worst case for Hopper's FP8 tensor cores, whose accumulator keeps about 14
mantissa bits between promotions to fp32 (DeepSeek-V3 technical report, 2024, on H800); typical errors grow
like √K, not K. ``tests/test_fp8.py`` checks both.

**Capturable** like ``lt_gemm``: one cached plan per problem (``cublaslt.cached_plan``, cleared with
``cublaslt.clear_plans``), host-side pointer attribute writes, one launch; with ``out`` given nothing is
allocated. Make the first call of every shape outside capture. NumPy arrays run an emulation of the same
math: dequantize, multiply in fp32, quantize the output.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import array_module, check_array, check_choice, overlaps
from ..ops.fp8 import BYTES, Fp8Format, amax_reference, fp8_format, quantize_reference
from .cublas import CUDA_DATA_TYPES, scalar_ptr
from .cublaslt import (
    CUBLAS_COMPUTE_32F,
    CUDA_R_32F,
    LT_EPILOGUE,
    cached_plan,
    device_state,
    gelu_grad_reference,
    gelu_reference,
    lt_module,
)
from .lt_plan import LtPlan, alignment

OPERAND_ALIGN = 16  # bytes: FP8 operand pointers and rows (K), and the output rows (N)
_SCALE_ATTRS = ("A_SCALE_POINTER", "B_SCALE_POINTER", "D_SCALE_POINTER", "AMAX_D_POINTER", "BIAS_POINTER",
                "EPILOGUE_AUX_POINTER")  # the per-call pointers of a plan (0: not used by it)
EPILOGUES = ("none", "bias", "gelu_bias", "dgelu")


def out_kind(out_dtype):
    """An ``out_dtype`` as an ``Fp8Format`` ('e4m3', 'e5m2') or a NumPy dtype (bf16, fp16, fp32)."""
    if isinstance(out_dtype, Fp8Format) or (isinstance(out_dtype, str) and out_dtype.lower() in ("e4m3", "e5m2")):
        return fp8_format(out_dtype.lower() if isinstance(out_dtype, str) else out_dtype)
    dt = backend.resolve_dtype(out_dtype)
    if dt not in CUDA_DATA_TYPES:
        raise TypeError(f"out_dtype must be bf16, fp16, fp32, e4m3 or e5m2, got {out_dtype!r}")
    return dt


def _check_scalar(name, a, xp):
    if backend.get_array_module(a) is not xp:
        raise TypeError(f"{name} must live on the same device as a and b")
    check_array(name, a, shape=(1,), dtype="fp32", dtypes=None)


def fp8_gemm(a, b, a_scale_inv, b_scale_inv, *, a_format="e4m3", b_format="e4m3", out=None, out_dtype="bf16",
             out_scale=None, amax_out=None, alpha=1.0, beta=0.0, fast_accum=False, epilogue="none", bias=None,
             aux=None):
    """``out = alpha · (a_scale_inv · a) @ (b_scale_inv · b)ᵀ + beta · out`` for FP8 bytes ``a`` [M, K] and
    ``b`` [N, K] (uint8, row-major); returns ``out`` [M, N].

    ``a_scale_inv``, ``b_scale_inv``: fp32 [1] on the operands' device. ``out_dtype``: bf16 (default), fp16,
    fp32, or 'e4m3' / 'e5m2' for FP8 bytes, which need ``out_scale`` (fp32 [1]: bytes = fp8(result · out_scale))
    and may take ``amax_out`` (fp32 [1], overwritten with max |result|). ``beta != 0`` accumulates into a given
    16/32-bit ``out``. ``epilogue``: "none", "bias" (``bias`` [N]), "gelu_bias" (``bias`` [N]; ``aux`` [M, N]
    receives the pre-activation) or "dgelu" (``aux`` [M, N] read), for 16/32-bit outputs with ``alpha`` 1 and
    ``beta`` 0; ``aux`` has the output's dtype. See the module docstring for the layout, the size rules and the
    error bound.
    """
    a_fmt, b_fmt = fp8_format(a_format), fp8_format(b_format)
    kind = out_kind(out_dtype)
    fp8_out = isinstance(kind, Fp8Format)
    check_choice("epilogue", epilogue, EPILOGUES)
    xp = array_module(a=a, b=b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv, out=out, out_scale=out_scale,
                      amax_out=amax_out, bias=bias, aux=aux)
    check_array("a", a, ndim=2, dtypes=(BYTES,))
    check_array("b", b, ndim=2, dtypes=(BYTES,))
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"a [M, K] and b [N, K] must share K (out = a @ bᵀ), got a {a.shape} and b {b.shape}")
    if a_fmt.name == b_fmt.name == "e5m2":
        raise ValueError("cuBLASLt has no E5M2 x E5M2 FP8 GEMM: make one operand E4M3")
    for name, s in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        _check_scalar(name, s, xp)
    if fp8_out:
        if out_scale is None:
            raise ValueError(f"an FP8 output ({kind.name}) needs out_scale= (fp32 [1]: bytes = fp8(result · scale))")
        _check_scalar("out_scale", out_scale, xp)
        if beta != 0.0:
            raise ValueError("beta != 0 (accumulating into out) takes a bf16, fp16 or fp32 out, not FP8 bytes")
    else:
        for name, arr in (("out_scale", out_scale), ("amax_out", amax_out)):
            if arr is not None:
                raise ValueError(f"{name}= is for FP8 outputs only (out_dtype='e4m3' or 'e5m2')")
    if amax_out is not None:
        _check_scalar("amax_out", amax_out, xp)
    out_np_dtype = BYTES if fp8_out else kind
    if out is None:
        if beta != 0.0:
            raise ValueError("beta != 0 accumulates into out, so out must be given")
        out = xp.empty((m, n), dtype=out_np_dtype)
    else:
        check_array("out", out, shape=(m, n), dtype=out_np_dtype, dtypes=None)
    for name, arr in (("a", a), ("b", b)):
        if overlaps(out, arr):
            raise ValueError(f"out overlaps {name}")
    alpha, beta = float(alpha), float(beta)
    _check_epilogue(epilogue, bias, aux, out, fp8_out, alpha, beta, m, n)
    if xp is np:
        return _fp8_gemm_numpy(a, b, a_scale_inv, b_scale_inv, a_fmt, b_fmt, out, kind, out_scale, amax_out, alpha,
                               beta, epilogue, bias, aux)
    if k % OPERAND_ALIGN or n % OPERAND_ALIGN:
        raise ValueError(f"cuBLASLt's FP8 GEMM needs K and N to be multiples of {OPERAND_ALIGN}, got K = {k}, N = {n} "
                         "(pad the weight's rows and the reduction length)")
    for name, arr in (("a", a), ("b", b), ("out", out)):
        if int(arr.data.ptr) % OPERAND_ALIGN:
            raise ValueError(f"cuBLASLt's FP8 GEMM needs {name} to start on a {OPERAND_ALIGN}-byte boundary")
    return _fp8_gemm_cupy(xp, a, b, a_scale_inv, b_scale_inv, a_fmt, b_fmt, out, kind, out_scale, amax_out, alpha,
                          beta, bool(fast_accum), m, n, k, epilogue, bias, aux)


def _check_epilogue(epilogue, bias, aux, out, fp8_out, alpha, beta, m, n):
    need = {"none": (), "bias": ("bias",), "gelu_bias": ("bias", "aux"), "dgelu": ("aux",)}[epilogue]
    for name, arr in (("bias", bias), ("aux", aux)):
        if name in need and arr is None:
            raise ValueError(f"epilogue {epilogue!r} needs {name}=")
        if name not in need and arr is not None:
            raise ValueError(f"{name}= was given but epilogue {epilogue!r} does not use it")
    if epilogue == "none":
        return
    if fp8_out:
        raise ValueError(f"epilogue {epilogue!r} takes a bf16, fp16 or fp32 output, not FP8 bytes")
    if alpha != 1.0 or beta != 0.0:
        raise ValueError(f"epilogue {epilogue!r} requires alpha == 1 and beta == 0, got {alpha} and {beta}")
    if bias is not None:
        check_array("bias", bias, shape=(n,), dtypes=None)
        if bias.dtype not in (backend.bfloat16, out.dtype):
            raise TypeError(f"bias must be bf16 or out's dtype ({backend.dtype_name(out.dtype)}), got {bias.dtype}")
    if aux is not None:
        check_array("aux", aux, shape=(m, n), dtype=out.dtype, dtypes=None)
        if overlaps(aux, out):
            raise ValueError("aux overlaps out")


# --------------------------------------------------------------------------- cuBLASLt


class _Fp8Plan(LtPlan):
    """The TN problem: our b is cuBLASLt's A (K x N column-major, transposed), our a its B (K x M); C and D are
    the output (N x M column-major = out [M, N] row-major); an FP8 D gets a bf16 C layout (never read: beta 0),
    the type cuBLASLt pairs with FP8 outputs, and so a C buffer of its own (``c_scratch``, bf16 of the output's
    shape, kept with the plan): cuBLASLt takes C == D only when their layouts are the same, and refuses the call
    (CUBLAS_STATUS_INVALID_VALUE, seen on an H100) otherwise. Scale and amax pointers are attributes, rewritten
    when they change."""

    __slots__ = ("ptr_buf", "ptr_addr", "last_ptrs", "attrs", "c_scratch")

    def __init__(self, lt, st, spec: dict, ptrs: tuple):
        super().__init__(lt, st, spec["describe"], spec["align"])
        A = lt.MatmulDescAttribute
        self.attrs = tuple(int(getattr(A, name)) for name in _SCALE_ATTRS)
        self.ptr_buf = np.zeros(len(_SCALE_ATTRS), dtype=np.int64)  # staging for the pointer attribute writes
        self.ptr_addr = int(self.ptr_buf.ctypes.data)
        m, n, k = spec["m"], spec["n"], spec["k"]
        try:
            self.desc = lt.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F)
            self.set_desc(A.TRANSA, 1)
            self.set_desc(A.TRANSB, 0)
            if spec["fast_accum"]:
                self.set_desc(A.FAST_ACCUM, 1)
            if spec["epilogue"] != "none":
                self.set_desc(A.EPILOGUE, int(getattr(lt.Epilogue, LT_EPILOGUE[spec["epilogue"]])))
            if spec["bias_code"] is not None:
                self.set_desc(A.BIAS_DATA_TYPE, spec["bias_code"])
            if spec["epilogue"] in ("gelu_bias", "dgelu"):
                self.set_desc(A.EPILOGUE_AUX_LD, n)
                self.set_desc(A.EPILOGUE_AUX_DATA_TYPE, spec["out_code"])
            self.la = self.new_layout(spec["b_code"], k, n, k)  # our b [N, K]
            self.lb = self.new_layout(spec["a_code"], k, m, k)  # our a [M, K]
            if spec["fp8_out"]:
                self.lc = self.new_layout(CUDA_DATA_TYPES[backend.bfloat16], n, m, n)
                self.ld = self.new_layout(spec["out_code"], n, m, n)
            else:
                self.lc = self.new_layout(spec["out_code"], n, m, n)
            for attr, ptr in zip(self.attrs, ptrs):
                if ptr:
                    self.set_desc(attr, ptr)
            self.ask_heuristic(1)
        except BaseException:
            self.destroy()
            raise
        self.last_ptrs = list(ptrs)
        self.c_scratch = None  # an FP8 output's C (set by the caller, which owns the array module)

    def point_to(self, ptrs: tuple):
        """Rewrite the scale / amax pointer attributes that differ from the last call's (host memory only)."""
        for i, ptr in enumerate(ptrs):
            if ptr and ptr != self.last_ptrs[i]:
                self.ptr_buf[i] = ptr
                self.lt.matmul_desc_set_attribute(self.desc, self.attrs[i], self.ptr_addr + 8 * i, 8)
                self.last_ptrs[i] = ptr


def _fp8_gemm_cupy(cp, a, b, a_scale_inv, b_scale_inv, a_fmt, b_fmt, out, kind, out_scale, amax_out, alpha, beta,
                   fast_accum, m, n, k, epilogue, bias, aux):
    lt = lt_module()
    st = device_state(lt, cp)
    fp8_out = isinstance(kind, Fp8Format)
    a_ptr, b_ptr, o_ptr = int(a.data.ptr), int(b.data.ptr), int(out.data.ptr)
    # cuBLASLt's A is our b, its B our a: so its A scale is b's, its B scale a's
    ptrs = (int(b_scale_inv.data.ptr), int(a_scale_inv.data.ptr),
            int(out_scale.data.ptr) if fp8_out else 0, int(amax_out.data.ptr) if amax_out is not None else 0,
            int(bias.data.ptr) if bias is not None else 0, int(aux.data.ptr) if aux is not None else 0)
    out_code = kind.cuda_data_type if fp8_out else CUDA_DATA_TYPES[kind]
    out_name = kind.name if fp8_out else backend.dtype_name(kind)
    align = (alignment(a_ptr), alignment(b_ptr), alignment(o_ptr))
    bias_code = CUDA_DATA_TYPES[bias.dtype] if bias is not None else None
    key = ("fp8", st.device_id, a_fmt.name, b_fmt.name, out_name, m, n, k, fast_accum, amax_out is not None, align,
           epilogue, bias_code)

    def build():
        spec = {"m": m, "n": n, "k": k, "fast_accum": fast_accum, "fp8_out": fp8_out, "align": align,
                "a_code": a_fmt.cuda_data_type, "b_code": b_fmt.cuda_data_type, "out_code": out_code,
                "epilogue": epilogue, "bias_code": bias_code,
                "describe": (f"fp8 a[{m}x{k}] {a_fmt.name} @ b[{n}x{k}]^T {b_fmt.name} -> {out_name}"
                             f"{' fast_accum' if fast_accum else ''}{' amax' if amax_out is not None else ''}"
                             f"{'' if epilogue == 'none' else ' epilogue=' + epilogue}"
                             f" (alignment a/b/out {align} B)")}
        plan = _Fp8Plan(lt, st, spec, ptrs)
        if fp8_out:
            plan.c_scratch = cp.empty((m, n), dtype=backend.bfloat16)
        return plan

    plan = cached_plan(key, build)
    plan.point_to(ptrs)
    c_ptr = int(plan.c_scratch.data.ptr) if fp8_out else o_ptr
    plan.launch(st, scalar_ptr(alpha), b_ptr, a_ptr, scalar_ptr(beta), c_ptr, o_ptr, cp.cuda.get_current_stream().ptr)
    return out


# --------------------------------------------------------------------------- NumPy emulation


def _fp8_gemm_numpy(a, b, a_scale_inv, b_scale_inv, a_fmt, b_fmt, out, kind, out_scale, amax_out, alpha, beta,
                    epilogue="none", bias=None, aux=None):
    """Dequantize, multiply in fp32, apply the epilogue, then round to the output type (or quantize with
    ``out_scale``)."""
    A = a_fmt.values()[a] * a_scale_inv[0]
    B = b_fmt.values()[b] * b_scale_inv[0]
    r = np.float32(alpha) * (A @ B.T)
    if beta != 0.0:
        r = r + np.float32(beta) * out.astype(np.float32)
    if bias is not None:
        r = r + bias.astype(np.float32)
    if epilogue == "gelu_bias":
        aux[...] = r.astype(aux.dtype)
        r = gelu_reference(r)
    elif epilogue == "dgelu":
        r = r * gelu_grad_reference(aux.astype(np.float32))
    if isinstance(kind, Fp8Format):
        if amax_out is not None:
            amax_out[0] = amax_reference(r)
        out[...] = quantize_reference(r, out_scale[0], kind)
    else:
        out[...] = r.astype(out.dtype)
    return out


def fp8_gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


__all__ = ["EPILOGUES", "OPERAND_ALIGN", "fp8_gemm", "fp8_gemm_flops", "out_kind"]
