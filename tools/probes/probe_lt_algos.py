"""Probe: does a measured cuBLASLt algorithm beat the heuristic's first choice on the fast step's GEMMs?

    python tools/probes/probe_lt_algos.py [--preset gpt2] [--batch 16] [--seq 1024] [--candidates 16] [--json out.json]

Runs a preset's fast training step (GPT-2 small by default; bf16, vocabulary padded to a multiple of 64) once,
records the operands of each distinct GEMM and how often a step calls it, asks each of those cuBLASLt plans for
the heuristic's first ``--candidates`` algorithms (``_Plan.ask_heuristic``), then times every candidate on those
operands (medians of CUDA-event
timings) and reports, per GEMM, the heuristic's pick against the fastest candidate, the step time those savings
predict, and the step time measured with the fastest candidates switched in (with ``--min-speedup S``, only
those at least S times faster alone). Issue 19 names "heuristics vs a measured pick per shape" as a candidate
for the step's lost time; this measures how much it is worth before anything in the package depends on it. The
timings write into the step's own buffers (the step is discarded).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter

from llmgpu import backend
from llmgpu.bench import make_train_step
from llmgpu.gemm import cublaslt
from llmgpu.model import GPTConfig
from llmgpu.perf import timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2", help="model size (default gpt2; d24, d36, d48, ...)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--min-speedup", type=float, default=1.0,
                    help="switch a GEMM to its fastest candidate only when that is at least this much faster alone "
                         "(default 1.0: every GEMM)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    xp = backend.require_gpu()
    print(backend.device_info(xp).summary(), flush=True)
    cublaslt.clear_plans()

    first_args, calls = {}, Counter()  # plan -> operands of its first call; plan -> calls per step
    launch = cublaslt._lt_cupy

    def recording(*args):
        before = set(map(id, cublaslt._PLANS.values()))
        out = launch(*args)
        new = [p for p in cublaslt._PLANS.values() if id(p) not in before]
        for p in new:
            first_args[p] = args
        return out

    cublaslt._lt_cupy = recording
    cfg = GPTConfig.preset(a.preset, pad_vocab_to=64)
    step, model = make_train_step(cfg, a.batch, a.seq, dtype="bf16", xp=xp, fast=True)
    step()
    # one more step, counting launches per plan (a launch finds its plan by the plan key's ingredients)
    by_shape = {_signature(args): p for p, args in first_args.items()}

    def counting_by_shape(*args):
        calls[by_shape.get(_signature(args))] += 1
        return launch(*args)

    cublaslt._lt_cupy = counting_by_shape
    step()
    cublaslt._lt_cupy = launch
    xp.cuda.Device().synchronize()
    base_ms = timing.time_fn(step, xp=xp, warmup=2, reps=10, host_ahead=False).median_ms
    print(f"step with the heuristic's first choices: {base_ms:.2f} ms ({len(first_args)} GEMM plans)", flush=True)

    rows, saved_ms = [], 0.0
    for p, args in first_args.items():
        p.ask_heuristic(a.candidates)  # still runs the first (the heuristic's pick) until use(i) switches
        times = []
        for i in range(p.n_algos):
            try:
                p.use(i)
            except IndexError:
                times.append(float("inf"))
                continue
            times.append(timing.time_fn(lambda args=args: launch(*args), xp=xp, warmup=2, reps=a.reps).median_ms)
        best = min(range(len(times)), key=times.__getitem__)
        switched = times[0] >= a.min_speedup * times[best]
        p.use(best if switched else 0)
        n = calls[p]
        if switched:
            saved_ms += n * (times[0] - times[best])
        m, n_, k, batch = args[12:16]
        tflops = cublaslt.lt_flops(m, n_, k, math.prod(batch)) / 1e9 / times[0]
        rows.append({"gemm": p.describe, "calls_per_step": n, "candidates": p.n_algos, "heuristic_ms": times[0],
                     "heuristic_tflops": tflops, "best_ms": times[best], "best_index": best,
                     "speedup": times[0] / times[best], "switched": switched})
        print(f"{n:3d} x {p.describe[:95]:<95} heuristic {times[0]:.4f} ms ({tflops:.0f} TFLOP/s), best #{best} "
              f"{times[best]:.4f} ms ({times[0] / times[best]:.3f}x)", flush=True)
    if calls[None]:
        print(f"note: {calls[None]} launches per step matched no recorded plan (not counted)", flush=True)
    tuned_ms = timing.time_fn(step, xp=xp, warmup=2, reps=10, host_ahead=False).median_ms
    print(f"predicted step {base_ms - saved_ms:.2f} ms from the per-GEMM savings ({saved_ms:.2f} ms); "
          f"measured with those switched: {tuned_ms:.2f} ms ({base_ms / tuned_ms:.3f}x)", flush=True)
    out = {"probe": "lt_algos", "preset": a.preset, "batch": a.batch, "seq": a.seq, "candidates": a.candidates,
           "min_speedup": a.min_speedup,
           "device": backend.device_info(xp).summary(), "date": timing_date(),
           "step_ms_heuristic": base_ms, "step_ms_tuned": tuned_ms, "predicted_saving_ms": saved_ms, "gemms": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    del model
    return 0


def _signature(args) -> tuple:
    """The plan key of one ``_lt_cupy`` call (its arguments as recorded)."""
    cp, a, b, trans_a, trans_b, out, bias, epilogue, _aux, dbias, _alpha, _beta, m, n, k, batch = args
    return cublaslt.plan_key(cp.cuda.Device().id, a, b, trans_a, trans_b, out, bias, epilogue, dbias, m, n, k, batch)


def timing_date() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


if __name__ == "__main__":
    sys.exit(main())
