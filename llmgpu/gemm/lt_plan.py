"""One cuBLASLt matmul problem, planned once and launched many times: what ``lt_gemm`` and ``fp8_gemm`` share.

A plan holds the matmul descriptor, the four matrix layouts (cuBLASLt's A, B, C, D; column-major views of our
row-major buffers, see ``llmgpu.gemm.cublaslt``), the heuristic's algorithms and the one that runs. Building
one costs host microseconds and a heuristic query, so callers cache plans by problem
(``cublaslt.cached_plan``) and a call only rewrites the pointer attributes that changed, then launches.
Nothing here allocates device memory or waits for the GPU: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import numpy as np

MAX_ALIGN = 256  # cuBLASLt's default alignment assumption for every matrix (bytes)
# LtPlan.use_split_k's reduction schemes: our names -> cublasLtReductionScheme_t member names
REDUCTIONS = {"inplace": "INPLACE", "compute_type": "COMPUTE_TYPE", "output_type": "OUTPUT_TYPE"}


def set_attr(setter, dtype_of, obj, attr, value):
    """One cuBLASLt attribute write: ``value`` staged as the attribute's own C type (``dtype_of(attr)``)."""
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


def alignment(ptr: int, stride_bytes: int = 0) -> int:
    """Largest power of two (≤ 256) dividing the pointer and the batch stride in bytes."""
    a = MAX_ALIGN
    for v in (ptr, stride_bytes):
        if v:
            a = min(a, v & -v)
    return a


class LtPlan:
    """What every cached cublasLtMatmul problem holds: the matmul descriptor, the matrix layouts (cuBLASLt's
    A, B, C and D; ``ld`` is None when D has C's layout), the heuristic's algorithms and which one runs.
    Subclasses build the descriptor and layouts (``cublaslt._Plan``, ``fp8._Fp8Plan``), then call
    ``ask_heuristic(1)``; on failure ``destroy()``."""

    __slots__ = ("lt", "desc", "layouts", "la", "lb", "lc", "ld", "algos", "n_algos", "algo_ptr", "ws_need",
                 "describe", "handle", "ws_size", "align", "custom", "split_k")

    def __init__(self, lt, st, describe: str, align: tuple):
        """``lt``: the nvmath.bindings.cublasLt module; ``st``: the device's handle and workspace
        (``cublaslt.device_state``); ``align``: our (a, b, out) pointers' alignment in bytes."""
        self.lt, self.describe = lt, describe
        self.handle, self.ws_size, self.align = st.handle, st.ws_size, align
        self.desc = None
        self.layouts = []
        self.ld = None
        self.custom = None  # the configured algorithm use_split_k launches (a heuristic result struct), or None
        self.split_k = None  # (splits, reduction) while use_split_k's configuration runs

    def set_desc(self, attr, value):
        set_attr(self.lt.matmul_desc_set_attribute, self.lt.get_matmul_desc_attribute_dtype, self.desc, attr, value)

    def new_layout(self, code: int, rows: int, cols: int, ld: int):
        """A column-major matrix layout, destroyed with the plan."""
        lay = self.lt.matrix_layout_create(code, rows, cols, ld)
        self.layouts.append(lay)
        return lay

    def ask_heuristic(self, n: int):
        """Ask cuBLASLt's heuristic for its first ``n`` algorithms for this problem (the plan runs the first, 0;
        ``use(i)`` switches: tools/probes/probe_lt_algos.py times the candidates of every GEMM of the step)."""
        lt = self.lt
        P = lt.MatmulPreferenceAttribute
        set_pref = functools.partial(set_attr, lt.matmul_preference_set_attribute,
                                     lt.get_matmul_preference_attribute_dtype)
        pref = lt.matmul_preference_create()
        try:
            set_pref(pref, P.MAX_WORKSPACE_BYTES, self.ws_size)
            al_a, al_b, al_c = self.align
            set_pref(pref, P.MIN_ALIGNMENT_A_BYTES, al_b)  # cuBLASLt A = our b
            set_pref(pref, P.MIN_ALIGNMENT_B_BYTES, al_a)
            set_pref(pref, P.MIN_ALIGNMENT_C_BYTES, al_c)
            set_pref(pref, P.MIN_ALIGNMENT_D_BYTES, al_c)
            algos = np.zeros(max(1, int(n)), dtype=lt.matmul_heuristic_result_dtype)
            cnt = np.zeros(1, dtype=np.int32)
            try:
                lt.matmul_algo_get_heuristic(self.handle, self.desc, self.la, self.lb, self.lc,
                                             self.lc if self.ld is None else self.ld, pref,
                                             len(algos), algos.ctypes.data, cnt.ctypes.data)
            except Exception as e:
                raise RuntimeError(f"cuBLASLt has no algorithm for {self.describe}: {type(e).__name__}: {e}") from e
        finally:
            lt.matmul_preference_destroy(pref)
        if int(cnt[0]) < 1 or int(algos["state"][0]) != 0:
            raise RuntimeError(f"cuBLASLt heuristic returned no usable algorithm for {self.describe} "
                               f"(count {int(cnt[0])}, state {int(algos['state'][0])})")
        self.algos, self.n_algos = algos, int(cnt[0])
        self.use(0)

    def use(self, i: int):
        """Launch with the heuristic's ``i``-th algorithm from now on (0, its first choice, by default)."""
        if not 0 <= i < self.n_algos or int(self.algos["state"][i]) != 0:
            raise IndexError(f"algorithm {i} of {self.n_algos} is not usable for {self.describe}")
        self.ws_need = int(self.algos["workspace_size"][i])
        # 'algo' is the first field of the result struct
        self.algo_ptr = int(self.algos.ctypes.data) + i * self.algos.itemsize
        self.custom = self.split_k = None

    def use_split_k(self, splits: int, reduction: str = "compute_type", base: int = 0):
        """Launch the heuristic's ``base``-th algorithm with its reduction over K split ``splits`` ways from now on.

        ``reduction`` names cuBLASLt's scheme for adding the ``splits`` partial products (``REDUCTIONS``):
        ``"inplace"`` in the output buffer, in the output type, the workspace holding only counters that order the
        additions; ``"compute_type"`` / ``"output_type"`` out of place in the workspace (fp32 / the output type),
        then added by a second kernel. Every scheme adds the parts in an order fixed by the configuration, so the
        result is the same bits run to run (no atomics). cuBLASLt checks the configuration
        (``cublasLtMatmulAlgoCheck``); one it refuses, or one that needs more workspace than the device's, raises
        ``ValueError`` and leaves the plan as it was. Host work only: what a launch captures is unchanged.
        ``splits=1`` runs ``base`` as configured by the heuristic (like ``use(base)``).
        """
        splits = int(splits)
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        if not 0 <= base < self.n_algos or int(self.algos["state"][base]) != 0:
            raise IndexError(f"algorithm {base} of {self.n_algos} is not usable for {self.describe}")
        lt = self.lt
        custom = self.algos[base:base + 1].copy()  # the result struct; its first field is the algo
        ptr = int(custom.ctypes.data)
        CA = lt.MatmulAlgoConfigAttribute
        scheme = 0 if splits == 1 else int(getattr(lt.ReductionScheme, REDUCTIONS[reduction]))
        set_algo = functools.partial(set_attr, lt.matmul_algo_config_set_attribute,
                                     lt.get_matmul_algo_config_attribute_dtype)
        checked = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        try:
            set_algo(ptr, CA.SPLITK_NUM, splits)
            set_algo(ptr, CA.REDUCTION_SCHEME, scheme)
            lt.matmul_algo_check(self.handle, self.desc, self.la, self.lb, self.lc,
                                 self.lc if self.ld is None else self.ld, ptr, checked.ctypes.data)
        except Exception as e:
            raise ValueError(f"cuBLASLt refuses split-K {splits} ({reduction}) on algorithm {base} for "
                             f"{self.describe}: {type(e).__name__}: {e}") from e
        need = int(checked["workspace_size"][0])
        if need > self.ws_size:
            raise ValueError(f"split-K {splits} ({reduction}) for {self.describe} needs {need} bytes of workspace, "
                             f"more than the {self.ws_size} the device has")
        self.custom, self.split_k = custom, (splits, reduction)
        self.ws_need, self.algo_ptr = need, ptr

    def launch(self, st, alpha_ptr: int, a_ptr: int, b_ptr: int, beta_ptr: int, c_ptr: int, d_ptr: int,
               stream: int):
        """One cublasLtMatmul on ``stream``, operands in cuBLASLt's order (its A is our b); host pointers for
        alpha and beta; the device's workspace (``st``)."""
        try:
            self.lt.matmul(st.handle, self.desc, alpha_ptr, a_ptr, self.la, b_ptr, self.lb, beta_ptr, c_ptr, self.lc,
                           d_ptr, self.lc if self.ld is None else self.ld, self.algo_ptr, st.ws_ptr, st.ws_size,
                           stream)
        except Exception as e:
            raise RuntimeError(f"cublasLtMatmul failed for {self.describe}: {type(e).__name__}: {e}") from e

    def destroy(self):
        for lay in self.layouts:
            self.lt.matrix_layout_destroy(lay)
        self.layouts = []
        if self.desc is not None:
            self.lt.matmul_desc_destroy(self.desc)
            self.desc = None


__all__ = ["MAX_ALIGN", "REDUCTIONS", "LtPlan", "alignment", "set_attr"]
