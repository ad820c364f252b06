"""Introduction benchmark: vector add vs the copy ceiling, and naive → tiled → blocked GEMM vs cuBLAS.

    python benchmarks/bench_intro.py            # on a GPU: writes benchmarks/results/ch0/intro.json
    python benchmarks/bench_intro.py --out x.json

On a machine without a GPU it runs the NumPy path at small sizes and writes nothing unless --out
is given (CPU numbers do not belong next to the GPU results).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common
import numpy as np

import llmgpu
from llmgpu.ops import vector_add
from llmgpu.ops.matmul import METHODS
from llmgpu.perf import timing
from llmgpu.perf.sweeps import matmul_sweep

RESULTS = _common.RESULTS_DIR / "ch0" / "intro.json"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where to write the JSON results")
    args = ap.parse_args(argv)
    xp = llmgpu.default_xp()
    gpu = xp is not np
    print(llmgpu.device_info(xp).summary())

    copy_gbps = timing.copy_bandwidth(2**31 if gpu else 2**26, xp=xp)
    n = (1 << 28) if gpu else (1 << 22)
    a, b = xp.ones(n, np.float32), xp.full(n, 2.0, np.float32)
    out = xp.empty_like(a)
    t = timing.time_fn(lambda: vector_add(a, b, out=out), xp=xp)
    vadd = dict(n=n, ms=t.median_ms, gbps=t.gbps(3 * 4 * n))
    print(f"copy ceiling {copy_gbps:,.0f} GB/s; vector add fp32 n={n}: {vadd['gbps']:,.0f} GB/s "
          f"({100 * vadd['gbps'] / copy_gbps:.0f}% of copy)")

    shapes = [(s, s, s) for s in ((512, 1024, 2048, 4096) if gpu else (128, 256))]
    shapes += [(4000, 3000, 2000)] if gpu else [(100, 130, 70)]
    rows = matmul_sweep(shapes, METHODS if gpu else (), xp=xp)
    print(f"{'method':<14}{'M x N x K':>20}{'ms':>10}{'TFLOP/s':>10}")
    for r in rows:
        print(f"{r['method']:<14}{r['m']:>8}x{r['n']}x{r['k']:<6}{r['ms']:>10.3f}{r['tflops']:>10.2f}")
    _common.save(args.out or (RESULTS if gpu else None), dict(copy_gbps=copy_gbps, vector_add=vadd, gemm=rows), xp)


if __name__ == "__main__":
    main()
