"""The launch order of our flash kernels' blocks: heads in groups for L2 reuse (issue 16), checked and timed.

    python dev/cuda/flash_tile_order.py                    # the sweep below, a table, exit 1 if a check fails
    python dev/cuda/flash_tile_order.py --json out.json

Hypothesis (written before the first run): at the GPT-2 shape B = 64 our forward reaches 273 TFLOP/s against
268 at B = 16, while cuDNN goes from 304 to 347. The grid used to put a block's head fastest, so the ~264 blocks
in flight (two per SM) belonged to 264 different heads and each streamed its own K and V: at B = 64 the K and V of
all heads (196 MB) are three times the L2 (60 MB), so those reads came from memory (about 0.9 GB per forward,
2.3 TB/s at 0.38 ms); at B = 16 (49 MB) they mostly stayed in the L2. Grouping heads (the grid (group, tiles,
groups) of kernels/flash_common.cuh: the tiles of ``group`` heads run together) should lift B = 64 to the B = 16
level or above: predicted 273 -> 290-310 TFLOP/s forward (0.84-0.89x cuDNN), the backward's two kernels +5-10 %,
B = 16 within +-3 % with one input set (it fits the L2 anyway), more with rotating inputs.

First run (H200, 2026-12-03, groups of as many heads as fit a quarter of the L2: 60 at T = 1024, 7 at D = 128,
T = 4096; ``benchmarks/results/ch2b/flash_tile_order_first.json``), rotating inputs, forward TFLOP/s plain -> grouped:
B = 64 268 -> 281 (+5 %, best 282 at 128 heads), dQ +3 %, dK/dV +5 %: the direction predicted, half the size.
But B = 16 lost 8 % (260 -> 239) and D = 128 5 % (351 -> 335), and "same" and "rotating" hardly differ anywhere:
the L2 is not where most of it comes from. What decides is the end of the grid: the plain order runs every head's
longest tile first and ends on short ones; 192 heads in groups of 60 leave a last group of 12 whose longest tiles
start when everything else is done (64 heads in groups of 7: a last group of one), and small groups at B = 16 end on
long tiles too (groups of 1-8: 237-240). Groups that divide the heads evenly and hold several waves of blocks were
at or near the best everywhere (B = 16: 64 and 192; B = 64: 64-128; D = 128: 4-32).

Rule 2 (``flash_launch.tile_group``): the fewest heads that divide B·H evenly and whose blocks fill the GPU at
least twice (GROUP_WAVES). Prediction (before its run), rotating inputs: forward B = 16 96 heads, 255-262 (the plain
order's level); B = 64 96 heads, 279-283 (+4-6 % over plain); D = 128 16 heads, 362-368 (+3-5 %); dQ and dK/dV
within 2 % of the best group at every shape, never below plain.

For every shape (bf16, causal; D = 64 at B = 16 and 64, H = 12, T = 1024; D = 128 at B = 4, H = 16, T = 4096) and
every kernel of ``kernel="ours"`` (the Hopper forward where it runs, the mma.sync forward, the backward's dQ and
dK/dV kernels), each group size from 1 head to all of them (the plain order) and ``flash_launch.plan``'s choice:

* check: outputs bitwise equal to the plain order's (the order must not change a bit: each block computes the
  same thing wherever it runs), written everywhere (poisoned first);
* time (median of CUDA events): "same" reuses one input set, as bench_flash_attention.py does; "rotating" cycles
  through enough input sets to be four times the L2, as a training step sees attention (every layer's inputs are
  new). cuDNN's forward and backward on the same inputs as the reference.

Without a GPU one line saying so, exit 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
import _devscript  # noqa: E402  (first: puts the package on the path)

from llmgpu import backend  # noqa: E402
from llmgpu.ops import cudnn_attention  # noqa: E402
from llmgpu.ops import flash_attention as fa  # noqa: E402
from llmgpu.ops import flash_launch as fl  # noqa: E402
from llmgpu.perf.timing import time_fn  # noqa: E402
from llmgpu.testing import poisoned, random_array  # noqa: E402

SHAPES = [(16, 12, 1024, 64), (64, 12, 1024, 64), (4, 16, 4096, 128)]  # (B, H, T, D), causal
GROUPS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # plus every head (the plain order) and plan's choice


def groups_for(n_bh: int, chosen: int) -> list[int]:
    """The group sizes to try for n_bh heads: GROUPS below n_bh, the chosen one, n_bh (the plain order)."""
    return sorted({g for g in GROUPS if g < n_bh} | {chosen, n_bh})


KERNEL_NAMES = {"fwd wgmma": "flash_fwd_wgmma", "fwd mma": "flash_fwd"}  # the others: "bwd <kernel>"


def kernels_for(q) -> list[str]:
    fwd = ["fwd wgmma"] if fl.forward_impl(q) == "wgmma" else []
    return fwd + ["fwd mma", "bwd flash_bwd_dq_wide", "bwd flash_bwd_dkdv_wide"]


class Inputs:
    """One input set: q, k, v as views of a [B, T, 3C] buffer, dO, and the outputs (o, lse, dq, dk, dv)."""

    def __init__(self, cp, rng, B, H, T, D):
        self.qkv = random_array(rng, (B, T, 3 * H * D), "bf16", cp)
        self.q, self.k, self.v = fa.split_qkv(self.qkv, H)
        self.do = random_array(rng, (B, H, T, D), "bf16", cp)
        self.o = fa.heads_view(poisoned((B, T, H * D), "bf16", cp), H)
        self.lse = poisoned((B, H, T), "fp32", cp)
        self.dq, self.dk, self.dv = (poisoned((B, H, T, D), "bf16", cp) for _ in range(3))
        self.scale = 1.0 / math.sqrt(D)
        fl.ours_forward(self.q, self.k, self.v, self.o, self.lse, self.scale, True)  # the backward reads o, lse
        fl.ours_backward(self.do, self.q, self.k, self.v, self.o, self.lse, self.scale, True, self.dq, self.dk,
                         self.dv)  # and dK/dV the row statistics dQ writes (one buffer per shape: flash_launch)

    def run(self, kernel: str, group: int) -> None:
        direction, name = kernel.split()
        if direction == "fwd":
            fl.ours_forward(self.q, self.k, self.v, self.o, self.lse, self.scale, True, impl=name, group=group)
        else:
            fl.ours_backward(self.do, self.q, self.k, self.v, self.o, self.lse, self.scale, True, self.dq, self.dk,
                             self.dv, only=name, group=group)

    @staticmethod
    def names(kernel: str) -> tuple[str, ...]:
        """The outputs ``kernel`` writes."""
        return {"bwd flash_bwd_dq_wide": ("dq",), "bwd flash_bwd_dkdv_wide": ("dk", "dv")}.get(kernel, ("o", "lse"))

    def outputs(self, cp, kernel: str) -> list[np.ndarray]:
        return [cp.asnumpy(getattr(self, n)).view(np.uint8).copy() for n in self.names(kernel)]  # bit for bit

    def finite(self, cp, kernel: str) -> bool:
        return all(np.isfinite(cp.asnumpy(getattr(self, n)).astype(np.float32)).all() for n in self.names(kernel))


def check(x: Inputs, cp, kernel, groups) -> dict:
    """Every group's outputs against the plain order's, bit for bit, each on freshly poisoned outputs (a backward
    kernel: the whole backward in that order, after the forward)."""
    ref, bad = None, []
    for g in sorted(groups, reverse=True):  # the plain order (all heads) first
        for a in (x.o, x.lse, x.dq, x.dk, x.dv):
            a[...] = np.nan
        if kernel.startswith("fwd"):
            x.run(kernel, g)
        else:
            fl.ours_forward(x.q, x.k, x.v, x.o, x.lse, x.scale, True)
            fl.ours_backward(x.do, x.q, x.k, x.v, x.o, x.lse, x.scale, True, x.dq, x.dk, x.dv, group=g)
        cp.cuda.Device().synchronize()
        outs = x.outputs(cp, kernel)
        if ref is None:
            ref = outs
            if not x.finite(cp, kernel):
                bad.append("plain order: a non-finite output (unwritten?)")
        elif not all(np.array_equal(a, b) for a, b in zip(outs, ref)):
            bad.append(f"group {g}: differs from the plain order")
    return {"ok": not bad, "problems": bad}


def sweep_shape(cp, rng, B, H, T, D, reps, result) -> int:
    """Check and time every kernel and group at one shape, cuDNN beside them; the rows go to result. Returns the
    number of failed checks."""
    n_bh, l2 = B * H, result["l2_bytes"]
    set_bytes = 2 * (3 + 1 + 1 + 3) * B * T * H * D  # qkv, dO, o, dq/dk/dv in bf16
    sets = [Inputs(cp, rng, B, H, T, D) for _ in range(max(2, -(-4 * l2 // set_bytes)))]
    shape, bad, rows = f"B={B} H={H} T={T} D={D}", 0, []
    print(f"\n{shape}: {n_bh} heads; rotating over {len(sets)} input sets", flush=True)

    def add(kernel, run, **kw):  # run(x) on one input set, then rotating over all of them
        i = [0]

        def rotating():
            run(sets[i[0] % len(sets)])
            i[0] += 1
        same = time_fn(lambda: run(sets[0]), xp=cp, reps=reps).median_ms
        rot = time_fn(rotating, xp=cp, reps=reps).median_ms
        rows.append({"shape": shape, "kernel": kernel, **kw, "ms_same": same, "ms_rotating": rot})
        tag = "" if "group" not in kw else f"group {kw['group']:>4}{' (plain)' if kw['plain'] else ''}" + \
            (" (chosen)" if kw["chosen"] else "")
        print(f"  {kernel:<26} {tag:<26} same {same:7.3f} ms   rotating {rot:7.3f} ms", flush=True)

    for kernel in kernels_for(sets[0].q):
        chosen = fl.plan(KERNEL_NAMES.get(kernel, kernel.split()[-1]), sets[0].q).group
        groups = groups_for(n_bh, chosen)
        c = check(sets[0], cp, kernel, groups)
        result["checks"].append({"shape": shape, "kernel": kernel, **c})
        bad += not c["ok"]
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {kernel}: bitwise equal over groups {groups} (chosen {chosen})"
              + "".join(f"\n       {p}" for p in c["problems"]), flush=True)
        for g in groups:
            add(kernel, lambda x, g=g, kernel=kernel: x.run(kernel, g), group=g, chosen=g == chosen, plain=g == n_bh)
    if cudnn_attention.available():
        for x in sets:
            _, x.cudnn_stats = fa.flash_attention_forward(x.q, x.k, x.v, True, kernel="cudnn")
        add("fwd cudnn", lambda x: fa.flash_attention_forward(x.q, x.k, x.v, True, out=x.o, lse=x.lse,
                                                              kernel="cudnn"))
        add("bwd cudnn", lambda x: fa.flash_attention_backward(x.do, x.q, x.k, x.v, x.o, x.cudnn_stats, True,
                                                               dq=x.dq, dk=x.dk, dv=x.dv, kernel="cudnn"))
    flops = {d: fa.flash_attention_flops(B, H, T, D, True, d) for d in ("fwd", "bwd")}
    for row in rows:
        f = flops[row["kernel"][:3]]
        row["tflops_same"], row["tflops_rotating"] = f / row["ms_same"] / 1e9, f / row["ms_rotating"] / 1e9
    result["rows"] += rows
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the checks and timings here")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    cp = _devscript.cupy_or_say_why()
    if cp is None:
        return 0
    rng = np.random.default_rng(0)
    info = backend.device_info(cp)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": info.summary(),
              "l2_bytes": info.l2_bytes, "group_waves": fl.GROUP_WAVES, "rows": [], "checks": []}
    bad = 0
    for B, H, T, D in SHAPES:
        bad += sweep_shape(cp, rng, B, H, T, D, a.reps, result)
        cp.get_default_memory_pool().free_all_blocks()
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))
    print(summary(result))
    return 1 if bad else 0


def summary(result) -> str:
    """Per shape and kernel: the plain order, the chosen group and the best group, rotating inputs, TFLOP/s (bwd
    kernels: of the whole backward's FLOPs, so only their ratios mean something)."""
    lines = ["", "shape                     kernel                     plain   chosen  best (group)   cuDNN"]
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        cudnn = {r["kernel"].split()[0]: r["tflops_rotating"] for r in rows if r["kernel"].endswith("cudnn")}
        for kernel in dict.fromkeys(r["kernel"] for r in rows if "group" in r):
            ks = [r for r in rows if r["kernel"] == kernel]
            plain = next(r for r in ks if r["plain"])["tflops_rotating"]
            chosen = next(r for r in ks if r["chosen"])["tflops_rotating"]
            best = max(ks, key=lambda r: r["tflops_rotating"])
            lines.append(f"{shape:<25} {kernel:<26} {plain:6.1f}  {chosen:6.1f}  {best['tflops_rotating']:6.1f} "
                         f"({best['group']:>4})  {cudnn.get(kernel.split()[0], float('nan')):6.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
