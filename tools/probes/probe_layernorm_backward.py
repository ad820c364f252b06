"""Where the "fast" LayerNorm backward's time goes, next to a copy of the same bytes (GPU only).

    python tools/probes/probe_layernorm_backward.py [--json benchmarks/results/ch3/probe_layernorm_backward.json]

At [65536, 768] (GPT-2's B=64, T=1024), bf16 and fp32, against the copy ceiling of the same run:
* the per-call floor of the timing (a one-element kernel between two events);
* a device copy moving the same number of bytes (what "100 %" costs at this size, not at 2 GiB);
* the whole backward, its main kernel alone and the main kernel + second stage launched directly;
* the main kernel on grids of r rows per warp (one wave of resident warps is what the launcher picks);
* the whole backward at 2x and 4x the rows: slope = streaming speed, intercept = fixed cost per call.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from llmgpu import backend
from llmgpu.kernels import get_kernel
from llmgpu.ops import layernorm as ln
from llmgpu.perf import timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    xp = backend.default_xp()
    if xp is np:
        print("probe_layernorm_backward: needs a GPU (CuPy)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    ceiling = timing.copy_bandwidth(xp=xp)
    rows = []

    def us(fn):
        return timing.time_fn(fn, xp=xp, reps=args.reps, warmup=5).median_ms * 1e3

    def record(what, t, nbytes, **extra):
        pct = 100 * nbytes / (t * 1e-6) / 1e9 / ceiling
        rows.append(dict(what=what, us=t, bytes=nbytes, pct_of_copy=pct, **extra))
        print(f"{what:52s} {t:8.1f} us  {pct:5.1f} % of the copy  {extra or ''}")

    print(f"{backend.device_info(xp).summary()}; copy ceiling {ceiling:.0f} GB/s (2 GiB copy)")
    one = xp.zeros(1, np.float32)
    record("floor: one-element kernel", us(lambda: one.__iadd__(1)), 0)
    c = 768
    for dt in (backend.bfloat16, np.float32):
        name = "bf16" if dt is backend.bfloat16 else "fp32"
        n = 65536
        nbytes = ln.traffic_bytes(n, c, dt, backward=True)
        src = xp.empty(nbytes // 2 // 4, np.float32)
        dst = xp.empty_like(src)
        record(f"{name}: device copy of the same bytes", us(lambda: xp.copyto(dst, src)), 2 * src.nbytes)
        for scale in (1, 2, 4):
            m = n * scale
            x = backend.to_device(rng.standard_normal((m, c), dtype=np.float32).astype(dt), xp)
            dy = backend.to_device(rng.standard_normal((m, c), dtype=np.float32).astype(dt), xp)
            g = backend.to_device(rng.standard_normal(c, dtype=np.float32).astype(dt), xp)
            _, mean, rstd = ln.layernorm_forward(x, g, g)
            dx, dg, db = xp.empty_like(x), xp.zeros(c, np.float32), xp.zeros(c, np.float32)
            mbytes = ln.traffic_bytes(m, c, dt, backward=True)

            def full():
                ln.layernorm_backward(dy, x, g, mean, rstd, method="fast", dx_out=dx, dgamma_out=dg, dbeta_out=db)

            record(f"{name} {m}x{c}: layernorm_backward(method='fast')", us(full), mbytes)
            if scale != 1:
                continue
            # the launcher's own plan, then its two kernels launched by hand
            kern, blocks, threads, smem = ln.backward_fast_plan(m, c, dt, xp=xp)
            partial = xp.empty((blocks, 2, c), np.float32)
            fin = get_kernel("layernorm", "layernorm_param_grad_finish", np.float32, 0)

            def main_kernel(nb=blocks, part=partial):
                kern((nb,), (threads,), (dy, x, g, mean, rstd, dy, dx, part, np.int32(m), np.int32(c)),
                     shared_mem=smem)

            def finish():
                fin((-(-2 * c // 32),), (32, 32), (partial, np.int32(blocks), np.int32(c), dg, db))

            info = dict(blocks=blocks, threads=threads, regs=int(kern.attributes["num_regs"]))
            record(f"{name}: main kernel alone", us(main_kernel), mbytes, **info)
            record(f"{name}: second stage alone", us(finish), partial.nbytes)
            record(f"{name}: main kernel + second stage", us(lambda: (main_kernel(), finish())), mbytes)
            wpb = threads // 32
            for r in (4, 8, 16, 24, 32):
                nb = -(-m // (wpb * r))
                part = xp.empty((nb, 2, c), np.float32)
                record(f"{name}: main kernel, {r} rows per warp", us(lambda: main_kernel(nb, part)), mbytes, blocks=nb)
    fixed = {}
    for name in ("bf16", "fp32"):
        t = {r["bytes"]: r["us"] for r in rows
             if r["what"].startswith(f"{name} ") and r["what"].endswith("layernorm_backward(method='fast')")}
        (b1, t1), (b4, t4) = min(t.items()), max(t.items())
        slope = (t4 - t1) / (b4 - b1)  # us per byte
        fixed[name] = dict(fixed_us=t1 - slope * b1, streaming_pct_of_copy=100 / (slope * 1e-6) / 1e9 / ceiling)
        print(f"{name}: fixed cost per call {fixed[name]['fixed_us']:.1f} us, streaming at "
              f"{fixed[name]['streaming_pct_of_copy']:.1f} % of the copy (fit over 1x and 4x the rows)")
    if args.json:
        timing.save_results(args.json, {"benchmark": "probe_layernorm_backward", "copy_ceiling_gbps": ceiling,
                                        "fit": fixed, "results": rows}, xp=xp)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
