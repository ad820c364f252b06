"""Check and time the wider FP8 amax and cast + transpose (fp8_cast_wide.cu) against the package's (kernels/fp8.cu).

    python dev/cuda/fp8_cast_wide.py                              # d48, d36 and GPT-2 activation shapes, bf16
    python dev/cuda/fp8_cast_wide.py --shapes 8192x1600 --dtype fp32 --reps 50 --json out.json

Per shape, on fresh random inputs with NaN, ±inf and a huge value sprinkled in, and into outputs poisoned twice
(two different byte values: an unwritten byte cannot match the reference both times), the experiment's amax, y and
yᵀ are checked bit for bit against ``llmgpu.ops.fp8``'s NumPy references; then five things are timed
(``llmgpu.perf.timing.time_fn``) and set against the device-to-device copy measured in the same run: the package's
amax pass and this one, the package's transposing cast and this one, and current scaling's pair (amax, then the
cast) done the package's way and this way. Without a GPU the script says so and exits 0. Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
import _devscript  # noqa: E402  (first: puts the package on the path)

from llmgpu import backend  # noqa: E402
from llmgpu.kernels import loader  # noqa: E402
from llmgpu.kernels.launch import resident_grid  # noqa: E402
from llmgpu.ops import fp8  # noqa: E402
from llmgpu.perf.timing import copy_bandwidth, time_fn  # noqa: E402

SOURCE = HERE / "fp8_cast_wide.cu"
THREADS, TILE = fp8.THREADS, fp8.TILE  # the .cu file uses fp8.cu's FP8_THREADS and FP8_TILE
VEC = 8  # its WIDE_VEC
# activations and gradients the FP8 step casts: d48 (B=8: M = 8192 tokens, C = 1600), d36 (B=16), GPT-2 (B=32)
DEFAULT_SHAPES = "8192x1600,8192x4800,8192x6400,16384x1280,16384x5120,32768x768,32768x2304,32768x3072"


def build(cp):
    text = SOURCE.read_text()
    exprs = loader.expressions_in(text)
    return cp.RawModule(code=text, options=loader.compile_options(), name_expressions=exprs), exprs


def inputs(rng, R, C, dtype):
    x = rng.standard_normal((R, C)).astype(np.float32)
    flat = x.reshape(-1)
    for v in (np.nan, np.inf, -np.inf, 3e4):
        flat[rng.integers(0, flat.size)] = v
    return x.astype(backend.resolve_dtype(dtype))


def run_shape(cp, module, name, R, C, fmt, rng, reps, copy_gbps):
    dtype = backend.resolve_dtype(name)
    if R % VEC or C % VEC:
        print(f"{name} [{R}, {C}]: the experiment takes R and C multiples of {VEC}")
        return False, None
    targs = loader.template_args(dtype)
    amax_k = module.get_function(f"fp8_amax_wide<{targs}>")
    cast_k = module.get_function(f"fp8_cast_transpose_wide<{targs}, {fmt.c_name}>")
    host = inputs(rng, R, C, name)
    x = cp.asarray(host)
    n = x.size
    scale = cp.asarray(np.array([fmt.max / 4.0], np.float32))
    amax = cp.zeros(1, np.float32)
    amax_grid = resident_grid(amax_k, -(-n // (16 // dtype.itemsize)), THREADS, cp)

    def wide_amax():
        amax.fill(0)
        amax_k((amax_grid,), (THREADS,), (x, np.int64(n), amax))

    y, yt = cp.empty((R, C), np.uint8), cp.empty((C, R), np.uint8)

    def wide_cast(with_amax=True):
        if with_amax:
            amax.fill(0)
        cast_k((-(-R // TILE), -(-C // TILE)), (THREADS,), (x, y, yt, np.int64(R), np.int64(C), scale, amax))

    ref_q = fp8.quantize_reference(host, float(scale[0].get()), fmt)
    ref_amax = np.array([fp8.amax_reference(host)], np.float32).view(np.uint32)[0]
    ok = True
    for poison in (0xAB, 0x54):
        y.fill(poison)
        yt.fill(poison)
        amax.fill(np.nan)
        wide_cast()
        got_cast_amax = cp.asnumpy(amax).view(np.uint32)[0]
        wide_amax()
        got_amax = cp.asnumpy(amax).view(np.uint32)[0]
        ok &= bool(np.array_equal(cp.asnumpy(y), ref_q) and np.array_equal(cp.asnumpy(yt), ref_q.T)
                   and got_amax == ref_amax == got_cast_amax)

    # the package's current-scaling pair: fp8_amax, then the transposing cast (no amax of its own)
    py, pyt, psi, pam = cp.empty((R, C), np.uint8), cp.empty((C, R), np.uint8), cp.empty(1, np.float32), cp.zeros(
        1, np.float32)

    def pkg_amax():
        fp8.fp8_amax(x, pam)

    def pkg_cast():
        fp8.fp8_cast(x, scale, fmt.name, transpose=True, out=py, out_t=pyt, scale_inv=psi)

    nbytes = x.nbytes
    timed = {"package amax": (pkg_amax, nbytes), "wide amax": (wide_amax, nbytes),
             "package cast+T": (pkg_cast, 2 * nbytes), "wide cast+T": (lambda: wide_cast(False), 2 * nbytes),
             "package pair": (lambda: (pkg_amax(), pkg_cast()), 3 * nbytes),
             "wide pair": (lambda: (wide_amax(), wide_cast(False)), 3 * nbytes)}
    row = {"dtype": name, "shape": [R, C], "fmt": fmt.name, "ok": ok}
    print(f"{name} [{R}, {C}] {fmt.name}: bytes and amax {'ok' if ok else 'FAIL'}")
    for label, (fn, b) in timed.items():
        t = time_fn(fn, xp=cp, reps=reps)
        gbps = t.gbps(b)
        row[label] = {"us": 1e3 * t.median_ms, "gbps": gbps,
                      "pct_of_copy": 100 * gbps / copy_gbps if copy_gbps else None}
        share = f" ({100 * gbps / copy_gbps:.0f} % of copy)" if copy_gbps else ""
        print(f"    {label:<16} {1e3 * t.median_ms:9.1f} us {gbps:7.0f} GB/s{share}")
    row["pair_speedup"] = row["package pair"]["us"] / row["wide pair"]["us"]
    print(f"    pair: package / wide = {row['pair_speedup']:.3f}")
    return ok, row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"RxC, comma-separated (default {DEFAULT_SHAPES})")
    ap.add_argument("--dtype", action="append", choices=["fp32", "bf16"], help="repeatable; default bf16")
    ap.add_argument("--fmt", choices=sorted(fp8.FP8_FORMATS), default="e4m3")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per kernel (median reported)")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh inputs every run)")
    ap.add_argument("--no-copy", action="store_true", help="skip measuring the copy ceiling")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]

    cp = _devscript.cupy_or_say_why(f" ({SOURCE.name}: nothing checked or timed)")
    if cp is None:
        return 0
    module, _ = build(cp)
    info = backend.device_info(cp)
    print(info.summary())
    copy_gbps = None if args.no_copy else copy_bandwidth(xp=cp)
    if copy_gbps:
        print(f"device-to-device copy: {copy_gbps:.0f} GB/s (bytes read + written)")
    rng = np.random.default_rng(args.seed)
    fmt = fp8.fp8_format(args.fmt)
    ok, rows = True, []
    for name in args.dtype or ["bf16"]:
        for R, C in shapes:
            good, row = run_shape(cp, module, name, R, C, fmt, rng, args.reps, copy_gbps)
            ok &= good
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": info.name, "copy_gbps": copy_gbps, "rows": rows},
                                              indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
