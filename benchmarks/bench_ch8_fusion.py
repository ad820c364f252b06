"""Chapter 8 benchmark: cuBLASLt epilogue fusion and launch overhead, before / after.

    python benchmarks/bench_ch8_fusion.py            # GPU: GPT-2 MLP sizes, writes the JSON
    python benchmarks/bench_ch8_fusion.py --quick    # small sizes (the default on CPU)

The GPT-2 MLP up-projection at B·T = 65536 tokens, C = 768 → 4C = 3072, bf16, three ways each:

* forward    separate: ``gemm`` (cuBLAS) + ``bias_add`` + ``gelu_forward`` (pre-activation kept)
             fused:    ``lt_gemm(..., epilogue="gelu_bias", aux=pre)`` (cuBLASLt GELU_AUX_BIAS)
* dgrad      separate: ``gemm(dout, W_proj)`` + ``gelu_backward``
             fused:    ``lt_gemm(dout, W_proj, epilogue="dgelu", aux=pre)`` (DGELU)
* wgrad      separate: ``gemm(dpreᵀ, x)`` into the fp32 gradient (beta = 1) + ``bias_grad``
             fused:    ``lt_gemm(..., beta=1, epilogue="bgradb", dbias=db)`` (BGRADB; db overwritten)

Every line: median ms, TFLOP/s (2·N·C·4C per call) against the bf16 GEMM ceiling measured in the same
run, and the speed-up of the fused call over the separate sequence. Plain cuBLASLt GEMMs (no epilogue,
bias only) are timed too, to show what each epilogue costs on top of the bare product. With PyTorch on
CUDA, its equivalents (``F.gelu(F.linear)``, ``torch._addmm_activation``, ``aten.gelu_backward(mm)``,
``mm + sum``) are timed on the same data (DLPack) and the ratio reported. Then launch overhead: host µs
per RawKernel launch, eager vs replayed from a CUDA graph (``llmgpu.perf.profile.launch_overhead``).

On the GPU the results go to benchmarks/results/ch8/ch8_fusion.json; on the CPU (NumPy, a smoke test of
the script) nothing is written unless --out is given.
"""

from __future__ import annotations

import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.gemm import cublaslt as gemm_lt
from llmgpu.gemm import gemm
from llmgpu.ops.gelu import gelu_backward, gelu_forward
from llmgpu.ops.linear import add_bias, bias_grad
from llmgpu.perf import timing
from llmgpu.testing import rel_error

RESULTS = _common.RESULTS_DIR / "ch8" / "ch8_fusion.json"
FULL = {"N": 65536, "C": 768, "O": 3072}
QUICK = {"N": 128, "C": 64, "O": 256}


def parse_args(argv):
    ap = _common.parser(__doc__)
    ap.add_argument("--dtype", default="bf16", help="storage dtype of activations and weights")
    ap.add_argument("--launches", type=int, default=1000, help="kernels per launch-overhead measurement")
    return ap.parse_args(argv)


_time_torch = timing.time_torch


def make_data(xp, sz, dtype, seed=0):
    rng = np.random.default_rng(seed)
    N, C, O = sz["N"], sz["C"], sz["O"]
    dt = backend.resolve_dtype(dtype)

    def r(shape, scale=1.0):
        return backend.to_device((rng.standard_normal(shape) * scale).astype(dt), xp)

    d = {"x": r((N, C)), "W": r((O, C), C**-0.5), "b": r((O,), 0.1), "W2": r((C, O), O**-0.5), "dout": r((N, C))}
    for name, shape, t in (("pre", (N, O), dt), ("h", (N, O), dt), ("pre_f", (N, O), dt), ("h_f", (N, O), dt),
                           ("dh", (N, O), dt), ("dpre", (N, O), dt), ("dpre_f", (N, O), dt),
                           ("dW", (O, C), np.float32), ("dW_f", (O, C), np.float32), ("db", (O,), np.float32),
                           ("db_f", (O,), np.float32), ("y", (N, O), dt)):
        d[name] = xp.zeros(shape, dtype=t)
    return d


def cases(d, lt_ok):
    """(stage, variant, fn) for every timed sequence; fused variants only when cuBLASLt is usable."""
    fwd_sep = [lambda: gemm(d["x"], d["W"], trans_b=True, out=d["pre"]), lambda: add_bias(d["pre"], d["b"]),
               lambda: gelu_forward(d["pre"], out=d["h"])]
    dgrad_sep = [lambda: gemm(d["dout"], d["W2"], out=d["dh"]), lambda: gelu_backward(d["dh"], d["pre"], out=d["dpre"])]
    wgrad_sep = [lambda: gemm(d["dpre"], d["x"], trans_a=True, out=d["dW"], beta=1.0),
                 lambda: bias_grad(d["dpre"], out=d["db"], accumulate=True)]

    def seq(fns):
        def run():
            for f in fns:
                f()
        return run

    out = [("forward", "separate: gemm + bias_add + gelu", seq(fwd_sep)),
           ("dgrad", "separate: gemm + gelu_backward", seq(dgrad_sep)),
           ("wgrad", "separate: gemm(beta=1) + bias_grad", seq(wgrad_sep))]
    if lt_ok:
        lt = gemm_lt.lt_gemm
        out += [
            ("forward", "cuBLASLt plain (no bias)", lambda: lt(d["x"], d["W"], trans_b=True, out=d["y"])),
            ("forward", "cuBLASLt BIAS", lambda: lt(d["x"], d["W"], trans_b=True, out=d["y"], bias=d["b"],
                                                    epilogue="bias")),
            ("forward", "fused: cuBLASLt GELU_AUX_BIAS", lambda: lt(d["x"], d["W"], trans_b=True, out=d["h_f"],
                                                                    bias=d["b"], epilogue="gelu_bias",
                                                                    aux=d["pre_f"])),
            ("dgrad", "cuBLASLt plain", lambda: lt(d["dout"], d["W2"], out=d["dh"])),
            ("dgrad", "fused: cuBLASLt DGELU", lambda: lt(d["dout"], d["W2"], out=d["dpre_f"], epilogue="dgelu",
                                                          aux=d["pre"])),
            ("wgrad", "cuBLASLt plain (beta=1)", lambda: lt(d["dpre"], d["x"], trans_a=True, out=d["dW_f"],
                                                            beta=1.0)),
            ("wgrad", "fused: cuBLASLt BGRADB (beta=1)", lambda: lt(d["dpre"], d["x"], trans_a=True, out=d["dW_f"],
                                                                    beta=1.0, epilogue="bgradb", dbias=d["db_f"])),
        ]
    return out


def check_fused(xp, d):
    """Relative error of each fused output against the separate sequence (fresh buffers, one call each)."""
    lt = gemm_lt.lt_gemm
    gemm(d["x"], d["W"], trans_b=True, out=d["pre"])
    add_bias(d["pre"], d["b"])
    gelu_forward(d["pre"], out=d["h"])
    lt(d["x"], d["W"], trans_b=True, out=d["h_f"], bias=d["b"], epilogue="gelu_bias", aux=d["pre_f"])
    gemm(d["dout"], d["W2"], out=d["dh"])
    gelu_backward(d["dh"], d["pre"], out=d["dpre"])
    lt(d["dout"], d["W2"], out=d["dpre_f"], epilogue="dgelu", aux=d["pre"])
    d["dW"][...] = 0
    d["db"][...] = 0
    gemm(d["dpre"], d["x"], trans_a=True, out=d["dW"], beta=1.0)
    bias_grad(d["dpre"], out=d["db"], accumulate=True)
    d["dW_f"][...] = 0
    lt(d["dpre"], d["x"], trans_a=True, out=d["dW_f"], beta=1.0, epilogue="bgradb", dbias=d["db_f"])
    return {"pre (aux)": rel_error(d["pre_f"], d["pre"]), "h = gelu(pre)": rel_error(d["h_f"], d["h"]),
            "dpre (dgelu)": rel_error(d["dpre_f"], d["dpre"]), "dW": rel_error(d["dW_f"], d["dW"]),
            "db (bgradb)": rel_error(d["db_f"], d["db"])}


def torch_cases(torch, d, reps):
    F = torch.nn.functional
    T = {k: torch.from_dlpack(v) for k, v in d.items() if k in ("x", "W", "b", "W2", "dout", "pre", "dpre")}
    x, W, b, W2, dout, pre, dpre = (T[k] for k in ("x", "W", "b", "W2", "dout", "pre", "dpre"))
    res = {("forward", "separate"): _time_torch(torch, lambda: F.gelu(F.linear(x, W, b), approximate="tanh"), reps),
           ("dgrad", "separate"): _time_torch(
               torch, lambda: torch.ops.aten.gelu_backward(torch.mm(dout, W2), pre, approximate="tanh"), reps),
           ("wgrad", "separate"): _time_torch(torch, lambda: (torch.mm(dpre.t(), x), dpre.sum(0)), reps)}
    try:
        res[("forward", "fused")] = _time_torch(
            torch, lambda: torch._addmm_activation(b, x, W.t(), use_gelu=True), reps)
    except Exception:
        pass
    return res


def main(argv=None):
    args = parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    sz = QUICK if quick else FULL
    reps = args.reps if on_gpu else min(args.reps, 3)
    N, C, O = sz["N"], sz["C"], sz["O"]
    ceiling = timing.gemm_ceiling(8192 if on_gpu else 256, "bf16" if on_gpu else "fp32", xp=xp,
                                  reps=10 if on_gpu else 2)
    print(f"GEMM ceiling ({'bf16 cuBLAS 8192³' if on_gpu else 'fp32 NumPy 256³'}): {ceiling:.3g} TFLOP/s")
    lt_reason = gemm_lt.unavailable_reason() if on_gpu else None
    lt_ok = lt_reason is None
    if not lt_ok:
        print(f"cuBLASLt path unavailable: {lt_reason}; only the separate sequences are timed")
    torch = _common.torch_or_none(args, on_gpu)

    d = make_data(xp, sz, args.dtype)
    errors = None
    if lt_ok:
        errors = check_fused(xp, d)
        print("fused vs separate, relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    flops = 2.0 * N * C * O
    shape = f"{N}x{C}->{O}"
    tt = torch_cases(torch, d, args.reps) if torch else {}
    rows = []
    print(f"{'stage':<9}{'variant':<36}{'shape':<18}{'ms':>9}{'TFLOP/s':>9}{'% gemm':>8}{'vs separate':>12}"
          + (f"{'torch ms':>10}{'torch/ours':>11}" if torch else ""))
    sep_ms = {}
    for stage, variant, fn in cases(d, lt_ok):
        t = timing.time_fn(fn, xp=xp, warmup=2, reps=reps)
        tfl = t.tflops(flops)
        row = {"stage": stage, "variant": variant, "shape": shape, "dtype": args.dtype, "median_ms": t.median_ms,
               "tflops": tfl, "pct_of_gemm_ceiling": 100.0 * tfl / ceiling}
        if variant.startswith("separate"):
            sep_ms[stage] = t.median_ms
        if stage in sep_ms and not variant.startswith("separate"):
            row["speedup_vs_separate"] = sep_ms[stage] / t.median_ms
        kind = "separate" if variant.startswith("separate") else ("fused" if variant.startswith("fused") else None)
        if kind and (stage, kind) in tt:
            row["torch_ms"] = tt[(stage, kind)]
            row["torch_over_ours"] = row["torch_ms"] / t.median_ms
        rows.append(row)
        sp = row.get("speedup_vs_separate")
        line = (f"{stage:<9}{variant:<36}{shape:<18}{t.median_ms:9.3f}{tfl:9.1f}{row['pct_of_gemm_ceiling']:7.1f}%"
                f"{'' if sp is None else f'{sp:.2f}x':>12}")
        if torch:
            line += (f"{row['torch_ms']:10.3f}{row['torch_over_ours']:10.2f}x" if "torch_ms" in row else f"{'':>21}")
        print(line, flush=True)

    launch = None
    if on_gpu:
        from llmgpu.perf.profile import launch_overhead

        launch = launch_overhead(args.launches).as_dict()
        print(f"launch overhead ({launch['n']} vector_add launches): eager {launch['eager_host_us']:.2f} us host / "
              f"{launch['eager_wall_us']:.2f} us wall per kernel, op call {launch['op_host_us']:.2f} us; graph replay "
              f"{launch['graph_wall_us']:.2f} us per kernel ({launch['graph_launch_us']:.0f} us per graph.launch, "
              f"{launch['kernels_in_graph']} kernel nodes)")

    payload = {"benchmark": "ch8_fusion", "quick": quick, "sizes": sz, "gemm_ceiling_tflops": ceiling,
               "cublaslt": None if lt_ok else lt_reason, "fused_rel_errors": errors,
               "torch": None if torch is None else torch.__version__, "launch_overhead": launch, "results": rows}
    _common.save(args.out or (RESULTS if on_gpu else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
