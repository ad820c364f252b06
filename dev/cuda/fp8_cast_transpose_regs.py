"""Check and time the register-transposing FP8 cast at each launch bound (fp8_cast_transpose_regs.cu) against the
package's shared-tile one.

    python dev/cuda/fp8_cast_transpose_regs.py                   # the d36 and d48 step casts, bf16
    python dev/cuda/fp8_cast_transpose_regs.py --cases dy:16384x1280 --reps 50 --json out.json

The cases are the three transposing casts of the FP8 step under delayed scaling (one pass each): ``dy`` (a layer's
output gradient, E5M2, with its bias gradient's column sums), ``dgelu`` (MLP-in's output gradient dg · GELU'(f + b),
E5M2, column sums) and ``gelu`` (MLP-out's input GELU(f + b), E4M3). Per case, on fresh random inputs with NaN,
±inf and a huge value sprinkled in, into outputs poisoned twice (two byte values: an unwritten byte cannot match
both times), each instantiation's y, yᵀ and amax must equal the shared-tile kernel's bit for bit and its column
sums match the tile kernel's to float32 rounding (another fixed order); then the package's ``fp8_cast`` (since this
experiment, the register transpose for such inputs), its 64 x 64 shared-tile kernel (``tile``, what ``fp8_cast``
ran before) and the experiment's instantiations are timed (``llmgpu.perf.timing.time_fn``) and set against the
device-to-device copy measured in the same run; the speedup is the tile kernel's time over the best experiment's.
Without a GPU the script says so and exits 0. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
import _devscript  # noqa: E402  (first: puts the package on the path)

from llmgpu import backend  # noqa: E402
from llmgpu.kernels import get_kernel, loader  # noqa: E402
from llmgpu.ops import fp8  # noqa: E402
from llmgpu.perf.timing import copy_bandwidth, time_fn  # noqa: E402

SOURCE = HERE / "fp8_cast_transpose_regs.cu"
THREADS = fp8.THREADS
ROWS, COLS = fp8.ROWS_8X8, fp8.COLS_8X8  # the register transpose's block tile
MIN_BLOCKS = {False: (2,), True: (2, 3)}  # the file's instantiations' MIN_BLOCKS, without / with an act
# what each cast applies and writes: (act, format, column sums)
KINDS = {"dy": (None, "e5m2", True), "dgelu": ("dgelu", "e5m2", True), "gelu": ("gelu", "e4m3", False)}
# d36 at B = 16 (M = 16384 tokens, C = 1280) and d48 at B = 8 (M = 8192, C = 1600): the output gradients of
# MLP-out / attention-out (C) and QKV (3C), MLP-in's (4C), and MLP-out's input (4C)
DEFAULT_CASES = ("dy:16384x1280,dy:16384x3840,dgelu:16384x5120,gelu:16384x5120,"
                 "dy:8192x1600,dy:8192x4800,dgelu:8192x6400,gelu:8192x6400")


def build(cp):
    text = SOURCE.read_text()
    return cp.RawModule(code=text, options=loader.compile_options(), name_expressions=loader.expressions_in(text))


def poisoned_normal(rng, shape, scale=1.0):
    x = (scale * rng.standard_normal(shape)).astype(np.float32)
    flat = x.reshape(-1)
    for v in (np.nan, np.inf, -np.inf, 3e4):
        flat[rng.integers(0, flat.size)] = v
    return x


def run_case(cp, module, kind, R, C, rng, reps, copy_gbps):
    act, fmt_name, sums = KINDS[kind]
    fmt = fp8.fp8_format(fmt_name)
    if R % 8 or C % 8:
        print(f"{kind} [{R}, {C}]: the experiment takes R and C multiples of 8")
        return False, None
    bf16 = backend.resolve_dtype("bf16")
    x = cp.asarray(poisoned_normal(rng, (R, C)).astype(bf16))
    pre = cp.asarray(poisoned_normal(rng, (R, C)).astype(bf16)) if act == "dgelu" else None
    bias = cp.asarray((0.1 * rng.standard_normal(C)).astype(bf16)) if act else None
    scale = cp.asarray(np.array([fmt.max / 8.0], np.float32))
    kernels = {f"regs/{b}": module.get_function(f"fp8_cast_transpose_8x8_kernel<{loader.template_args(bf16)}, "
                                                f"{fmt.c_name}, {fp8.ACTS[act]}, {int(sums)}, {b}>")
               for b in MIN_BLOCKS[act is not None]}
    grid = (-(-R // ROWS), -(-C // COLS))
    sum_k = get_kernel("fp8", "fp8_column_sums_kernel")
    part = cp.empty((grid[0], C), np.float32) if sums else None
    y, yt, amax, si = cp.empty((R, C), np.uint8), cp.empty((C, R), np.uint8), cp.zeros(1, np.float32), cp.empty(
        1, np.float32)
    cs = cp.zeros(C, np.float32) if sums else None
    py, pyt, pam, psi = cp.empty_like(y), cp.empty_like(yt), cp.zeros(1, np.float32), cp.empty(1, np.float32)
    pcs = cp.zeros(C, np.float32) if sums else None

    def regs(kern):
        amax.fill(0)
        kern(grid, (THREADS,), (x, fp8.optional_arg(pre), fp8.optional_arg(bias), y, yt, np.int64(R), np.int64(C),
                                scale, si, amax, fp8.optional_arg(part)))
        if sums:
            sum_k((-(-C // THREADS),), (THREADS,), (part, np.int32(grid[0]), np.int64(C), cs, np.int32(0)))

    tile_k = get_kernel("fp8", "fp8_cast_transpose_kernel", bf16, fmt.c_name, 4, fp8.ACTS[act], int(sums))
    tile_grid = (-(-R // fp8.TILE), -(-C // fp8.TILE))
    tile_part = cp.empty((tile_grid[0], C), np.float32) if sums else None

    def tile():  # the package's shared-tile cast, as fp8_cast launches it for unaligned inputs
        pam.fill(0)
        tile_k(tile_grid, (THREADS,), (x, fp8.optional_arg(pre), fp8.optional_arg(bias), py, pyt, np.int64(R),
                                       np.int64(C), scale, psi, pam, fp8.optional_arg(tile_part)))
        if sums:
            sum_k((-(-C // THREADS),), (THREADS,), (tile_part, np.int32(tile_grid[0]), np.int64(C), pcs, np.int32(0)))

    def package():
        fp8.fp8_cast(x, scale, fmt_name, transpose=True, out=py, out_t=pyt, amax=pam, scale_inv=psi, act=act,
                     pre=pre, bias=bias, column_sums=pcs)

    ok = True
    for (label, kern), poison in itertools.product(kernels.items(), (0xAB, 0x54)):
        for a in (y, yt, py, pyt):
            a.fill(poison)
        for a in (amax, si, pam, psi):
            a.fill(np.nan)
        if sums:
            cs.fill(np.nan)
            pcs.fill(np.nan)
        regs(kern)
        tile()
        same = (bool(cp.array_equal(y, py)) and bool(cp.array_equal(yt, pyt))
                and cp.asnumpy(amax).view(np.uint32)[0] == cp.asnumpy(pam).view(np.uint32)[0]
                and float(si[0]) == float(psi[0]))
        if sums:
            same &= bool(np.allclose(cp.asnumpy(cs), cp.asnumpy(pcs), rtol=1e-5, atol=1e-3, equal_nan=True))
        if not same:
            print(f"    {label}: differs from the shared tile (poison {poison:#x})")
        ok &= same
    print(f"{kind} [{R}, {C}] {fmt_name}: y, yT, amax{', column sums' if sums else ''} {'ok' if ok else 'FAIL'}")

    nbytes = x.nbytes * (2 if pre is not None else 1) + 2 * R * C  # read x (and pre), write y and yT
    row = {"kind": kind, "shape": [R, C], "fmt": fmt_name, "ok": ok}
    fns = {"package": package, "tile": tile,
           **{label: functools.partial(regs, kern) for label, kern in kernels.items()}}
    for label, fn in fns.items():
        t = time_fn(fn, xp=cp, reps=reps)
        gbps = t.gbps(nbytes)
        row[label] = {"us": 1e3 * t.median_ms, "gbps": gbps,
                      "pct_of_copy": 100 * gbps / copy_gbps if copy_gbps else None}
        share = f" ({100 * gbps / copy_gbps:.0f} % of copy)" if copy_gbps else ""
        print(f"    {label:<8} {1e3 * t.median_ms:9.1f} us {gbps:7.0f} GB/s{share}")
    best = min(kernels, key=lambda k: row[k]["us"])
    row["best"], row["speedup"] = best, row["tile"]["us"] / row[best]["us"]
    print(f"    tile / {best} = {row['speedup']:.3f}")
    return ok, row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"kind:RxC, comma-separated (default {DEFAULT_CASES})")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per kernel (median reported)")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh inputs every run)")
    ap.add_argument("--no-copy", action="store_true", help="skip measuring the copy ceiling")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    cases = []
    for item in filter(None, args.cases.split(",")):
        kind, _, shape = item.partition(":")
        if kind not in KINDS:
            ap.error(f"unknown cast {kind!r} (one of {', '.join(KINDS)})")
        cases.append((kind, *(int(v) for v in shape.lower().split("x"))))

    cp = _devscript.cupy_or_say_why(f" ({SOURCE.name}: nothing checked or timed)")
    if cp is None:
        return 0
    module = build(cp)
    info = backend.device_info(cp)
    print(info.summary())
    copy_gbps = None if args.no_copy else copy_bandwidth(xp=cp)
    if copy_gbps:
        print(f"device-to-device copy: {copy_gbps:.0f} GB/s (bytes read + written)")
    rng = np.random.default_rng(args.seed)
    ok, rows = True, []
    for kind, R, C in cases:
        good, row = run_case(cp, module, kind, R, C, rng, args.reps, copy_gbps)
        ok &= good
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": info.name, "copy_gbps": copy_gbps, "rows": rows},
                                              indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
