"""Check and time the experimental LayerNorm forward (layernorm_forward_fast.cu) against the package's.

    python dev/cuda/layernorm_forward_fast.py                       # [65536, 768] (GPT-2 rows), fp32 and bf16
    python dev/cuda/layernorm_forward_fast.py --rows 4096 --channels 1024 --dtype fp16 --reps 50

The .cu file beside this script is compiled with CuPy (``cupy.RawModule``, the package's flags and
its ``llmgpu/kernels`` directory on the include path for ``common.cuh``) and launched as the package
launched it while it was the "fast" forward: 8 warps per block, a grid of at most the resident blocks
in which every warp takes the same number of rows. On fresh random inputs, with the output buffer
poisoned (NaN) first, y, mean and rstd are checked against the float64 reference of
``llmgpu.ops.layernorm.layernorm_forward``; then this kernel and the package's ``layernorm_forward``
are timed with ``llmgpu.perf.timing.time_fn`` and compared with the device-to-device copy.
Without a GPU the script says so and exits 0 (tests/test_dev_cuda.py compiles the kernel anyway).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
import _devscript  # noqa: E402  (first: puts the package on the path)

from llmgpu import backend  # noqa: E402
from llmgpu.kernels import loader  # noqa: E402
from llmgpu.ops import layernorm as ln  # noqa: E402
from llmgpu.perf.timing import copy_bandwidth, time_fn  # noqa: E402
from llmgpu.testing import poisoned, random_array, rel_error  # noqa: E402

SOURCE = HERE / "layernorm_forward_fast.cu"
KERNEL = "layernorm_forward_fast"
# Relative error allowed against float64 (‖out − ref‖ / ‖ref‖): y by storage dtype, statistics in fp32.
Y_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 5e-3}
STATS_TOLERANCE = 1e-5
PACKS = {2: (1, 2, 3, 4), 4: (1, 2, 3, 4, 6)}  # packs per lane instantiated in the .cu, by element size
WARPS = 8  # the kernel's __launch_bounds__(256)


def build(cp):
    """The compiled module and the expressions the .cu file declares."""
    text = SOURCE.read_text()
    exprs = loader.expressions_in(text)
    module = cp.RawModule(code=text, options=loader.compile_options(), name_expressions=exprs)
    return module, exprs


def packs_for(c, dtype):
    """Packs per lane for rows of c elements, or None when the kernel does not take such rows."""
    size = np.dtype(dtype).itemsize
    width = 16 // size
    if c % width:
        return None
    per_lane = -(-(c // width) // 32)
    return next((p for p in PACKS[size] if p >= per_lane), None)


def grid(kern, n_rows, sm_count):
    """Blocks of WARPS warps: at most one wave of resident blocks, every warp the same number of rows."""
    regs = int(kern.attributes["num_regs"])
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256  # registers are allocated per warp, in 256s
    per_sm = max(1, min(65536 // (regs_per_warp * WARPS), 2048 // (32 * WARPS), 32))
    rows_per_warp = -(-n_rows // (sm_count * per_sm * WARPS))
    return -(-n_rows // (WARPS * rows_per_warp))


def run_case(cp, module, exprs, name, n, c, eps, rng, reps, copy_gbps):
    dtype = backend.resolve_dtype(name)
    packs = packs_for(c, dtype)
    if packs is None:
        print(f"{name} [{n}, {c}]: {KERNEL} does not take rows of {c} elements (C % {16 // dtype.itemsize} != 0 "
              f"or longer than {32 * 16 // dtype.itemsize * max(PACKS[dtype.itemsize])})")
        return False
    expr = f"{KERNEL}<{loader.template_args(dtype, packs)}>"
    assert expr in exprs, f"{SOURCE.name} does not declare {expr}"
    kern = module.get_function(expr)
    blocks = grid(kern, n, backend.device_info(cp).sm_count or 1)
    if n + blocks * WARPS >= 2**31:  # the kernel's row indices are 32-bit
        print(f"{name} [{n}, {c}]: too many rows for {KERNEL}'s 32-bit row indices")
        return False

    x, gamma, beta = random_array(rng, (n, c), dtype), random_array(rng, c, dtype), random_array(rng, c, dtype)
    f64 = [a.astype(np.float64) for a in (x, gamma, beta)]
    ref_y, ref_mean, ref_rstd = ln.layernorm_forward(*f64, eps)  # NumPy arrays: the float64 reference
    xd, gd, bd = (cp.asarray(a) for a in (x, gamma, beta))
    y = poisoned((n, c), dtype, cp)
    mean, rstd = poisoned((n,), np.float32, cp), poisoned((n,), np.float32, cp)
    args = (xd, gd, bd, y, mean, rstd, np.int32(n), np.int32(c), np.float32(eps))

    def launch():
        kern((blocks,), (32 * WARPS,), args)

    launch()
    y_pkg = poisoned((n, c), dtype, cp)
    _, mean_pkg, rstd_pkg = ln.layernorm_forward(xd, gd, bd, eps, out=y_pkg)

    ok = True
    nbytes = ln.traffic_bytes(n, c, dtype)
    for label, outs, fn in ((expr, (y, mean, rstd), launch),
                            ("package layernorm_forward", (y_pkg, mean_pkg, rstd_pkg),
                             lambda: ln.layernorm_forward(xd, gd, bd, eps, out=y_pkg))):
        errs = [rel_error(o, r) for o, r in zip(outs, (ref_y, ref_mean, ref_rstd))]
        good = errs[0] <= Y_TOLERANCE[name] and errs[1] <= STATS_TOLERANCE and errs[2] <= STATS_TOLERANCE
        ok &= good
        t = time_fn(fn, xp=cp, reps=reps)
        gbps = t.gbps(nbytes)
        ceiling = f" ({100 * gbps / copy_gbps:.0f} % of copy)" if copy_gbps else ""
        print(f"{name} [{n}, {c}]  {label:<44} rel. error y {errs[0]:.1e} mean {errs[1]:.1e} rstd {errs[2]:.1e} "
              f"{'ok  ' if good else 'FAIL'}  {1e3 * t.median_ms:8.1f} us {gbps:7.0f} GB/s{ceiling}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=65536, help="N, rows (default: 65536)")
    ap.add_argument("--channels", type=int, default=768, help="C, elements per row (default: 768)")
    ap.add_argument("--dtype", action="append", choices=sorted(Y_TOLERANCE), help="repeatable; default fp32, bf16")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--reps", type=int, default=20, help="timed calls per kernel (median reported)")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh inputs every run)")
    ap.add_argument("--no-copy", action="store_true", help="skip measuring the copy ceiling")
    args = ap.parse_args(argv)

    cp = _devscript.cupy_or_say_why(f" ({SOURCE.name}: nothing checked or timed)")
    if cp is None:
        return 0
    module, exprs = build(cp)
    print(f"{backend.device_info(cp).summary()}")
    copy_gbps = None if args.no_copy else copy_bandwidth(xp=cp)
    if copy_gbps:
        print(f"device-to-device copy: {copy_gbps:.0f} GB/s (bytes read + written)")
    rng = np.random.default_rng(args.seed)
    ok = True
    for name in args.dtype or ["fp32", "bf16"]:
        ok &= run_case(cp, module, exprs, name, args.rows, args.channels, args.eps, rng, args.reps, copy_gbps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
