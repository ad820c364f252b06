"""Probe: what the MLP's GELU epilogues cost cuBLASLt, and what an inference forward saves by not keeping aux.

    python tools/probes/probe_gelu_epilogue.py [--batches 16,64] [--reps 30] [--json out.json]

Chapter 8's floor puts 5.9 ms of the GPT-2 step at B = 64 above the floor in two GEMMs: the fc forward with
GELU_AUX_BIAS (writes the pre-activation ``f`` and ``GELU(f)``) and the projection's dgrad with DGELU (reads ``f``):
cuBLASLt runs them at 470-500 TFLOP/s where GEMMs of the same shapes without GELU run at 720-760. Is the cost
the epilogue's arithmetic, or the extra ``[N, 4C]`` it moves while the tensor cores wait? This times, at GPT-2's
shapes (N = B·1024 tokens, C = 768, bf16), the fc GEMM with the plain BIAS epilogue, with GELU_BIAS (GELU, no
pre-activation kept: one ``[N, 4C]`` written, like BIAS) and with GELU_AUX_BIAS (two written), and the projection's
dgrad plain and with DGELU (one ``[N, 4C]`` read more). If GELU_BIAS runs near BIAS, the arithmetic is free and the
time is the aux traffic an epilogue that overlaps the next tile's main loop would hide; then it times
``FastGPT``'s inference forward (``forward``: no backward, so no ``f``; GELU_BIAS) against the same forward keeping
``f`` as the training forward does.

Prediction written before the first run: GELU_BIAS between the two, ~0.51 ms at B = 64 against 0.42 (BIAS) and
0.61 (GELU_AUX_BIAS), i.e. the cost is the bytes, not the tanh; the inference forward ~1.2 ms faster at B = 64
(12 layers x 0.1 ms of a ~35 ms forward).

Measured on the H200 (2026-12-03, ``benchmarks/results/ch8/gelu_epilogue_probe.json``), B = 64: BIAS 0.440 ms, GELU_BIAS
0.503, GELU_AUX_BIAS 0.567; the dgrad 0.438 plain, 0.567 with DGELU. Half of the epilogue's cost is the GELU
itself (no more bytes than BIAS), half the pre-activation's bytes; both are epilogue time the main loop does not
hide. The inference trunk forward: 26.01 -> 25.21 ms at B = 64 (-0.8 ms), 6.73 -> 6.47 ms at B = 16, the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from llmgpu import backend
from llmgpu.gemm.cublaslt import lt_flops, lt_gemm
from llmgpu.model import FastGPT, GPTConfig
from llmgpu.perf import timing


def _gemms(xp, n, reps):
    """ms per call of the fc forward and the projection's dgrad with each epilogue, at n tokens."""
    c = 768
    xp.random.seed(0)
    h = (xp.random.standard_normal((n, c), dtype=np.float32)).astype(backend.bfloat16)
    w = (xp.random.standard_normal((4 * c, c), dtype=np.float32) * c**-0.5).astype(backend.bfloat16)
    b = xp.zeros(4 * c, backend.bfloat16)
    out, f = xp.empty((n, 4 * c), backend.bfloat16), xp.empty((n, 4 * c), backend.bfloat16)
    dm = (xp.random.standard_normal((n, c), dtype=np.float32)).astype(backend.bfloat16)
    w2 = (xp.random.standard_normal((c, 4 * c), dtype=np.float32) * c**-0.5).astype(backend.bfloat16)
    lt_gemm(h, w, trans_b=True, out=f, bias=b, epilogue="bias")  # a real pre-activation for DGELU to read
    cases = [
        ("fc fwd, BIAS", lambda: lt_gemm(h, w, trans_b=True, out=out, bias=b, epilogue="bias"), 1),
        ("fc fwd, GELU_BIAS (no aux)", lambda: lt_gemm(h, w, trans_b=True, out=out, bias=b, epilogue="gelu_bias"), 1),
        ("fc fwd, GELU_AUX_BIAS", lambda: lt_gemm(h, w, trans_b=True, out=out, bias=b, epilogue="gelu_bias", aux=f), 2),
        ("proj dgrad, DEFAULT", lambda: lt_gemm(dm, w2, out=out), 1),
        ("proj dgrad, DGELU", lambda: lt_gemm(dm, w2, out=out, epilogue="dgelu", aux=f), 2),
    ]
    flops = lt_flops(n, 4 * c, c)
    rows = []
    for label, fn, big in cases:
        ms = timing.time_fn(fn, xp=xp, warmup=5, reps=reps).median_ms
        rows.append({"gemm": label, "tokens": n, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                     "nk4_arrays_moved": big + 1})  # [N, 4C] arrays read or written besides the small input
        print(f"  N={n:<6} {label:<28} {ms:7.4f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
    return rows


def _inference(xp, batch, seq, reps):
    """ms of FastGPT's trunk forward without storing, with and without the pre-activation, alternated."""
    cfg = GPTConfig.preset("gpt2", pad_vocab_to=64)
    m = FastGPT(cfg, dtype="bf16", xp=xp, seed=0)
    idx = xp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32))
    outs = {keep: m._forward_trunk(idx, store=False, keep_pre=keep)[0][1] for keep in (True, False)}  # warm-up
    diff = float(xp.abs(outs[True].astype(np.float32) - outs[False].astype(np.float32)).max())
    del outs
    ms = {True: [], False: []}
    for _ in range(5):
        for keep in (True, False):
            ms[keep].append(timing.time_fn(lambda k=keep: m._forward_trunk(idx, store=False, keep_pre=k),
                                           xp=xp, warmup=1, reps=reps, host_ahead=False).median_ms)
    row = {"batch": batch, "seq": seq, "ms_keep_pre": statistics.median(ms[True]),
           "ms_no_pre": statistics.median(ms[False]), "rounds_keep_pre": ms[True], "rounds_no_pre": ms[False],
           "max_abs_diff_ln_f_output": diff}
    print(f"  inference trunk forward, B={batch}: keeping f {row['ms_keep_pre']:.2f} ms, GELU_BIAS "
          f"{row['ms_no_pre']:.2f} ms ({row['ms_keep_pre'] - row['ms_no_pre']:+.2f} ms saved); "
          f"ln_f outputs differ by at most {diff:.3g}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64", help="batches of 1024 tokens (default 16,64)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    reason = backend.gpu_unavailable_reason()
    if reason is not None:
        print(f"no GPU: {reason}; nothing timed")
        return 0
    xp = backend.require_gpu()
    print(backend.device_info(xp).summary(), flush=True)
    batches = [int(s) for s in a.batches.split(",") if s.strip()]
    payload = {"probe": "gelu_epilogue", "gemms": [], "inference": []}
    for b in batches:
        payload["gemms"] += _gemms(xp, b * 1024, a.reps)
    for b in batches:
        payload["inference"].append(_inference(xp, b, 1024, max(3, a.reps // 6)))
    if a.json:
        timing.save_results(a.json, payload, xp=xp)
        print("wrote", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
