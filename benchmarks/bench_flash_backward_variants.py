"""Our flash attention backward, every variant (``flash_launch.BWD_VARIANTS``) against cuDNN, in one process.

    python benchmarks/bench_flash_backward_variants.py           # GPU: the shapes below, writes results JSON
    python benchmarks/bench_flash_backward_variants.py --quick   # B=16 GPT-2 shape only, fewer reps, nothing written

Issue 16: the backward is the furthest of our kernels from cuDNN (the floor: 0.8 × cuDNN's TFLOP/s). Before a
candidate becomes the default, this times each one on the same inputs (bf16, causal; q, k, v strided views of one
[B, T, 3C] buffer, as FastGPT passes them): GPT-2 124M attention B=16 and B=64, H=12, T=1024, D=64, and a
long-context head B=4, H=16, T=4096, D=128. Per variant: the whole backward (median of CUDA-event timings), each of
its kernels alone, and the kernels' registers as loaded on this GPU. Correctness first, in the same run: every
variant against the default kernels on each benchmark shape (relative error of dq, dk, dv) and against float64 on
two small shapes (T=257, D=64 and T=300, D=128, causal). A variant that fails a check is reported and the script
exits with status 1 (after writing what it measured). FLOPs by ``flash_attention_flops`` (backward 2.5 × the
forward's 4·B·H·T²·D, halved when causal). Results go to benchmarks/results/ch2b/flash_backward_variants.json (full runs
on a GPU only, or to --out).
"""

from __future__ import annotations

import math
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.kernels import get_kernel
from llmgpu.ops import cudnn_attention
from llmgpu.ops import flash_attention as fa
from llmgpu.ops import flash_launch as fl
from llmgpu.ops import flash_reference as ref
from llmgpu.perf.timing import time_fn
from llmgpu.testing import random_array, rel_error

RESULTS = _common.RESULTS_DIR / "ch2b" / "flash_backward_variants.json"
SHAPES = [(16, 12, 1024, 64, True), (64, 12, 1024, 64, True), (4, 16, 4096, 128, True)]  # (B, H, T, D, causal)
CHECK_SHAPES = [(2, 3, 257, 64, True), (1, 2, 300, 128, True)]  # against float64
TOL_VS_DEFAULT = 1e-2  # bf16: half of the float64 tolerance of tests/test_flash_kernels.py
TOL_VS_FLOAT64 = 4e-2  # bf16: as tests/test_flash_kernels.py (2 · RTOL)
FLOOR = 0.8  # of cuDNN's TFLOP/s


def _inputs(xp, rng, B, H, T, D, causal):
    qkv = random_array(rng, (B, T, 3 * H * D), "bf16", xp)
    q, k, v = fa.split_qkv(qkv, H)
    do = random_array(rng, (B, H, T, D), "bf16", xp)
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    return q, k, v, do, o, st


def check_float64(xp, rng, failures):
    rows = []
    for B, H, T, D, causal in CHECK_SHAPES:
        q, k, v, do, o, st = _inputs(xp, rng, B, H, T, D, causal)
        f = [xp.asnumpy(a).astype(np.float64) for a in (q, k, v, do)]
        r_o, r_lse = ref.naive_forward(*f[:3], 1 / math.sqrt(D), causal)
        want = ref.naive_backward(f[3], *f[:3], r_o, r_lse, 1 / math.sqrt(D), causal)
        for variant in fa.BWD_VARIANTS:
            got = fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours", variant=variant)
            errs = {n: float(rel_error(g, w)) for n, g, w in zip(("dq", "dk", "dv"), got, want)}
            ok = all(e <= TOL_VS_FLOAT64 for e in errs.values())
            rows.append({"variant": variant, "shape": f"B={B} H={H} T={T} D={D}", "vs": "float64", **errs, "ok": ok})
            print(f"  {variant:<8} vs float64 B={B} H={H} T={T} D={D}: " +
                  " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + ("" if ok else "  FAILED"))
            if not ok:
                failures.append(f"{variant} vs float64 at T={T} D={D}")
    return rows


def _regs(name, dtype, D):
    try:
        if name == "flash_bwd_dkdv_wgmma":
            return int(get_kernel(fl.WGMMA_FILE, name, dtype, D, 0, fl.WGMMA_BWD_WG).num_regs)
        targs = (dtype,) if name == "flash_bwd_dot" else (dtype, D) + ((0,) if name.endswith("_wide") else ())
        return int(get_kernel("flash_attention", name, *targs).num_regs)
    except Exception:
        return None


def bench_shape(xp, rng, B, H, T, D, causal, reps, table, checks, failures):
    label = f"B={B} H={H} T={T} D={D}{' causal' if causal else ''}"
    print(f"\n{label}")
    q, k, v, do, o, st = _inputs(xp, rng, B, H, T, D, causal)
    shape = q.shape
    grads = {var: tuple(xp.empty(shape, backend.bfloat16) for _ in range(3)) for var in fa.BWD_VARIANTS}
    for var, (dq, dk, dv) in grads.items():
        fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=dq, dk=dk, dv=dv, kernel="ours", variant=var)
    base = grads[fa.DEFAULT_BWD_VARIANT]
    for var in fa.BWD_VARIANTS:  # correctness on the benchmark's own inputs, against the default kernels
        if var == fa.DEFAULT_BWD_VARIANT:
            continue
        errs = {n: float(rel_error(g, w)) for n, g, w in zip(("dq", "dk", "dv"), grads[var], base)}
        ok = all(e <= TOL_VS_DEFAULT for e in errs.values())
        bitwise = all(bool((g.view(xp.uint16) == w.view(xp.uint16)).all()) for g, w in zip(grads[var], base))
        checks.append({"variant": var, "shape": label, "vs": fa.DEFAULT_BWD_VARIANT, **errs, "bitwise": bitwise,
                       "ok": ok})
        print(f"  {var:<8} vs {fa.DEFAULT_BWD_VARIANT}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()) +
              (" (bitwise equal)" if bitwise else "") + ("" if ok else "  FAILED"))
        if not ok:
            failures.append(f"{var} vs {fa.DEFAULT_BWD_VARIANT} at {label}")
    flops = fa.flash_attention_flops(B, H, T, D, causal, "bwd")
    cudnn_ms = None
    if cudnn_attention.available():
        dq, dk, dv = (xp.empty(shape, backend.bfloat16) for _ in range(3))
        _, cst = fa.flash_attention_forward(q, k, v, causal, kernel="cudnn")
        cudnn_ms = time_fn(lambda: fa.flash_attention_backward(do, q, k, v, o, cst, causal, dq=dq, dk=dk, dv=dv,
                                                               kernel="cudnn"), xp=xp, reps=reps).median_ms
        table.append({"impl": "cudnn", "shape": label, "ms": cudnn_ms, "tflops": flops / cudnn_ms / 1e9})
        print(f"  {'cudnn':<8} {cudnn_ms:8.3f} ms {flops / cudnn_ms / 1e9:6.1f} TF/s")
    else:
        print(f"  (cuDNN: {cudnn_attention.unavailable_reason()})")
    for var in fa.BWD_VARIANTS:
        dq, dk, dv = grads[var]
        ms = time_fn(lambda: fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=dq, dk=dk, dv=dv,
                                                         kernel="ours", variant=var), xp=xp, reps=reps).median_ms
        parts = {}
        for name in fl.backward_kernels(var):  # each kernel alone (D from the full runs above)
            parts[name] = time_fn(lambda: fl.ours_backward(do, q, k, v, o, st.lse, st.scale, causal, dq, dk, dv,
                                                           var, only=name), xp=xp, reps=reps).median_ms
        row = {"impl": f"ours {var}", "variant": var, "shape": label, "ms": ms, "tflops": flops / ms / 1e9,
               "kernels_ms": parts, "registers": {n: _regs(n, q.dtype, D) for n in parts}}
        if cudnn_ms:
            row["vs_cudnn"] = cudnn_ms / ms
        table.append(row)
        vs = f" {cudnn_ms / ms:5.2f}x cuDNN{'' if cudnn_ms / ms >= FLOOR else ' (below the floor)'}" if cudnn_ms else ""
        print(f"  {var:<8} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TF/s{vs}   " +
              "  ".join(f"{n.replace('flash_bwd_', '')} {t:.3f} ms ({row['registers'][n]} regs)"
                        for n, t in parts.items()))


def main(argv=None):
    args = _common.parser(__doc__, no_torch=False).parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    if not on_gpu:
        print("flash attention kernels need a GPU: nothing to time on NumPy")
        return {}
    reps = 5 if quick else args.reps
    rng = np.random.default_rng(0)
    failures, table, checks = [], [], []
    print("correctness against float64:")
    checks += check_float64(xp, rng, failures)
    shapes = SHAPES[:1] if quick else SHAPES
    for B, H, T, D, causal in shapes:
        bench_shape(xp, rng, B, H, T, D, causal, reps, table, checks, failures)
    payload = {"quick": quick, "reps": reps, "default": fa.DEFAULT_BWD_VARIANT, "variants": list(fa.BWD_VARIANTS),
               "shapes": [dict(zip("BHTD", s[:4]), causal=s[4]) for s in shapes], "floor_vs_cudnn": FLOOR,
               "checks": checks, "failures": failures, "rows": table}
    _common.save(args.out or (None if quick else RESULTS), payload, xp)  # a --quick run writes nothing
    if failures:
        print("\nFAILED: " + "; ".join(failures))
    return payload


if __name__ == "__main__":
    sys.exit(1 if main().get("failures") else 0)
