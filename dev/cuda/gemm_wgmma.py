"""Check and time gemm_wgmma.cu (a TMA-fed Hopper GEMM with the MLP's epilogues) against float64 and cuBLASLt.

    python dev/cuda/gemm_wgmma.py                          # checks, then the timings at GPT-2's MLP shapes
    python dev/cuda/gemm_wgmma.py --json benchmarks/results/ch8/gemm_wgmma.json
    python dev/cuda/gemm_wgmma.py --no-time

Steps 1-3 of ``gemm_epilogue_plan.md``. Every instantiation the .cu declares (``gemm_tma<EPI, CLUSTER>``: the
epilogue, one block or a cluster of two sharing B by multicast) is checked on fresh random bf16 inputs with
NaN-poisoned outputs against float64 (NumPy, the package's GELU references) at shapes that are multiples of the
tile, with one tile and with more tiles than blocks, and NaN in one row of A must give NaN in that row of D only.
Then (unless ``--no-time``) each is timed at the fc shape of GPT-2 124M, D [B·1024, 3072] = X [B·1024, 768] · Wᵀ,
at B = 16 and 64, beside cuBLASLt on the same product with the matching epilogue (``lt_gemm``; for DGELU the
package's own call, dY · W₂ with W₂ [768, 3072], while ours takes a transposed copy of W₂), and an 8192³ product of
each for scale, all in one run; then how many clusters fit on the GPU at once, the plain product with smaller
persistent grids, and the plain product's parts alone (``gemm_tma<0, 1, PART>``: the loads alone, the math alone,
both without the epilogue; ``PARTS``) beside the whole, in three rounds.

The tensor maps (TMA descriptors) are made by the driver's ``cuTensorMapEncodeTiled`` through ctypes (CuPy does not
wrap it) and copied to device memory, where the kernel reads them.

Without a GPU, or on a GPU other than sm_90, one line saying so and exit 0. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _devscript  # noqa: E402  (first: puts the package on the path)
from wgmma_probe import compile_sm90a  # noqa: E402

from llmgpu import backend  # noqa: E402
from llmgpu.gemm.cublaslt import lt_gemm  # noqa: E402
from llmgpu.ops.gelu import gelu_backward_reference, gelu_forward_reference  # noqa: E402
from llmgpu.perf.timing import copy_bandwidth, gemm_ceiling, time_fn  # noqa: E402
from llmgpu.testing import poisoned, random_array, rel_error  # noqa: E402

SOURCE = HERE / "gemm_wgmma.cu"
EPILOGUES = {0: "none", 1: "bias", 2: "gelu_aux_bias", 3: "dgelu"}
BM, BK = 128, 64
RTOL = 1e-2  # bf16 outputs: rounding alone is ~2e-3
# (M, N, K) checked: one tile of a cluster; a few k-blocks; GPT-2's fc and projection shapes; more tiles than blocks
# (each block walks several), with 2 and 12 k-blocks
CHECK_SHAPES = [(2 * BM, 256, BK), (4 * BM, 5 * 256, 3 * BK), (1024, 3072, 768), (768, 768, 3072), (8192, 3072, 2 * BK),
                (5120, 3072, 768)]
# (M, N, K, epilogues) timed: the fc GEMM at B = 16 and 64 with each epilogue, and a large square for scale
TIME_SHAPES = [(16 * 1024, 3072, 768, tuple(EPILOGUES)), (64 * 1024, 3072, 768, tuple(EPILOGUES)),
               (8192, 8192, 8192, (0,))]
PARTS_SHAPES = [(64 * 1024, 3072, 768), (8192, 8192, 8192)]  # (M, N, K) of the parts' timing


PARTS = {0: "the GEMM", 1: "loads only", 2: "math only", 3: "loads + math, no epilogue"}  # the .cu's PART


@dataclass(frozen=True, order=True)
class Variant:
    """One instantiation ``gemm_tma<EPI, CLUSTER, PART>`` of the .cu (tile 128 x 256, three stages, a producer warp);
    PART != 0 runs one part of the kernel alone and writes nothing (``PARTS``)."""

    epi: int
    cluster: int
    part: int = 0

    BN, STAGES, THREADS = 256, 3, 288

    @classmethod
    def parse(cls, expr: str) -> Variant:
        return cls(*map(int, re.fullmatch(r"gemm_tma<(\d+), (\d+), (\d+)>", expr).groups()))

    @property
    def expr(self) -> str:
        return f"gemm_tma<{self.epi}, {self.cluster}, {self.part}>"

    @property
    def stage_bytes(self) -> int:  # gw::STAGE: one k-block of A and B in the ring
        return (BM + self.BN) * BK * 2

    @property
    def smem(self) -> int:  # gw::SMEM: the ring, the staging area, the barriers
        return 1024 + self.STAGES * self.stage_bytes + BM * self.BN * 2 + (2 * self.STAGES + 2) * 8

    def fits(self, m: int, n: int, k: int) -> bool:
        return m % (BM * self.cluster) == 0 and n % self.BN == 0 and k % BK == 0

    @property
    def label(self) -> str:
        return "ours" + (f" cluster {self.cluster}" if self.cluster > 1 else "") + (
            f": {PARTS[self.part]}" if self.part else "")


def gemms(kernels) -> list[Variant]:
    """The instantiations that compute D (PART 0), in order."""
    return [v for v in sorted(map(Variant.parse, kernels)) if v.part == 0]


# --------------------------------------------------------------------------- TMA descriptors

_CU = {"bf16": 9, "interleave_none": 0, "swizzle_128b": 3, "l2_256b": 3, "oob_zero": 0}  # cuda.h's enum values


@functools.cache
def _driver():
    """The driver's cuTensorMapEncodeTiled, with its argument types."""
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def tensor_map(cp, x, box_rows: int):
    """The TMA descriptor of bf16 x [rows, K] (row-major, K contiguous) in boxes of box_rows x 64 with the 128-byte
    swizzle, as a 128-byte device array (CuPy's allocations are 256-byte aligned; TMA wants 64)."""
    rows, k = x.shape
    assert x.strides[1] == 2 and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0, "TMA: 16-byte aligned rows"
    buf = (ctypes.c_uint8 * 192)()
    at = (ctypes.addressof(buf) + 63) & ~63  # CUtensorMap is 64-byte aligned
    rc = _driver()(ctypes.c_void_p(at), _CU["bf16"], 2, ctypes.c_void_p(x.data.ptr),
                   (ctypes.c_uint64 * 2)(k, rows), (ctypes.c_uint64 * 1)(x.strides[0]),
                   (ctypes.c_uint32 * 2)(BK, box_rows), (ctypes.c_uint32 * 2)(1, 1),
                   _CU["interleave_none"], _CU["swizzle_128b"], _CU["l2_256b"], _CU["oob_zero"])
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {x.shape} box {box_rows} x {BK}")
    return cp.asarray(np.frombuffer(ctypes.string_at(at, 128), np.uint8))


def launcher(cp, kernels, var: Variant, n_sm: int):
    """prepare(a, bt, d, aux=None, bias=None, grid=None): the tensor maps and arguments for D = A · Btᵀ with var's
    epilogue, made once; returns the function that launches it (persistent: one block per SM unless ``grid``)."""
    fn = kernels[var.expr]
    fn.max_dynamic_shared_size_bytes = var.smem

    def prepare(a, bt, d, aux=None, bias=None, grid=None):
        (m, k), n = a.shape, bt.shape[0]
        if not var.fits(m, n, k) or bt.shape[1] != k or d.shape != (m, n):
            raise ValueError(f"{var.expr}: M % {BM * var.cluster}, N % {var.BN}, K % {BK} must be 0; got "
                             f"{m} x {n} x {k}")
        null = np.uint64(0)
        maps = (tensor_map(cp, a, BM), tensor_map(cp, bt, var.BN // var.cluster),  # B: each block's share
                tensor_map(cp, d, 64), tensor_map(cp, aux, 64) if aux is not None else null)  # 64 x 64 boxes
        args = (*maps, null if bias is None else bias, np.int32(m), np.int32(n), np.int32(k))
        tiles = (m // BM) * (n // var.BN)
        grid = (grid or min(tiles, n_sm) // var.cluster * var.cluster,)  # persistent, whole clusters
        return lambda: fn(grid, (var.THREADS,), args, shared_mem=var.smem)

    return prepare


# --------------------------------------------------------------------------- checks


def reference(a, bt, epi, aux=None, bias=None):
    """float64 (d, aux) of the product with epilogue epi from the bf16 inputs (NumPy arrays)."""
    acc = a.astype(np.float64) @ bt.astype(np.float64).T
    if epi in (1, 2):
        acc = acc + bias.astype(np.float64)
    if epi == 2:
        return gelu_forward_reference(acc), acc
    if epi == 3:
        return gelu_backward_reference(acc, aux.astype(np.float64)), None
    return acc, None


def operands(cp, rng, m, n, k, epi):
    a = cp.asarray(random_array(rng, (m, k), "bf16"))
    bt = cp.asarray(random_array(rng, (n, k), "bf16", scale=k**-0.5))
    bias = cp.asarray(random_array(rng, (n,), "bf16")) if epi in (1, 2) else None
    aux = cp.asarray(random_array(rng, (m, n), "bf16")) if epi == 3 else (poisoned((m, n), "bf16", cp) if epi == 2
                                                                            else None)
    return a, bt, bias, aux


def check(cp, prepare, var: Variant, rng) -> list[dict]:
    rows = []
    for m, n, k in CHECK_SHAPES:
        a, bt, bias, aux = operands(cp, rng, m, n, k, var.epi)
        d = poisoned((m, n), "bf16", cp)
        prepare(a, bt, d, aux=aux, bias=bias)()
        cp.cuda.Device().synchronize()
        h = [None if x is None else cp.asnumpy(x).astype(np.float64) for x in (a, bt, aux, bias)]
        r_d, r_aux = reference(h[0], h[1], var.epi, aux=h[2], bias=h[3])
        e_d = rel_error(d, r_d)  # inf when any element is NaN (unwritten) or inf
        e_aux = rel_error(aux, r_aux) if r_aux is not None else 0.0
        rows.append({"variant": var.expr, "M": m, "N": n, "K": k, "d_error": e_d, "aux_error": e_aux,
                     "ok": bool(e_d < RTOL and e_aux < RTOL)})
    # NaN in one row of A: that row of D is NaN, every other row finite
    m, n, k = 2 * BM, var.BN, BK
    a, bt, bias, aux = operands(cp, rng, m, n, k, var.epi)
    a[77, 5] = np.nan
    d = poisoned((m, n), "bf16", cp)
    prepare(a, bt, d, aux=aux, bias=bias)()
    bad = np.argwhere(~np.isfinite(cp.asnumpy(d).astype(np.float32)).all(-1)).ravel().tolist()
    rows.append({"variant": var.expr, "case": "NaN in A[77, 5]", "nonfinite_rows": bad, "ok": bad == [77]})
    return rows


# --------------------------------------------------------------------------- timing


def lt_call(epi, a, bt, d, aux, bias):
    """cuBLASLt on the same product: the package's call (for DGELU: dY · W₂, W₂ [K, N] as the model stores it)."""
    if epi == 0:
        return lambda: lt_gemm(a, bt, trans_b=True, out=d)
    if epi == 1:
        return lambda: lt_gemm(a, bt, trans_b=True, out=d, epilogue="bias", bias=bias)
    if epi == 2:
        return lambda: lt_gemm(a, bt, trans_b=True, out=d, epilogue="gelu_bias", bias=bias, aux=aux)
    w2 = bt.T.copy()  # [K, N]: the projection weight as the model stores it
    return lambda: lt_gemm(a, w2, out=d, epilogue="dgelu", aux=aux)


def timing(cp, kernels, n_sm, rng, reps) -> list[dict]:
    rows = []
    variants = gemms(kernels)
    for m, n, k, epilogues in TIME_SHAPES:
        flops = 2.0 * m * n * k
        for epi in epilogues:
            a, bt, bias, aux = operands(cp, rng, m, n, k, epi)
            d, d_lt = cp.empty((m, n), bt.dtype), cp.empty((m, n), bt.dtype)
            aux_lt = aux.copy() if aux is not None else None
            cands = {f"cuBLASLt {EPILOGUES[epi]}": lt_call(epi, a, bt, d_lt, aux_lt, bias)}
            for var in variants:
                if var.epi == epi and var.fits(m, n, k):
                    cands[var.label] = launcher(cp, kernels, var, n_sm)(a, bt, d, aux=aux, bias=bias)
            for name, fn in cands.items():
                t = time_fn(fn, xp=cp, warmup=5, reps=reps)
                rows.append({"M": m, "N": n, "K": k, "epilogue": EPILOGUES[epi], "kernel": name,
                             "ms": t.median_ms, "tflops": t.tflops(flops)})
                if not name.startswith("cuBLASLt"):  # the timed output against cuBLASLt's
                    rows[-1]["error_vs_cublaslt"] = rel_error(d, d_lt)
                    if epi == 2:
                        rows[-1]["aux_error_vs_cublaslt"] = rel_error(aux, aux_lt)
                err = rows[-1].get("error_vs_cublaslt")
                print(f"  {m:>6} x {n} x {k}  {EPILOGUES[epi]:>13}  {name:<30} {t.median_ms:8.4f} ms "
                      f"{rows[-1]['tflops']:6.1f} TFLOP/s" + ("" if err is None else f"  (vs cuBLASLt {err:.1e})"),
                      flush=True)
    return rows


def max_active_clusters(kernels, var: Variant, n_sm: int):
    """How many clusters of var's kernel the GPU runs at once (cuOccupancyMaxActiveClusters), or why not known."""
    try:
        from cuda.bindings import driver as cu

        fn = kernels[var.expr]
        fn.max_dynamic_shared_size_bytes = var.smem
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = n_sm // var.cluster * var.cluster, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = var.THREADS, 1, 1
        cfg.sharedMemBytes = var.smem
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = var.cluster, 1, 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        err, n = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(fn.kernel.ptr), cfg)
        return int(n) if int(err) == 0 else f"cuOccupancyMaxActiveClusters: {err}"
    except Exception as e:  # no cuda.bindings, or an API that differs
        return f"{type(e).__name__}: {e}"


def grid_sweep(cp, kernels, n_sm, rng, reps) -> list[dict]:
    """The plain product at the B = 64 fc shape with smaller persistent grids: if fewer clusters fit on the GPU at
    once than the grid has, the rest wait for a second round, and a smaller grid is faster."""
    m, n, k = 64 * 1024, 3072, 768
    a, bt, _, _ = operands(cp, rng, m, n, k, 0)
    d = cp.empty((m, n), bt.dtype)
    rows = []
    for var in gemms(kernels):
        if var.epi != 0:
            continue
        for grid in sorted({min(g, n_sm) // var.cluster * var.cluster for g in (n_sm, 128, 120, 112, 96, 66)}):
            t = time_fn(launcher(cp, kernels, var, n_sm)(a, bt, d, grid=grid), xp=cp, warmup=5, reps=reps)
            rows.append({"kernel": var.label, "grid": grid, "ms": t.median_ms, "tflops": t.tflops(2.0 * m * n * k)})
            print(f"  grid {grid:>4}  {var.label:<16} {t.median_ms:8.4f} ms {rows[-1]['tflops']:6.1f} TFLOP/s")
    return rows


def parts(cp, kernels, n_sm, rng, reps, rounds: int = 3) -> list[dict]:
    """The plain GEMM and its parts alone (PART 1-3) with cuBLASLt beside them, at PARTS_SHAPES, timed in turn
    ``rounds`` times (so that a drift of the clocks over the run shows as a spread between rounds, not as a
    difference between parts). Bytes: what the loads move from L2 (or DRAM) into shared memory, STAGE bytes a
    k-block; the math-only part loads only the first STAGES k-blocks of each block."""
    rows = []
    for m, n, k in PARTS_SHAPES:
        a, bt, _, _ = operands(cp, rng, m, n, k, 0)
        d, d_lt = cp.empty((m, n), bt.dtype), cp.empty((m, n), bt.dtype)
        cands = {"cuBLASLt none": (None, lt_call(0, a, bt, d_lt, None, None))}  # (our variant or None, launch)
        for var in sorted(map(Variant.parse, kernels)):
            if var.epi == 0 and var.cluster == 1:
                cands[var.label] = (var, launcher(cp, kernels, var, n_sm)(a, bt, d))
        tiles, nk = (m // BM) * (n // Variant.BN), k // BK
        for r in range(rounds):
            for name, (var, fn) in cands.items():
                t = time_fn(fn, xp=cp, warmup=5, reps=reps)
                loaded = None if var is None else (
                    (min(tiles, n_sm) * var.STAGES if var.part == 2 else tiles * nk) * var.stage_bytes)
                rows.append({"M": m, "N": n, "K": k, "round": r, "kernel": name, "ms": t.median_ms,
                             "tflops": t.tflops(2.0 * m * n * k), "loaded_bytes": loaded,
                             "load_tbps": loaded / t.median_ms / 1e9 if var and var.part != 2 else None})
                x = rows[-1]
                print(f"  {m:>6} x {n} x {k}  round {r}  {name:<38} {t.median_ms:8.4f} ms {x['tflops']:6.1f} "
                      f"TFLOP/s" + (f"  loads {x['load_tbps']:5.2f} TB/s" if x["load_tbps"] else ""), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-time", action="store_true", help="checks only")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", type=Path, help="write the checks and timings here")
    args = p.parse_args(argv)
    cp = _devscript.hopper_or_say_why(" (would check and time gemm_wgmma.cu)")
    if cp is None:
        return 0
    kernels = compile_sm90a(cp, SOURCE)
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    checks = []
    for var in gemms(kernels):
        prepare = launcher(cp, kernels, var, n_sm)
        checks += check(cp, prepare, var, rng)
    bad = [r for r in checks if not r["ok"]]
    for r in checks:
        print(("ok  " if r["ok"] else "FAIL"), {k: v for k, v in r.items() if k != "ok"})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": backend.device_info(cp).summary(),
              "checks": checks}
    if not args.no_time:
        result["gemm_tflops"] = gemm_ceiling(xp=cp)
        result["copy_gbps"] = copy_bandwidth(xp=cp)
        print(f"ceilings: cuBLAS bf16 8192³ {result['gemm_tflops']:.0f} TFLOP/s, copy {result['copy_gbps']:.0f} GB/s")
        result["timings"] = timing(cp, kernels, n_sm, rng, args.reps)
        result["max_active_clusters"] = {v.label: max_active_clusters(kernels, v, n_sm)
                                         for v in gemms(kernels) if v.epi == 0}
        print("clusters (or blocks) the GPU runs at once:", result["max_active_clusters"])
        result["grid_sweep"] = grid_sweep(cp, kernels, n_sm, rng, args.reps)
        print("the plain GEMM's parts alone (PART 1-3 of the .cu):")
        result["parts"] = parts(cp, kernels, n_sm, rng, args.reps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(checks) - len(bad)}/{len(checks)} checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
