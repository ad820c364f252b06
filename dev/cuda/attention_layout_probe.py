"""Does the memory layout of q, k, v, o and their gradients change attention's speed? (issue 19)

    python dev/cuda/attention_layout_probe.py              # a table; --json out.json to keep it

Why: chapter 8's per-op table of the GPT-2 step at B = 64 (``profile_step_gpt2_b64.json``) has cuDNN's attention
at 0.334 ms forward and 1.235 ms backward per layer, while ``bench_flash_attention.py`` times cuDNN at 0.295 and
about 1.09 ms on the same shape: 13-16 % slower inside the step, 2.4 ms of the 106 ms step. The step hands
attention strided views (q, k, v of the QKV GEMM's [B, T, 3, H, D] output, o and dO of [B, T, C] activations,
dq, dk, dv into one [B, T, 3C] buffer); the benchmark contiguous [B, H, T, D] arrays.

Hypothesis (written before the run): the packed layout is most of the gap: "packed" 10-15 % slower than
"BHTD" for cuDNN, "BTHD" (each tensor its own [B, T, H, D] array) in between; ours, which reads 64-element
rows either way, within 3 % across layouts.

Outcome (H200, 2026-12-03, ``benchmarks/results/ch8/attention_layout_probe.json``): no. cuDNN 0.297 / 0.298 / 0.299 ms
forward and 1.066 / 1.090 / 1.096 ms backward (BHTD / BTHD / packed), ours 0.359 / 0.367 / 0.371 and
1.324 / 1.336 / 1.351: the packed views cost cuDNN 1 % and 3 %, not 10-15 %. The per-op table's extra time is
not the layout (chapter 8).

GPT-2's attention (B = 64, H = 12, T = 1024, D = 64, bf16, causal), forward and backward, cuDNN and ours, in
three layouts. Outputs are checked against the BHTD ones (bit for bit is not assumed: an engine may change with
the strides): max |diff| / max |BHTD| ≤ 1e-2, else FAIL and exit 1. Without a GPU: one line saying so, exit 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _devscript  # first: puts the package on the path
import numpy as np

from llmgpu import backend

B, H, T, D = 64, 12, 1024, 64
C = H * D
LAYOUTS = ("BHTD", "BTHD", "packed (the step's)")


def _tensors(cp, layout, src):
    """q, k, v, do as [B, H, T, D] views in ``layout`` holding ``src``'s values, and empty o, dq, dk, dv."""
    from llmgpu.ops.flash_attention import heads_view, split_qkv

    bf = backend.bfloat16
    if layout == "BHTD":
        ins = [cp.ascontiguousarray(a) for a in src]
        outs = [cp.empty((B, H, T, D), bf) for _ in range(4)]
    elif layout == "BTHD":
        def view(a):
            buf = cp.empty((B, T, H, D), bf)
            v = buf.transpose(0, 2, 1, 3)
            v[...] = a
            return v
        ins = [view(a) for a in src]
        outs = [cp.empty((B, T, H, D), bf).transpose(0, 2, 1, 3) for _ in range(4)]
    else:
        qkv = cp.empty((B, T, 3 * C), bf)
        q, k, v = split_qkv(qkv, H)
        for dst, a in zip((q, k, v), src[:3]):
            dst[...] = a
        dy = cp.empty((B, T, C), bf)
        do = heads_view(dy, H)
        do[...] = src[3]
        dqkv = cp.empty((B, T, 3 * C), bf)
        ins = [q, k, v, do]
        outs = [heads_view(cp.empty((B, T, C), bf), H), *split_qkv(dqkv, H)]
    return ins, outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    cp = _devscript.cupy_or_say_why()
    if cp is None:
        return 0
    from llmgpu.ops.flash_attention import flash_attention_backward, flash_attention_flops, flash_attention_forward
    from llmgpu.perf import timing

    print(f"device: {backend.device_info(cp).summary()}")
    cp.random.seed(0)
    src = [(cp.random.standard_normal((B, H, T, D), dtype=np.float32) * (0.5 if i < 2 else 1.0)).astype(
        backend.bfloat16) for i in range(4)]
    fl_fwd, fl_bwd = (flash_attention_flops(B, H, T, D, causal=True, direction=d) for d in ("fwd", "bwd"))
    rows, ref, failed = [], {}, False
    for kernel in ("cudnn", "ours"):
        for layout in LAYOUTS:
            (q, k, v, do), (o, dq, dk, dv) = _tensors(cp, layout, src)
            _, stats = flash_attention_forward(q, k, v, causal=True, out=o, kernel=kernel)

            def fwd():
                flash_attention_forward(q, k, v, causal=True, out=o, kernel=kernel)

            def bwd():
                flash_attention_backward(do, q, k, v, o, stats, causal=True, dq=dq, dk=dk, dv=dv, kernel=kernel)

            bwd()
            got = [cp.ascontiguousarray(t).astype(np.float32) for t in (o, dq, dk, dv)]
            if layout == "BHTD":
                ref[kernel] = got
            diff = max(float(cp.abs(g - r).max() / cp.abs(r).max()) for g, r in zip(got, ref[kernel]))
            bad = not diff <= 1e-2  # a few bf16 roundings of the largest value; NaN fails too
            tf = timing.time_fn(fwd, xp=cp, reps=a.reps).median_ms
            tb = timing.time_fn(bwd, xp=cp, reps=a.reps).median_ms
            rows.append({"kernel": kernel, "layout": layout, "fwd_ms": tf, "bwd_ms": tb,
                         "fwd_tflops": fl_fwd / tf / 1e9, "bwd_tflops": fl_bwd / tb / 1e9,
                         "max_rel_diff_vs_bhtd": diff})
            print(f"{kernel:>6} {layout:>20}: forward {tf:6.3f} ms ({rows[-1]['fwd_tflops']:4.0f} TFLOP/s), backward "
                  f"{tb:6.3f} ms ({rows[-1]['bwd_tflops']:4.0f}); max |diff| / max |BHTD| {diff:.2g}"
                  + ("  FAIL" if bad else ""), flush=True)
            failed = failed or bad
    if a.json:
        a.json.write_text(json.dumps({"probe": "attention_layout", "device": backend.device_info(cp).summary(),
                                      "shape": {"B": B, "H": H, "T": T, "D": D}, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
