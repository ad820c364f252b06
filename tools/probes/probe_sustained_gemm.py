"""Probe: a GEMM's rate in a burst and sustained for seconds, with the GPU's clock and power (chapter 8, the power cap).

    python tools/probes/probe_sustained_gemm.py [--seconds 4] [--group 20] [--json out.json]

Every MFU in this project divides by a GEMM ceiling measured in a burst (``timing.gemm_ceiling``: ten 8192³
products after two warm-ups), and a training step is not a burst: it keeps the GPU busy for minutes, at the clock
the power limit allows. For each product below, after two seconds of idle: the product back to back for
``--seconds``, timed in groups of ``--group`` calls (CUDA events, the median call of each group), while
``perf.clocks.ClockMonitor`` reads the SM clock and the power every 50 ms. The first group is the burst; the
groups of the last second are the sustained rate.

* cuBLAS bf16 8192³ on random data (the ceiling of every MFU here);
* GPT-2's fc GEMM at B = 64, [65536, 768] · [768, 3072] bf16, through cuBLASLt with its bias epilogue, as the step
  runs it.

Prediction written before the first run (H200, 700 W): bursts at 1980 MHz, 785-800 TFLOP/s for 8192³ and
710-730 for the fc GEMM; sustained at 1550-1700 MHz under the cap, 12-18 % slower.

Without a GPU: one line saying so, exit 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmgpu import backend
from llmgpu.perf import clocks, timing


def sustained(fn, xp, seconds: float, group: int, flops: float, clock=time.time) -> list[dict]:
    """Call ``fn`` back to back for ``seconds``, timed in groups of ``group`` calls: per group its wall-clock start
    and end ``t0``, ``t`` (``clock``), the median ms per call and the TFLOP/s."""
    rows = []
    stop = clock() + seconds
    while not rows or clock() < stop:
        t0 = clock()
        t = timing.time_fn(fn, xp=xp, warmup=0, reps=group)
        rows.append({"t0": t0, "t": clock(), "ms": t.median_ms, "tflops": t.tflops(flops)})
    return rows


def summarize(rows: list[dict], monitor, window_s: float = 1.0) -> dict:
    """Burst (the first group) and sustained (the groups that end in the last ``window_s``) rates, with the clock
    readings over the first 0.2 s and over that last window (None where the monitor has none)."""
    start, end = rows[0]["t0"], rows[-1]["t"]
    late = [r for r in rows if r["t"] >= end - window_s]
    return {"burst_tflops": rows[0]["tflops"], "sustained_tflops": statistics.median(r["tflops"] for r in late),
            "groups": len(rows), "sustained_groups": len(late),
            "burst_clocks": monitor.summary(start, start + 0.2) if monitor else None,
            "sustained_clocks": monitor.summary(end - window_s, end) if monitor else None}


def products(xp, batch: int = 64):
    """(label, fn, flops) of the two products, their operands made on the device."""
    from llmgpu.gemm.cublaslt import lt_gemm

    gen = xp.random.RandomState(0)
    bf16 = backend.bfloat16
    a, b = (gen.standard_normal((8192, 8192), dtype=np.float32).astype(bf16) for _ in range(2))
    n, c = batch * 1024, 768
    h = gen.standard_normal((n, c), dtype=np.float32).astype(bf16)
    w = (gen.standard_normal((4 * c, c), dtype=np.float32) * c**-0.5).astype(bf16)
    bias = xp.zeros(4 * c, bf16)
    out = xp.empty((n, 4 * c), bf16)
    return [("cuBLAS bf16 8192³", lambda: a @ b, 2.0 * 8192**3),
            (f"fc GEMM B={batch} (cuBLASLt, bias)",
             lambda: lt_gemm(h, w, trans_b=True, out=out, bias=bias, epilogue="bias"), 2.0 * n * c * 4 * c)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--group", type=int, default=20)
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle before each product")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    why = backend.gpu_unavailable_reason()
    if why:
        print(f"no GPU ({why}): nothing to probe")
        return 0
    cp = backend.require_gpu()
    info = backend.device_info(cp)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": info.summary(),
              "seconds": args.seconds, "group": args.group, "products": []}
    origin = time.time()  # every t in the file is seconds from here
    clk = (lambda c: f" at {c['sm_mhz']:.0f} MHz, {c['power_w']:.0f} W" if c else "")
    with clocks.ClockMonitor(device=info.pci_bus_id or 0, interval_ms=50) as mon:
        if not mon.available:
            print(f"(no clock readings: {mon.reason})")
        for label, fn, flops in products(cp):
            fn()  # plan, workspace
            cp.cuda.Device().synchronize()
            time.sleep(args.idle)
            rows = sustained(fn, cp, args.seconds, args.group, flops)
            s = summarize(rows, mon if mon.available else None)
            series = [{**r, "t0": r["t0"] - origin, "t": r["t"] - origin} for r in rows]
            result["products"].append({"product": label, **s, "series": series})
            print(f"{label:<34} burst {s['burst_tflops']:6.1f} TFLOP/s{clk(s['burst_clocks'])}; sustained "
                  f"{s['sustained_tflops']:6.1f}{clk(s['sustained_clocks'])} "
                  f"({s['sustained_tflops'] / s['burst_tflops']:.3f}x)", flush=True)
    result["clock_trace"] = mon.trace(t_origin=origin)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
