"""Chapter 2 benchmark: softmax forward/backward kernels against the copy ceiling, and attention
(GEMM → softmax → GEMM and its backward) against PyTorch, measured in the same run.

    python benchmarks/bench_ch2_softmax_attention.py            # GPU: GPT-2 sizes, writes results JSON
    python benchmarks/bench_ch2_softmax_attention.py --quick    # tiny sizes (the default without a GPU)

Softmax at GPT-2 attention sizes: rows = B·H·T = 8·12·1024 score rows of length T = 1024 (201 MB per
bf16 tensor, far beyond the 60 MB L2), naive → warp → block, bandwidth counted as the minimum bytes
(forward: read x, write p; backward: read dp and p, write dx) against a device-to-device copy.
Also rows of vocabulary length (50257, and 50304 = padded to a multiple of 64 as llm.c does, which
lets the block kernel use 16-byte loads), and a sweep of short rows that checks the ``auto`` threshold
between the warp and block kernels. Attention at B=8, H=12, T=1024, D=64, bf16, causal: our math path
(cuBLAS GEMMs + our softmax) vs PyTorch's math path (matmul + softmax with autograd) and PyTorch's
flash SDPA. Results go to benchmarks/results/ch2/ch2_softmax_attention.json on a GPU (or to --out).
"""

from __future__ import annotations

import _common
import numpy as np

from llmgpu import backend
from llmgpu.ops import softmax as sm
from llmgpu.ops.attention import (
    attention_backward,
    attention_flops,
    attention_forward,
)
from llmgpu.perf.sweeps import attention_stage_times
from llmgpu.perf.timing import time_fn, time_torch, torch_cuda
from llmgpu.testing import random_array

RESULTS = _common.RESULTS_DIR / "ch2" / "ch2_softmax_attention.json"
KERNELS = ("naive", "warp", "block")
TARGET = 0.85  # fraction of the copy ceiling the optimized softmax backward should reach


def row(table, **kw):
    table.append(kw)
    ms = kw["ms"]
    rate = f"{kw['gbps']:8.0f} GB/s" if "gbps" in kw else f"{kw['tflops']:8.1f} TF/s"
    pct = f"{kw['pct']:5.1f} %" if kw.get("pct") is not None else ""
    print(f"  {kw['name']:<42} {kw['shape']:<22} {kw['dtype']:<10} {ms:9.4f} ms {rate} {pct}")


def bench_softmax(xp, rng, rows, cols, sdt, pdt, methods, ceiling, table, reps):
    """Forward and backward of each method on [rows, cols]; scores in sdt, probabilities in pdt."""
    x = random_array(rng, (rows, cols), sdt, xp, scale=2.0)
    p = sm.softmax_forward(x, method="block" if xp is not np else "auto", out_dtype=pdt)
    dp = random_array(rng, (rows, cols), sdt, xp)
    out_p = xp.empty((rows, cols), dtype=pdt)
    out_dx = xp.empty((rows, cols), dtype=pdt)
    dtype = backend.dtype_name(sdt) + ("" if sdt == pdt else f"→{backend.dtype_name(pdt)}")
    shape = f"{rows}x{cols}"
    for m in methods:
        r = max(3, reps // 5) if m == "naive" else reps
        for direction, fn in (
            ("fwd", lambda m=m: sm.softmax_forward(x, method=m, out=out_p, out_dtype=pdt)),
            ("bwd", lambda m=m: sm.softmax_backward(dp, p, method=m, out=out_dx)),
        ):
            t = time_fn(fn, xp=xp, warmup=1 if m == "naive" else 3, reps=r)
            nbytes = sm.softmax_bytes(rows, cols, sdt, pdt, direction)
            gbps = t.gbps(nbytes)
            row(table, name=f"softmax {direction} {m}", kind="softmax", method=m, direction=direction, shape=shape,
                rows=rows, cols=cols, dtype=dtype, ms=t.median_ms, gbps=gbps, bytes=nbytes,
                pct=100 * gbps / ceiling)  # fmt: skip


def bench_torch_softmax(rows, cols, ceiling, table, reps):
    torch = torch_cuda()
    if torch is None:
        return
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    p = torch.softmax(x, -1)
    dp = torch.randn_like(x)
    shape = f"{rows}x{cols}"
    for direction, fn in (
        ("fwd", lambda: torch.softmax(x, -1)),
        ("bwd", lambda: torch._softmax_backward_data(dp, p, -1, torch.bfloat16)),
    ):
        ms = time_torch(torch, fn, reps)
        nbytes = sm.softmax_bytes(rows, cols, backend.bfloat16, backend.bfloat16, direction)
        gbps = _common.gbps(nbytes, ms)
        row(table, name=f"torch softmax {direction}", kind="softmax", method="torch", direction=direction,
            shape=shape, rows=rows, cols=cols, dtype="bf16", ms=ms, gbps=gbps, bytes=nbytes,
            pct=100 * gbps / ceiling)  # fmt: skip


# --------------------------------------------------------------------------- attention


def bench_attention(xp, rng, B, H, T, D, dtype, table, reps):
    q, k, v, do = (random_array(rng, (B, H, T, D), dtype, xp) for _ in range(4))
    shape = f"{B}x{H}x{T}x{D}"
    name = backend.dtype_name(dtype)
    out = {}
    variants = (True, False) if dtype != backend.float32 else (True,)  # fp32 inputs: S is fp32 either way
    for fp32_scores in variants:
        tag = "fp32 S" if fp32_scores else f"{name} S"
        o, stats = attention_forward(q, k, v, causal=True, fp32_scores=fp32_scores)
        tf = time_fn(lambda s=fp32_scores: attention_forward(q, k, v, causal=True, fp32_scores=s), xp=xp, reps=reps)
        tb = time_fn(
            lambda s=fp32_scores, o=o, st=stats: attention_backward(do, q, k, v, o, st, causal=True, fp32_scores=s),
            xp=xp,
            reps=reps,
        )
        for direction, t in (("fwd", tf), ("bwd", tb)):
            fl = attention_flops(B, H, T, D, causal=True, direction=direction)
            row(table, name=f"llmgpu attention {direction} ({tag})", kind="attention", impl="llmgpu",
                fp32_scores=fp32_scores, direction=direction, shape=shape, dtype=name, ms=t.median_ms,
                tflops=t.tflops(fl))  # fmt: skip
            out[(fp32_scores, direction)] = t.median_ms
        del o, stats
    stages = attention_stage_times(q, k, v, do, causal=True, reps=reps)
    print("  stage breakdown (fp32 S):")
    for s in stages:
        print(f"    {s['pass']} {s['stage']:<26} {s['kind']:<8} {s['ms']:8.4f} ms")
    return out, stages


def bench_torch_attention(B, H, T, D, table, reps, ours):
    torch = torch_cuda()
    if torch is None:
        return {}
    import torch.nn.functional as F

    shape = f"{B}x{H}x{T}x{D}"
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(T, T, device="cuda", dtype=torch.bool).tril()
    scale = 1.0 / D**0.5

    def math_path():
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    def flash_path():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ratios = {}
    for label, fwd in (("torch math (autograd)", math_path), ("torch SDPA flash", flash_path)):
        try:
            o = fwd()
            ms_f = time_torch(torch, fwd, reps)
            ms_b = time_torch(torch, lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), reps)
        except Exception as e:  # noqa: BLE001 - report and carry on (e.g. no flash kernel for this GPU)
            print(f"  {label}: skipped ({type(e).__name__}: {e})")
            continue
        for direction, ms in (("fwd", ms_f), ("bwd", ms_b)):
            fl = attention_flops(B, H, T, D, causal=True, direction=direction)
            row(table, name=f"{label} {direction}", kind="attention", impl=label, direction=direction, shape=shape,
                dtype="bf16", ms=ms, tflops=fl / (ms * 1e-3) / 1e12)  # fmt: skip
            ratios[f"{label} {direction}: llmgpu ms / torch ms"] = ours[(True, direction)] / ms
        del o
    return ratios


# --------------------------------------------------------------------------- main


def main(argv=None):
    args = _common.parser(__doc__).parse_args(argv)

    xp, on_gpu, quick = _common.setup(args)
    reps = 3 if quick else args.reps
    rng = np.random.default_rng(0)
    if quick:
        B, H, T, D = 1, 2, 64, 16
        vocab, vocab_rows, sweep, sweep_elems = (257,), 16, (8, 128, 512), 2**14
    else:
        B, H, T, D = 8, 12, 1024, 64
        vocab, vocab_rows, sweep, sweep_elems = (50257, 50304), 8 * 1024, (8, 32, 64, 128, 256, 512, 1024), 2**27
    ceiling = _common.copy_ceiling(xp, 2**31 if not quick else 2**22)
    table = []
    bf16, fp32 = backend.bfloat16, backend.float32
    # NumPy has no fast bf16: on the CPU the smoke run stays in fp32
    dts = ((bf16, bf16), (fp32, fp32), (fp32, bf16)) if on_gpu else ((fp32, fp32),)

    print(f"\nsoftmax over attention score rows: {B * H * T} rows of length {T}")
    for sdt, pdt in dts:
        bench_softmax(xp, rng, B * H * T, T, sdt, pdt, KERNELS, ceiling, table, reps)
    if on_gpu and not args.no_torch:
        bench_torch_softmax(B * H * T, T, ceiling, table, reps)

    print(f"\nsoftmax over vocabulary rows: {vocab_rows} rows")
    for V in vocab:
        bench_softmax(xp, rng, vocab_rows, V, dts[0][0], dts[0][1], KERNELS, ceiling, table, reps)

    print("\nauto threshold: warp vs block kernel on short rows")
    for cols in sweep:
        bench_softmax(xp, rng, max(1, sweep_elems // cols), cols, dts[0][0], dts[0][1], ("warp", "block"),
                      ceiling, table, reps)  # fmt: skip

    adt = bf16 if on_gpu else fp32
    print(f"\nattention B={B} H={H} T={T} D={D} {backend.dtype_name(adt)} causal")
    ours, stages = bench_attention(xp, rng, B, H, T, D, adt, table, reps)
    ratios = {}
    if on_gpu and not args.no_torch:
        ratios = bench_torch_attention(B, H, T, D, table, reps, ours)
        for key, r in ratios.items():
            print(f"  {key}: {r:.2f}")

    summary = {}
    big = [r for r in table if r.get("kind") == "softmax" and r.get("cols") == T and r.get("rows") == B * H * T]
    for r in big:
        if r["method"] == "block" and r["dtype"] == backend.dtype_name(dts[0][0]):
            summary[f"block {r['direction']} % of copy"] = round(r["pct"], 1)
    bwd = summary.get("block bwd % of copy")
    if bwd is not None:
        verdict = "met" if bwd >= 100 * TARGET else "NOT met"
        print(f"\ntarget: block softmax backward >= {100 * TARGET:.0f} % of copy: {bwd:.1f} % ({verdict})")
        summary["target_met"] = bwd >= 100 * TARGET
    thresholds = {}
    for cols in sweep:
        for direction in ("fwd", "bwd"):
            ms = {r["method"]: r["ms"] for r in table
                  if r.get("cols") == cols and r.get("direction") == direction and r.get("method") in ("warp", "block")
                  and r.get("rows") == max(1, sweep_elems // cols)}  # fmt: skip
            if len(ms) == 2:
                thresholds[f"{cols} {direction}"] = min(ms, key=ms.get)
    print(f"faster kernel by row length: {thresholds} (auto uses warp up to {sm.AUTO_WARP_MAX_COLS} columns)")

    payload = {
        "copy_ceiling_gbps": ceiling,
        "quick": quick,
        "config": {"B": B, "H": H, "T": T, "D": D},
        "rows": table,
        "attention_stages": stages,
        "torch_ratios": ratios,
        "summary": summary,
        "faster_by_row_length": thresholds,
        "auto_warp_max_cols": sm.AUTO_WARP_MAX_COLS,
    }
    _common.save(args.out or (RESULTS if on_gpu else None), payload, xp)
    return payload


if __name__ == "__main__":
    main()
