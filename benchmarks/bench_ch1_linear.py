#!/usr/bin/env python3
"""Chapter 1 benchmark: the linear layer's GEMMs and bias kernels at GPT-2 sizes.

    python benchmarks/bench_ch1_linear.py            # GPU: full run, writes benchmarks/results/ch1/ch1_linear.json
    python benchmarks/bench_ch1_linear.py --quick    # fewer shapes (the default on CPU: NumPy, tiny sizes)
    python benchmarks/bench_ch1_linear.py --out x.json

What it measures, on the GPU, in bf16, for N = 16384 (B=16, T=1024) and 65536 tokens and the four
linear layers of a GPT-2 block (768→768 attention projection, 768→2304 qkv, 768→3072 MLP up,
3072→768 MLP down):

* TFLOP/s of forward (``linear_forward``, bias included), dgrad and wgrad (the two ``gemm`` calls of
  ``linear_backward``) and the whole ``linear_backward``, against the 8192³ bf16 cuBLAS ceiling
  measured in the same run;
* wrapper overhead: ``llmgpu.gemm.gemm`` against a direct ``cupy.cuda.cublas.gemmEx`` call with the
  identical arguments (GPU time ratio, target ≤ 1.05; and host microseconds per call);
* the bias-gradient and bias-add kernels in GB/s against the device-to-device copy ceiling;
* PyTorch (``F.linear``; ``dy @ w``, ``dy.t() @ x``, ``dy.sum(0)``; autograd backward) on the same
  shapes when torch with CUDA is importable: ratio = PyTorch time / our time (> 1: we are faster).

On a machine without a GPU it runs the NumPy reference at tiny sizes (so the script is exercised by
CI) and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import time

import _common
import numpy as np

from llmgpu import backend
from llmgpu.gemm.cublas import CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUDA_DATA_TYPES, gemm
from llmgpu.ops.linear import linear_flops
from llmgpu.perf import timing
from llmgpu.perf.sweeps import measure_linear
from llmgpu.testing import assert_close

RESULTS = _common.RESULTS_DIR / "ch1" / "ch1_linear.json"
GPT2_LAYERS = [
    ("attn.c_proj", 768, 768),
    ("attn.c_attn", 768, 2304),
    ("mlp.c_fc", 768, 3072),
    ("mlp.c_proj", 3072, 768),
]


def direct_gemm_call(a, b, out, trans_a=False, trans_b=False):
    """A zero-argument function making the cublasGemmEx call llmgpu.gemm makes, arguments prebuilt."""
    from cupy.cuda import cublas

    cp = backend.cupy_module()
    handle = cp.cuda.device.get_cublas_handle()
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    dt, dto = CUDA_DATA_TYPES[a.dtype], CUDA_DATA_TYPES[out.dtype]
    args = (
        handle, int(trans_b), int(trans_a), n, m, k, one.ctypes.data,
        b.data.ptr, dt, b.shape[1], a.data.ptr, dt, a.shape[1], zero.ctypes.data,
        out.data.ptr, dto, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip
    keep = (one, zero)  # the scalars must outlive the calls

    def call():
        cublas.gemmEx(*args)
        return keep

    return call


def host_us(fn, calls=200):
    """Host microseconds per call (no synchronisation inside the loop: what the CPU spends)."""
    fn()
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    backend.synchronize()
    return dt / calls * 1e6


def overhead(n, c_in, c_out, dtype, reps):
    """llmgpu.gemm vs the direct cuBLAS call, same arguments, for the three GEMMs of one layer."""
    cp = backend.cupy_module()
    rs = cp.random.RandomState(1)
    mk = lambda *s: rs.standard_normal(s, dtype=np.float32).astype(dtype)
    x, w, dy = mk(n, c_in), mk(c_out, c_in), mk(n, c_out)
    y, dx, dw = cp.empty((n, c_out), dtype), cp.empty((n, c_in), dtype), cp.empty((c_out, c_in), dtype)
    cases = {
        "fwd": ((x, w, y), dict(trans_b=True)),
        "dgrad": ((dy, w, dx), {}),
        "wgrad": ((dy, x, dw), dict(trans_a=True)),
    }
    out = {}
    for name, ((a, b, o), kw) in cases.items():
        ours = lambda a=a, b=b, o=o, kw=kw: gemm(a, b, out=o, **kw)
        direct = direct_gemm_call(a, b, o, **kw)
        ours()
        ref = o.copy()
        o.fill(0)
        direct()
        assert_close(o, ref, dtype, name=f"direct cuBLAS call vs llmgpu.gemm ({name})")
        identical = bool(cp.array_equal(o, ref))
        t_ours = timing.time_fn(ours, xp=cp, reps=reps).median_ms
        t_direct = timing.time_fn(direct, xp=cp, reps=reps).median_ms
        out[name] = {
            "ms_llmgpu": t_ours,
            "ms_direct": t_direct,
            "ratio": t_ours / t_direct,
            "host_us_llmgpu": host_us(ours),
            "host_us_direct": host_us(direct),
            "bitwise_identical": identical,
        }
    return out


def torch_times(n, c_in, c_out, reps):
    """PyTorch's time for the same work (same shapes, bf16), or None without torch on CUDA."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(n, c_in, device=dev, dtype=dt)
    w = torch.randn(c_out, c_in, device=dev, dtype=dt) * c_in**-0.5
    b = torch.randn(c_out, device=dev, dtype=dt)
    dy = torch.randn(n, c_out, device=dev, dtype=dt)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    yr = F.linear(xr, wr, br)

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in times]))

    with torch.no_grad():
        res = {
            "fwd": timed(lambda: F.linear(x, w, b)),
            "dgrad": timed(lambda: dy @ w),
            "wgrad": timed(lambda: dy.t() @ x),
            "bias_grad": timed(lambda: dy.sum(0)),
        }
    res["bwd"] = timed(lambda: torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True))
    return {"version": torch.__version__, "ms": res}


def main(argv=None):
    args = _common.parser(__doc__, reps=None).parse_args(argv)
    xp, gpu, quick = _common.setup(args)
    if gpu:
        dtype = backend.bfloat16
        tokens = [16384] if quick else [16384, 65536]
        layers = GPT2_LAYERS[2:3] if quick else GPT2_LAYERS
        reps = args.reps or 30
        ceiling = timing.gemm_ceiling(8192, "bf16", xp=xp)
        copy_gbps = timing.copy_bandwidth(xp=xp)
    else:
        dtype = backend.float32  # NumPy has no fast 16-bit GEMM; the CPU numbers are a smoke test
        tokens = [256]
        layers = [(name, c_in // 12, c_out // 12) for name, c_in, c_out in GPT2_LAYERS]
        reps = args.reps or 3
        ceiling = timing.gemm_ceiling(512, "fp32", xp=xp, reps=3)
        copy_gbps = timing.copy_bandwidth(2**24, xp=xp, reps=3)
    dname = backend.dtype_name(dtype)
    print(f"ceilings: GEMM {ceiling:.1f} TFLOP/s ({'8192³ bf16' if gpu else '512³ fp32'}), copy {copy_gbps:.0f} GB/s")

    rows = []
    hdr = f"{'layer':<12} {'N':>6} {'Cin':>5} {'Cout':>5} {'op':<9} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%ceil':>6}"
    print(hdr)
    print("-" * len(hdr))
    for n in tokens:
        for name, c_in, c_out in layers:
            r = measure_linear(n, c_in, c_out, dname, xp=xp, reps=reps)
            r["layer"] = name
            for op in ("fwd", "dgrad", "wgrad", "bwd", "bias_grad", "bias_add"):
                e = r[op]
                if "tflops" in e:
                    e["pct_ceiling"] = 100 * e["tflops"] / ceiling
                    rate = f"{e['tflops']:8.1f} {'':>7}"
                else:
                    e["pct_ceiling"] = 100 * e["gbps"] / copy_gbps
                    rate = f"{'':>8} {e['gbps']:7.0f}"
                print(f"{name:<12} {n:6d} {c_in:5d} {c_out:5d} {op:<9} {e['ms']:8.4f} {rate} {e['pct_ceiling']:5.0f}%")
            if gpu:
                r["overhead"] = overhead(n, c_in, c_out, dtype, reps)
                for op, o in r["overhead"].items():
                    print(
                        f"{'':<12} {'':>6} {'':>5} {'':>5} {op:<9} gemm/direct cuBLAS time {o['ratio']:.3f} "
                        f"(host {o['host_us_llmgpu']:.1f} vs {o['host_us_direct']:.1f} µs/call)"
                    )
                tt = None if args.no_torch else torch_times(n, c_in, c_out, reps)
                if tt is not None:
                    r["torch"] = tt
                    r["torch_ratio"] = {op: tt["ms"][op] / r[op]["ms"] for op in tt["ms"]}
                    desc = ", ".join(f"{op} {v:.2f}" for op, v in r["torch_ratio"].items())
                    print(f"{'':<12} {'':>6} {'':>5} {'':>5} torch time / ours: {desc}")
            rows.append(r)

    worst = max((o["ratio"] for r in rows for o in r.get("overhead", {}).values()), default=None)
    if worst is not None:
        print(f"worst llmgpu.gemm / direct cuBLAS time ratio: {worst:.3f} (target ≤ 1.05)")
    payload = {
        "benchmark": "ch1_linear",
        "dtype": dname,
        "quick": quick,
        "gemm_ceiling_tflops": ceiling,
        "gemm_ceiling_shape": "8192^3 bf16 (cuBLAS)" if gpu else "512^3 fp32 (NumPy BLAS)",
        "copy_gbps": copy_gbps,
        "flops_per_gemm": {f"{r['n']}x{r['c_in']}x{r['c_out']}": linear_flops(r["n"], r["c_in"], r["c_out"])
                           for r in rows},
        "worst_gemm_overhead_ratio": worst,
        "rows": rows,
    }  # fmt: skip
    _common.save(args.out or (RESULTS if gpu else None), payload, xp)
    return payload


if __name__ == "__main__":
    main()
