"""Probe cuBLAS' precision trap at reduction lengths K = 2ⁿ + 1 (issue 13) on a GPU.

    python tools/probes/probe_gemm_k.py --out gemm_k.jsonl [--quick] [--budget-s 110]

The report: on the H200 (CUDA 13 cuBLAS), bf16/fp16 GEMMs whose K is 2ⁿ + 1 give ~4e-3 relative
error against float64, the size of dropping the last of the K rows, where K = 2ⁿ gives ~4e-5. This
probe measures weight gradients ``dW = dYᵀ X`` (``dY [K, M]``, ``X [K, N]``, row-major) for GPT-2's
shapes (M, N) and K swept around powers of two (2ⁿ + d, n = 10..17, d in {-1, 0, 1, 2, 8, 9, 16, 17,
32, 33, 64, 65}, plus small K and ragged K that are not 2ⁿ + small: is the trigger "2ⁿ + 1" or
"K % 64 == 1" or split-K?), through every path we have:

* ``cupy.matmul`` (cuBLAS through CuPy, output in the input dtype),
* ``cublas``: ``llmgpu.gemm.cublas.gemm`` (``gemmEx``) into fp32, with ``beta`` 0 and 1 (``.b1``),
  into the input dtype (``.nat``), and with reduced-precision split-K reductions disallowed
  (``.nat.norpr``) or the pedantic math mode (``.pedantic``),
* ``lt``: ``llmgpu.gemm.cublaslt.lt_gemm`` into fp32, beta 0 / 1, and into the input dtype,
* ``prot.*``: the protection, ``llmgpu.gemm.ksplit.wgrad_gemm`` (K split into a multiple of 64 plus a
  zero-padded tail; ``.nopad``: the tail GEMM on the tail's own K) over cuBLAS and cuBLASLt,
* ``linbwd``: ``llmgpu.ops.linear.linear_backward`` (protected; ``linbwd.unprot`` with
  ``protect_k=False``), dW into fp32 and (``.nat``) the input dtype,
* ``torch``: ``torch.matmul`` (native output; ``.norpr``: reduced-precision reductions off;
  ``.f32``: ``torch.mm(..., out_dtype=float32)`` where PyTorch has it), when torch imports.

Each result is compared with a float64 reference computed on the GPU: ``rel_fro`` (‖err‖/‖ref‖),
``rel_max`` (max|err| / max|ref|), ``vs_drop_last`` / ``vs_drop_first`` (the same Frobenius error
against the reference *minus* the last / first row's outer product: smaller than ``rel_fro`` means
the GEMM left that row out), ``drop`` (‖last row's outer product‖/‖ref‖: the error dropping it would
give) and ``floor`` (the error of rounding the exact result to the output dtype).

Then, for one shape: every cuBLASLt heuristic candidate (up to 32: algorithm id, tile, stages,
split-K, reduction scheme, ...) and the top candidate with split-K forced to 1..32, each run and
measured; ``gemmEx`` with every ``cublasGemmAlgo_t``; the forward (NT) and dgrad (NN) layouts at a few
K; cuBLAS' own choice as logged by ``CUBLASLT_LOG_LEVEL=2`` (a subprocess, best effort).

Verdict (``summary`` line, and printed): a K is *flagged* for a path when its excess error
``sqrt(rel_fro² − floor²)`` exceeds 5× the same path's at the neighbouring powers of two (2^⌊log₂K⌋
and 2^⌈log₂K⌉) and an absolute floor (1e-5 into fp32, 3e-4 into 16 bits: far below the trap's
≥ 2.8e-3 for every K ≤ 2¹⁷ + 65). ``protected_ok`` is true when no ``prot.*`` / ``linbwd`` path (the
protected ones) is flagged anywhere; ``trap_reproduced`` when an unprotected path is flagged at some
K = 2ⁿ + 1.

Output: JSON lines at ``--out`` (``meta``, ``case``, ``lt_algo``, ``gemmex_algo``, ``layout``,
``lt_log``, ``summary``), and a short table on stdout. Bounded: each section has a share of
``--budget-s`` (default 110 s; an H200 needs ~40-80 s for the full sweep, ~15 s with ``--quick``);
a section out of time stops and says so (``truncated``). ``--cpu-smoke`` runs the plumbing on NumPy
at tiny sizes (no GPU paths) for the CPU tests.

This script is long because it is one sweep over every GEMM path we have, each measured against the same float64
reference and judged by the same verdict: split into several scripts, the paths would no longer be compared alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # python tools/probes/probe_gemm_k.py from a checkout
    sys.path.insert(0, ROOT)

from llmgpu import backend  # noqa: E402
from llmgpu.gemm import cublas, ksplit  # noqa: E402

SHAPES = [(768, 2304), (3072, 768), (768, 768)]  # (M, N) = dW [M, N]: attn.c_attn, mlp.c_proj, attn.c_proj
OFFSETS = (-1, 0, 1, 2, 8, 9, 16, 17, 32, 33, 64, 65)
ISSUE_K = [2**n + 1 for n in (14, 15, 16, 17)]
EXTRA_K = [1, 2, 17, 63, 64, 65, 127, 129, 255, 257, 513,  # small K
           3 * 2**14 + 1, 5 * 2**12 + 1, 3 * 2**15 + 1, 64 * 1000, 64 * 1000 + 1, 50257, 50304,
           2**16 + 2**12 + 1, 3 * 2**14 + 17]  # ragged K that are not 2^n + small
ABS_FLOOR = {"fp32": 1e-5, "native": 3e-4}
FLAG_FACTOR = 5.0
PROTECTED_PREFIXES = ("prot.", "linbwd")  # linbwd.unprot excluded below


def k_sweep(quick: bool) -> list[int]:
    """The K values, most informative first (the report's K, then their powers of two, then the rest)."""
    if quick:
        ks = {2**n + d for n in (14, 16, 17) for d in (-1, 0, 1, 17, 64, 65)} | {64 * 1000 + 1, 3 * 2**14 + 1, 128, 129}
    else:
        ks = {2**n + d for n in range(10, 18) for d in OFFSETS} | set(EXTRA_K)
    first = [k for k in ISSUE_K if k in ks] + [k - 1 for k in ISSUE_K if k - 1 in ks]
    return first + sorted(ks - set(first))


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES) and not path.endswith(".unprot")


class Budget:
    """Wall-clock share of one section."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.truncated = False

    def out(self) -> bool:
        if time.perf_counter() - self.t0 > self.seconds:
            self.truncated = True
        return self.truncated


class Writer:
    def __init__(self, path):
        self.f = open(path, "w") if path else None
        self.cases = []
        self.records = []

    def emit(self, rec: dict):
        if rec.get("kind") == "case":
            self.cases.append(rec)
        else:
            self.records.append(rec)
        if self.f:
            self.f.write(json.dumps(rec, default=_jsonable) + "\n")
            self.f.flush()

    def close(self):
        if self.f:
            self.f.close()


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


# --------------------------------------------------------------------------- error measures


class Ref:
    """The float64 reference of one product and what the error measures need."""

    def __init__(self, xp, ref, last, first):
        self.xp = xp
        self.ref = ref
        self.norm = float(xp.linalg.norm(ref))
        self.max = float(xp.abs(ref).max())
        self.last, self.first = last, first  # outer products of the last / first row of the reduction
        self.drop = float(xp.linalg.norm(last)) / self.norm
        self._floor = {}

    def floor(self, dtype) -> float:
        """Error of the exact result rounded once to ``dtype``."""
        d = backend.resolve_dtype(dtype)
        if d not in self._floor:
            self._floor[d] = float(self.xp.linalg.norm(self.ref.astype(d).astype(np.float64) - self.ref)) / self.norm
        return self._floor[d]

    def measure(self, out, offset=None) -> dict:
        """Errors of ``out`` (minus ``offset``, the beta = 1 start value) in one host synchronisation."""
        xp = self.xp
        o = out.astype(np.float64)
        if offset is not None:
            o = o - offset
        d = o - self.ref
        v = xp.stack([xp.linalg.norm(d), xp.abs(d).max(), xp.linalg.norm(d + self.last),
                      xp.linalg.norm(d + self.first), xp.isfinite(d).all().astype(np.float64)])
        fro, mx, vl, vf, finite = (float(t) for t in backend.to_numpy(v))
        if finite != 1.0:
            return {"rel_fro": float("inf"), "rel_max": float("inf"), "vs_drop_last": float("inf"),
                    "vs_drop_first": float("inf"), "nonfinite": True}
        return {"rel_fro": fro / self.norm, "rel_max": mx / self.max, "vs_drop_last": vl / self.norm,
                "vs_drop_first": vf / self.norm}


def wgrad_ref(xp, a64, b64, k):
    ref = a64[:k].T @ b64[:k]
    return Ref(xp, ref, xp.outer(a64[k - 1], b64[k - 1]), xp.outer(a64[0], b64[0]))


# --------------------------------------------------------------------------- the paths


class Paths:
    """name -> (output kind, function(a, b, k) -> (out, offset or None)); built for the backend at hand."""

    def __init__(self, xp, dtype_name, torch_mod, log):
        self.xp = xp
        self.dtype = backend.resolve_dtype(dtype_name)
        self.d16 = dtype_name != "fp32"
        self.torch = torch_mod
        self.log = log
        self.broken: dict = {}  # path -> first error (not retried)
        self.items = self._build()

    def _c0(self, a, b):
        """The beta = 1 start value: fp32 numbers of the size of the product's entries."""
        xp = self.xp
        m, n = a.shape[1], b.shape[1]
        g = xp.random.RandomState(a.shape[0]) if xp is not np else np.random.RandomState(a.shape[0])
        return (g.standard_normal((m, n)) * math.sqrt(a.shape[0])).astype(np.float32)

    def _build(self):
        xp, on_gpu = self.xp, self.xp is not np
        f32 = backend.float32
        P = {}

        def direct(gemm, **kw):  # the GEMM itself: no protection
            def run(a, b, k):
                return gemm(a, b, trans_a=True, **kw), None
            return run

        def direct_b1(gemm):
            def run(a, b, k):
                c0 = self._c0(a, b)
                out = c0.copy()
                gemm(a, b, trans_a=True, out=out, beta=1.0)
                return out, c0.astype(np.float64)
            return run

        def prot(gemm, beta1=False, pad=True, native=False):
            def run(a, b, k):
                if beta1:
                    c0 = self._c0(a, b)
                    out = c0.copy()
                    ksplit.wgrad_gemm(a, b, out=out, beta=1.0, gemm=gemm, pad_tail=pad)
                    return out, c0.astype(np.float64)
                return ksplit.wgrad_gemm(a, b, out_dtype=None if native else "fp32", gemm=gemm, pad_tail=pad), None
            return run

        def linbwd(protect, native=False):
            from llmgpu.ops.linear import linear_backward

            def run(a, b, k):
                w = xp.zeros((a.shape[1], b.shape[1]), dtype=a.dtype)
                dw = None if native else xp.empty((a.shape[1], b.shape[1]), dtype=f32)
                _, dw, _ = linear_backward(a, b, w, bias=False, dw_out=dw, protect_k=protect)
                return dw, None
            return run

        if on_gpu:
            P["cupy.matmul"] = ("native", lambda a, b, k: (xp.matmul(a.T, b), None))
        P["cublas"] = ("fp32", direct(cublas.gemm, out_dtype="fp32"))
        if on_gpu:
            P["cublas.b1"] = ("fp32", direct_b1(cublas.gemm))
            P["cublas.pedantic"] = ("fp32", with_math_mode(xp, 2, direct(cublas.gemm, out_dtype="fp32")))
            if self.d16:
                P["cublas.nat"] = ("native", direct(cublas.gemm))
                P["cublas.nat.norpr"] = ("native", with_math_mode(xp, 16, direct(cublas.gemm)))
            from llmgpu.gemm.cublaslt import available, lt_gemm

            if available():
                P["lt"] = ("fp32", direct(lt_gemm, out_dtype="fp32"))
                P["lt.b1"] = ("fp32", direct_b1(lt_gemm))
                if self.d16:
                    P["lt.nat"] = ("native", direct(lt_gemm))
                P["prot.lt"] = ("fp32", prot(lt_gemm))
                P["prot.lt.b1"] = ("fp32", prot(lt_gemm, beta1=True))
                P["prot.lt.nopad"] = ("fp32", prot(lt_gemm, pad=False))
            else:
                from llmgpu.gemm.cublaslt import unavailable_reason

                self.log(f"cuBLASLt paths skipped: {unavailable_reason()}")
        P["prot.cublas"] = ("fp32", prot(cublas.gemm))
        if on_gpu:
            P["prot.cublas.b1"] = ("fp32", prot(cublas.gemm, beta1=True))
            P["prot.cublas.nopad"] = ("fp32", prot(cublas.gemm, pad=False))
            if self.d16:
                P["prot.cublas.nat"] = ("native", prot(cublas.gemm, native=True))
        P["linbwd"] = ("fp32", linbwd(True))
        P["linbwd.unprot"] = ("fp32", linbwd(False))
        if self.d16:
            P["linbwd.nat"] = ("native", linbwd(True, native=True))
        if self.torch is not None and on_gpu:
            P.update(torch_paths(self.torch, xp, self.dtype))
        if not on_gpu:  # --cpu-smoke: a GEMM with the reported trap, to check that the verdict sees it
            def drop_last_at_2n_plus_1(a, b, k):
                kk = k - 1 if k > 2 and (k - 1) & (k - 2) == 0 else k
                return cublas.gemm(a[:kk], b[:kk], trans_a=True, out_dtype="fp32"), None
            P["emul.trap"] = ("fp32", drop_last_at_2n_plus_1)
        return P


def with_math_mode(cp, mode, fn):
    """Run ``fn`` with CuPy's cuBLAS handle in math mode ``mode`` (2 pedantic, 16 no reduced-precision
    reductions), restoring the mode after."""
    from cupy.cuda import cublas as cb

    def run(a, b, k):
        h = cp.cuda.device.get_cublas_handle()
        old = cb.getMathMode(h)
        cb.setMathMode(h, mode)
        try:
            return fn(a, b, k)
        finally:
            cb.setMathMode(h, old)
    return run


def torch_paths(torch, cp, dtype):
    """torch.matmul on the same memory (dlpack, 16-bit types passed as int16 and viewed back)."""
    tdt = {backend.float32: torch.float32, backend.float16: torch.float16, backend.bfloat16: torch.bfloat16}[dtype]
    d16 = dtype != backend.float32
    flags = torch.backends.cuda.matmul

    def as_torch(a):
        if d16:
            return torch.from_dlpack(a.view(np.int16)).view(tdt)
        return torch.from_dlpack(a)

    def back(t):
        out = cp.from_dlpack(t.double().contiguous())
        torch.cuda.synchronize()
        return out

    def run_mm(a, b, k):
        return back(torch.matmul(as_torch(a).t(), as_torch(b))), None

    def run_norpr(a, b, k):
        name = "allow_bf16_reduced_precision_reduction" if dtype == backend.bfloat16 else \
            "allow_fp16_reduced_precision_reduction"
        old = getattr(flags, name)
        setattr(flags, name, False)
        try:
            return run_mm(a, b, k)
        finally:
            setattr(flags, name, old)

    def run_f32(a, b, k):
        return back(torch.mm(as_torch(a).t(), as_torch(b), out_dtype=torch.float32)), None

    P = {"torch": ("native", run_mm)}
    if d16:
        P["torch.norpr"] = ("native", run_norpr)
        P["torch.f32"] = ("fp32", run_f32)
    return P


# --------------------------------------------------------------------------- the main sweep


def sweep_group(xp, w, paths, shape, dtype_name, ks, a, b, a64, b64, budget, log):
    m, n = shape
    for k in ks:
        if budget.out():
            log(f"  main sweep out of time at {dtype_name} {shape} K={k}")
            return
        ref = wgrad_ref(xp, a64, b64, k)
        ak, bk = a[:k], b[:k]
        lg = int(round(math.log2(k)))  # K = 2^lg + d with the nearest power of two
        for name, (kind, fn) in paths.items.items():
            if name in paths.broken:
                continue
            try:
                t0 = time.perf_counter()
                out, offset = fn(ak, bk, k)
                res = ref.measure(out, offset)
                dt = time.perf_counter() - t0
            except Exception as e:  # a path that cannot run here (e.g. a dtype CuPy's matmul lacks)
                paths.broken[name] = f"{type(e).__name__}: {e}"
                w.emit({"kind": "path_error", "path": name, "dtype": dtype_name, "M": m, "N": n, "K": k,
                        "error": paths.broken[name][:500]})
                log(f"  path {name} ({dtype_name}) fails: {paths.broken[name][:200]}")
                continue
            floor = ref.floor(paths.dtype if kind == "native" else backend.float32)
            w.emit({"kind": "case", "dtype": dtype_name, "M": m, "N": n, "K": k, "log2K": lg, "d": k - 2**lg,
                    "mod64": k % 64, "path": name, "out": kind, "drop": ref.drop, "floor": floor,
                    "split": xp is not np and is_protected(name) and ksplit.needs_split(k), "ms": 1e3 * dt, **res})
        del ref


def reference_check(xp, a64, b64, k):
    """The fp64 reference itself at K: the full product against the first K−1 rows plus the last one."""
    full = a64[:k].T @ b64[:k]
    parts = a64[: k - 1].T @ b64[: k - 1] + xp.outer(a64[k - 1], b64[k - 1])
    return float(xp.linalg.norm(full - parts) / xp.linalg.norm(full))


# --------------------------------------------------------------------------- cuBLASLt algorithms


def lt_enumerate(cp, w, dtype_name, shape, ks, a, b, a64, b64, budget, log, requested=32):
    """Every heuristic candidate for the wgrad problem (fp32 out, beta 0), plus split-K forced on the top one."""
    from llmgpu.gemm import cublaslt

    if not cublaslt.available():
        w.emit({"kind": "lt_algo", "skipped": cublaslt.unavailable_reason()})
        return
    lt = cublaslt.lt_module()
    st = cublaslt.device_state(lt, cp)
    CA = lt.MatmulAlgoConfigAttribute
    set_desc = _setter(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype)
    set_pref = _setter(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype)
    set_algo = _setter(lt.matmul_algo_config_set_attribute, lt.get_matmul_algo_config_attribute_dtype)
    in_code = cublas.CUDA_DATA_TYPES[a.dtype]
    m, n = shape
    for k in ks:
        if budget.out():
            log(f"  cuBLASLt enumeration out of time at {dtype_name} K={k}")
            return
        ref = wgrad_ref(cp, a64, b64, k)
        ak, bk = a[:k], b[:k]
        handles = []
        desc = lt.matmul_desc_create(cublaslt.CUBLAS_COMPUTE_32F, cublaslt.CUDA_R_32F)
        try:
            set_desc(desc, lt.MatmulDescAttribute.TRANSA, 0)  # cuBLASLt A = our b [K, N]: N x K column-major
            set_desc(desc, lt.MatmulDescAttribute.TRANSB, 1)  # cuBLASLt B = our a [K, M], transposed
            la = lt.matrix_layout_create(in_code, n, k, n)
            handles.append(la)
            lb = lt.matrix_layout_create(in_code, m, k, m)
            handles.append(lb)
            lc = lt.matrix_layout_create(cublaslt.CUDA_R_32F, n, m, n)
            handles.append(lc)

            def run(algo_ptr, ws_need, k=k, ak=ak, bk=bk, la=la, lb=lb, lc=lc):
                if ws_need > st.ws_size:
                    return {"error": f"needs {ws_need} B of workspace"}
                out = cp.full((m, n), np.nan, dtype=np.float32)
                lt.matmul(st.handle, desc, cublas.scalar_ptr(1.0), int(bk.data.ptr), la, int(ak.data.ptr), lb,
                          cublas.scalar_ptr(0.0), int(out.data.ptr), lc, int(out.data.ptr), lc, algo_ptr,
                          st.ws_ptr, st.ws_size, cp.cuda.get_current_stream().ptr)
                return ref.measure(out)

            for variant, ws, req in (("heuristic", st.ws_size, requested), ("ws0", 0, 8)):
                pref = lt.matmul_preference_create()
                try:
                    set_pref(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, ws)
                    res = np.zeros(req, dtype=lt.matmul_heuristic_result_dtype)
                    cnt = np.zeros(1, dtype=np.int32)
                    lt.matmul_algo_get_heuristic(st.handle, desc, la, lb, lc, lc, pref, req, res.ctypes.data,
                                                 cnt.ctypes.data)
                except Exception as e:
                    w.emit({"kind": "lt_algo", "dtype": dtype_name, "M": m, "N": n, "K": k, "variant": variant,
                            "error": f"{type(e).__name__}: {e}"})
                    continue
                finally:
                    lt.matmul_preference_destroy(pref)
                for i in range(int(cnt[0])):
                    if int(res["state"][i]) != 0:
                        continue
                    ptr = res.ctypes.data + i * res.itemsize
                    rec = {"kind": "lt_algo", "dtype": dtype_name, "M": m, "N": n, "K": k, "variant": variant,
                           "rank": i, "workspace": int(res["workspace_size"][i]),
                           "waves": float(res["waves_count"][i]), "drop": ref.drop, **algo_config(lt, ptr)}
                    try:
                        rec.update(run(ptr, int(res["workspace_size"][i])))
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {e}"
                    w.emit(rec)
                if variant != "heuristic" or int(cnt[0]) < 1:
                    continue
                # the top candidate with split-K forced: which split settings show the error?
                for splitk, scheme in [(1, 0)] + [(s, r) for s in (2, 3, 4, 8, 16, 32) for r in (1, 2)]:
                    alg = res[:1].copy()
                    ptr = alg.ctypes.data
                    rec = {"kind": "lt_algo", "dtype": dtype_name, "M": m, "N": n, "K": k,
                           "variant": f"top_splitk{splitk}_scheme{scheme}", "drop": ref.drop}
                    try:
                        set_algo(ptr, CA.SPLITK_NUM, splitk)
                        set_algo(ptr, CA.REDUCTION_SCHEME, scheme)
                        chk = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
                        lt.matmul_algo_check(st.handle, desc, la, lb, lc, lc, ptr, chk.ctypes.data)
                        rec.update(algo_config(lt, ptr))
                        rec["workspace"] = int(chk["workspace_size"][0])
                        rec.update(run(ptr, rec["workspace"]))
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    w.emit(rec)
        finally:
            for h in handles:
                lt.matrix_layout_destroy(h)
            lt.matmul_desc_destroy(desc)
        cp.cuda.get_current_stream().synchronize()


def _setter(fn, dtype_of):
    def set_(obj, attr, value):
        buf = np.array([value], dtype=dtype_of(attr))
        fn(obj, int(attr), buf.ctypes.data, buf.itemsize)
    return set_


def algo_config(lt, algo_ptr) -> dict:
    """The configuration attributes of a cublasLtMatmulAlgo_t (id, tile, split-K, reduction scheme, ...)."""
    rec = {}
    for attr in lt.MatmulAlgoConfigAttribute:
        try:
            buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
            written = np.zeros(1, dtype=np.uint64)
            lt.matmul_algo_config_get_attribute(algo_ptr, int(attr), buf.ctypes.data, buf.itemsize,
                                                written.ctypes.data)
            rec["algo_" + attr.name.lower()] = int(buf[0])
        except Exception:  # an attribute this cuBLASLt does not know
            continue
    try:
        rec["algo_tile"] = lt.MatmulTile(rec["algo_tile_id"]).name
    except Exception:
        pass
    return rec


# --------------------------------------------------------------------------- gemmEx algorithms, layouts


GEMMEX_ALGOS = [-1, 99] + list(range(0, 24)) + list(range(100, 116))


def gemmex_algos(cp, w, dtype_name, shape, ks, a, b, a64, b64, budget, log):
    """cublasGemmEx with each cublasGemmAlgo_t (fp32 out): does the algorithm argument matter on Hopper?"""
    from cupy.cuda import cublas as cb

    m, n = shape
    handle = cp.cuda.device.get_cublas_handle()
    dt_in = cublas.CUDA_DATA_TYPES[a.dtype]
    for k in ks:
        if budget.out():
            return
        ref = wgrad_ref(cp, a64, b64, k)
        ak, bk = a[:k], b[:k]
        base = None
        for algo in GEMMEX_ALGOS:
            out = cp.full((m, n), np.nan, dtype=np.float32)
            rec = {"kind": "gemmex_algo", "dtype": dtype_name, "M": m, "N": n, "K": k, "algo": algo, "drop": ref.drop}
            try:
                cb.gemmEx(handle, 0, 1, n, m, k, cublas.scalar_ptr(1.0), bk.data.ptr, dt_in, n, ak.data.ptr, dt_in, m,
                          cublas.scalar_ptr(0.0), out.data.ptr, 0, n, cublas.CUBLAS_COMPUTE_32F, algo)
                rec.update(ref.measure(out))
                if base is None:
                    base = out
                rec["bitwise_as_default"] = bool(cp.array_equal(out, base))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:200]
            w.emit(rec)


def layouts(cp, w, torch_mod, budget, log, quick):
    """Forward (x Wᵀ: NT) and dgrad (dy W: NN) layouts at a few K: is only the wgrad layout affected?"""
    from llmgpu.gemm import cublaslt

    m = n = 768
    ks = [2**16, 2**16 + 1] if quick else [2**14, 2**14 + 1, 2**16, 2**16 + 1, 2**17 + 1, 50257, 50304]
    for dtype_name in ("bf16", "fp16"):
        dt = backend.resolve_dtype(dtype_name)
        g = cp.random.RandomState(7)
        kmax = max(ks)
        A = g.standard_normal((m, kmax), dtype=np.float32).astype(dt)
        B = g.standard_normal((kmax, n), dtype=np.float32).astype(dt)
        BT = g.standard_normal((n, kmax), dtype=np.float32).astype(dt)
        for k in ks:
            if budget.out():
                return
            a = cp.ascontiguousarray(A[:, :k])
            a64 = a.astype(np.float64)
            for layout, b, trans_b in (("NN", B[:k], False), ("NT", cp.ascontiguousarray(BT[:, :k]), True)):
                b64 = b.astype(np.float64)
                bb = b64.T if trans_b else b64
                ref = Ref(cp, a64 @ bb, cp.outer(a64[:, -1], bb[-1]), cp.outer(a64[:, 0], bb[0]))
                runs = {"cublas": lambda: cublas.gemm(a, b, trans_b=trans_b, out_dtype="fp32"),
                        "cupy.matmul": lambda: cp.matmul(a, b.T if trans_b else b)}
                if cublaslt.available():
                    runs["lt"] = lambda: cublaslt.lt_gemm(a, b, trans_b=trans_b, out_dtype="fp32")
                for name, fn in runs.items():
                    rec = {"kind": "layout", "layout": layout, "dtype": dtype_name, "M": m, "N": n, "K": k,
                           "path": name, "drop": ref.drop}
                    try:
                        out = fn()
                        rec.update(ref.measure(out))
                        rec["floor"] = ref.floor(out.dtype)
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {e}"[:200]
                    w.emit(rec)
        del A, B, BT


_LOG_CHILD = r"""
import cupy as cp, numpy as np
from llmgpu.gemm import cublas
from llmgpu import backend
for k in (65536, 65537):
    for dt in ("bf16", "fp16"):
        a = cp.ones((k, 768), dtype=backend.resolve_dtype(dt)); b = cp.ones((k, 2304), dtype=a.dtype)
        print("K", k, dt, flush=True)
        cublas.gemm(a, b, trans_a=True, out_dtype="fp32"); cp.cuda.Device().synchronize()
"""


def lt_log(w, log, timeout=60):
    """Which kernel cuBLAS' gemmEx picks, as cuBLASLt's trace log shows it (best effort: a child process)."""
    env = dict(os.environ, CUBLASLT_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x))
    try:
        p = subprocess.run([sys.executable, "-c", _LOG_CHILD], env=env, capture_output=True, text=True,
                           timeout=timeout)
        lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()][:80]
        w.emit({"kind": "lt_log", "rc": p.returncode, "lines": lines})
    except Exception as e:
        w.emit({"kind": "lt_log", "error": f"{type(e).__name__}: {e}"})


# --------------------------------------------------------------------------- verdict


def flag(cases) -> dict:
    """path -> dtype -> [(K, excess, threshold)] where the excess error is > FLAG_FACTOR x the neighbouring
    powers of two's (and the absolute floor)."""
    def excess(c):
        return math.sqrt(max(c["rel_fro"] ** 2 - c["floor"] ** 2, 0.0)) if math.isfinite(c["rel_fro"]) else math.inf

    base = {}
    for c in cases:
        if c["K"] > 0 and c["K"] & (c["K"] - 1) == 0:
            base[(c["path"], c["dtype"], c["M"], c["N"], c["K"])] = excess(c)
    out: dict = {}
    for c in cases:
        k = c["K"]
        lo = 2 ** int(math.floor(math.log2(k)))
        hi = 2 ** int(math.ceil(math.log2(k)))
        key = (c["path"], c["dtype"], c["M"], c["N"])
        refs = [base[(*key, p)] for p in {lo, hi, max(lo, 1024)} if (*key, p) in base]
        if not refs:
            continue
        thr = max(FLAG_FACTOR * max(refs), ABS_FLOOR[c["out"]])
        e = excess(c)
        if e > thr:
            out.setdefault(c["path"], {}).setdefault(c["dtype"], []).append(
                {"K": k, "M": c["M"], "N": c["N"], "excess": e, "threshold": thr,
                 "drops_last_row": c["vs_drop_last"] < c["rel_fro"]})
    return out


def bad_runs(records) -> dict:
    """The single runs (cuBLASLt candidates, gemmEx algorithms, other layouts) with the trap's signature: an
    error of at least a quarter of dropping one row, and above 1e-4 (a right fp32-output GEMM: ~4e-5)."""
    out: dict = {}
    keys = {"lt_algo": ("dtype", "K", "variant", "rank", "algo_id", "algo_tile", "algo_splitk_num",
                        "algo_reduction_scheme", "algo_stages_id", "rel_fro", "vs_drop_last"),
            "gemmex_algo": ("dtype", "K", "algo", "rel_fro", "vs_drop_last"),
            "layout": ("layout", "dtype", "K", "path", "rel_fro", "vs_drop_last")}
    for r in records:
        kind = r.get("kind")
        if kind in keys and "rel_fro" in r and "drop" in r:
            excess = math.sqrt(max(r["rel_fro"] ** 2 - r.get("floor", 0.0) ** 2, 0.0))
            if excess > max(1e-4, 0.25 * r["drop"]):
                out.setdefault(kind, []).append({k: r.get(k) for k in keys[kind]})
    return out


def summarize(cases, extra, records=()) -> dict:
    flagged = flag(cases)
    prot_bad = {p: v for p, v in flagged.items() if is_protected(p)}
    trap = sorted({f["K"] for p, v in flagged.items() if not is_protected(p) for fl in v.values() for f in fl
                   if f["K"] > 2 and (f["K"] - 1) & (f["K"] - 2) == 0})
    flagged_k = {p: {d: sorted({f["K"] for f in fl}) for d, fl in v.items()} for p, v in flagged.items()}
    drops = {p: sorted({c["K"] for c in cases if c["path"] == p and c["vs_drop_last"] < 0.5 * c["rel_fro"]})
             for p in sorted({c["path"] for c in cases})}
    worst = {}
    for c in cases:
        if is_protected(c["path"]):
            key = f'{c["path"]} {c["dtype"]}'
            if key not in worst or c["rel_fro"] > worst[key]["rel_fro"]:
                worst[key] = {"K": c["K"], "M": c["M"], "N": c["N"], "rel_fro": c["rel_fro"], "floor": c["floor"]}
    return {"kind": "summary", "protected_ok": not prot_bad, "trap_reproduced": bool(trap), "trap_k": trap,
            "flagged_k": flagged_k, "flagged": flagged, "protected_flagged": prot_bad,
            "closer_to_dropping_last_row": {p: v for p, v in drops.items() if v}, "protected_worst": worst,
            "n_cases": len(cases), "bad_runs": bad_runs(records), **extra}


TABLE_PATHS = ["cupy.matmul", "cublas", "cublas.nat", "lt", "lt.b1", "torch", "torch.f32", "prot.cublas",
               "prot.lt", "prot.lt.b1", "linbwd", "linbwd.unprot"]


def table(cases, dtype, shape, ks, log):
    rows = {(c["K"], c["path"]): c for c in cases if c["dtype"] == dtype and (c["M"], c["N"]) == shape}
    if not rows:
        return
    cols = [p for p in TABLE_PATHS if any((k, p) in rows for k in ks)]
    log(f"\nrel_fro, {dtype}, dW [{shape[0]}x{shape[1]}] (drop = error of leaving out the last row of K)")
    log(f"{'K':>8} {'drop':>8} " + " ".join(f"{p[:13]:>13}" for p in cols))
    for k in ks:
        c0 = next((rows[(k, p)] for p in cols if (k, p) in rows), None)
        if c0 is None:
            continue
        cells = " ".join(f"{rows[(k, p)]['rel_fro']:13.2e}" if (k, p) in rows else f"{'-':>13}" for p in cols)
        log(f"{k:>8} {c0['drop']:8.1e} {cells}")


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON lines file")
    ap.add_argument("--quick", action="store_true", help="one shape, a dozen K (~15 s on an H200)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="wall-clock bound of the whole probe")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="NumPy, tiny sizes: the plumbing only")
    a = ap.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    if a.cpu_smoke:
        xp = np
        shapes, dtypes = [(8, 12)], ["fp32", "bf16"]
        ks = sorted({2**n + d for n in (6, 7) for d in (-1, 0, 1, 65)})
    else:
        try:
            xp = backend.require_gpu()
        except Exception as e:
            print(f"probe_gemm_k: needs a GPU ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        shapes = SHAPES[:1] if a.quick else SHAPES
        dtypes = ["bf16", "fp16", "fp32"]
        ks = k_sweep(a.quick)
    torch_mod = None
    if not (a.no_torch or a.cpu_smoke):
        try:
            import torch

            torch_mod = torch if torch.cuda.is_available() else None
        except Exception:
            torch_mod = None
    w = Writer(a.out)
    meta = {"kind": "meta", "args": vars(a), "ks": ks, "shapes": shapes, "dtypes": dtypes,
            "k_align": ksplit.K_ALIGN, "torch": getattr(torch_mod, "__version__", None)}
    if xp is not np:
        meta["device"] = backend.device_info(xp).summary()
        meta["cupy"] = xp.__version__
        try:
            meta["cuda_runtime"] = xp.cuda.runtime.runtimeGetVersion()
            meta["cublas"] = xp.cuda.cublas.getVersion(xp.cuda.device.get_cublas_handle())
        except Exception as e:
            meta["version_error"] = str(e)
        try:
            from llmgpu.gemm import cublaslt

            if cublaslt.available():
                meta["cublaslt"] = int(cublaslt.lt_module().get_version())
        except Exception as e:
            meta["cublaslt_error"] = str(e)
        if torch_mod is not None:
            meta["torch_cuda"] = torch_mod.version.cuda
            meta["torch_flags"] = {
                "allow_bf16_reduced_precision_reduction":
                    torch_mod.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                "allow_fp16_reduced_precision_reduction":
                    torch_mod.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                "allow_tf32": torch_mod.backends.cuda.matmul.allow_tf32}
    w.emit(meta)
    log(f"probe_gemm_k: {meta.get('device', 'NumPy smoke run')}; {len(ks)} K x {len(shapes)} shapes x "
        f"{len(dtypes)} dtypes; torch {meta['torch']}")

    total = a.budget_s
    main_budget = Budget(0.62 * total)
    lt_budget = Budget(0.16 * total)
    ex_budget = Budget(0.05 * total)
    ref_checks, truncated = [], {}
    kmax = max(ks)
    lt_ks = [2**16, 2**16 + 1, 2**17 + 1] if a.quick else \
        [2**14, 2**14 + 1, 2**16, 2**16 + 1, 2**17, 2**17 + 1, 2**16 + 64, 2**16 + 65, 3 * 2**14 + 1, 64000 + 1]
    ex_ks = [2**16, 2**16 + 1] if a.quick else [2**16, 2**16 + 1, 2**17 + 1]
    g = xp.random.RandomState(1234) if xp is not np else np.random.RandomState(1234)
    lt_spent = ex_spent = 0.0
    for si, shape in enumerate(shapes):
        m, n = shape
        if xp is np:
            A32 = g.standard_normal((kmax, m)).astype(np.float32)
            B32 = g.standard_normal((kmax, n)).astype(np.float32)
        else:
            A32 = g.standard_normal((kmax, m), dtype=np.float32)
            B32 = g.standard_normal((kmax, n), dtype=np.float32)
        for dtype_name in dtypes:
            dt = backend.resolve_dtype(dtype_name)
            a_, b_ = A32.astype(dt), B32.astype(dt)
            a64, b64 = a_.astype(np.float64), b_.astype(np.float64)
            paths = Paths(xp, dtype_name, torch_mod, log)
            t0 = time.perf_counter()
            sweep_group(xp, w, paths, shape, dtype_name, ks, a_, b_, a64, b64, main_budget, log)
            log(f"  {dtype_name} dW[{m}x{n}]: {len(ks)} K in {time.perf_counter() - t0:.1f} s")
            if si == 0:
                top = max(k for k in ks if k > 2 and (k - 1) & (k - 2) == 0)
                ref_checks.append({"dtype": dtype_name, "K": top, "rel_diff": reference_check(xp, a64, b64, top)})
                if xp is not np:
                    t1 = time.perf_counter()
                    lt_budget.t0 = time.perf_counter() - lt_spent
                    lt_enumerate(xp, w, dtype_name, shape, [k for k in lt_ks if k <= kmax], a_, b_, a64, b64,
                                 lt_budget, log)
                    lt_spent += time.perf_counter() - t1
                    t1 = time.perf_counter()
                    ex_budget.t0 = time.perf_counter() - ex_spent
                    gemmex_algos(xp, w, dtype_name, shape, [k for k in ex_ks if k <= kmax], a_, b_, a64, b64,
                                 ex_budget, log)
                    ex_spent += time.perf_counter() - t1
                    log(f"  {dtype_name}: algorithm enumeration {lt_spent:.1f} s, gemmEx algos {ex_spent:.1f} s")
            del a_, b_, a64, b64
        del A32, B32
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
    if xp is not np:
        rest = Budget(max(5.0, total - (time.perf_counter() - t_start) - 10.0))
        layouts(xp, w, torch_mod, rest, log, a.quick)
        truncated["layouts"] = rest.truncated
        lt_log(w, log, timeout=max(10, min(60, int(total - (time.perf_counter() - t_start)))))
    truncated.update({"main": main_budget.truncated, "lt_algos": lt_budget.truncated, "gemmex": ex_budget.truncated})
    summ = summarize(w.cases, {"reference_check": ref_checks, "truncated": truncated,
                               "seconds": time.perf_counter() - t_start}, w.records)
    w.emit(summ)
    w.close()

    show_k = [k for k in ks if k in set(ISSUE_K) | {k0 - 1 for k0 in ISSUE_K} | {k0 + 64 for k0 in ISSUE_K}
              | {64000 + 1, 3 * 2**14 + 1, 129, 1025}]
    show_k = sorted(show_k) or sorted(ks)[:12]
    for dtype_name in dtypes[:2]:
        table(w.cases, dtype_name, shapes[0], show_k, log)
    log("")
    log(f"trap reproduced: {summ['trap_reproduced']} at K = {summ['trap_k']}")
    for p, v in summ["flagged_k"].items():
        log(f"  flagged {p:18s} " + "; ".join(f"{d}: {ks_[:12]}{' ...' if len(ks_) > 12 else ''}"
                                            for d, ks_ in v.items()))
    log(f"protected paths right at every K: {summ['protected_ok']}")
    for key, v in summ["protected_worst"].items():
        log(f"  worst {key:24s} rel {v['rel_fro']:.2e} (floor {v['floor']:.1e}) at K={v['K']} [{v['M']}x{v['N']}]")
    for kind, runs in summ["bad_runs"].items():
        log(f"{kind}: {len(runs)} runs with the trap's error, e.g.")
        for r in runs[:12]:
            log("   " + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    n_lt = sum(1 for r in w.records if r.get("kind") == "lt_algo" and "rel_fro" in r)
    log(f"cuBLASLt candidates run: {n_lt}; with the trap: {len(summ['bad_runs'].get('lt_algo', []))}")
    log(f"reference self-check: {ref_checks}")
    log(f"truncated sections: {[s for s, t in truncated.items() if t] or 'none'}; {summ['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
