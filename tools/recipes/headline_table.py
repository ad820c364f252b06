"""The table `headline_runs.sh` ends with: each timed row of some `llmgpu bench` JSON files and the ratio that issues
36 and 37 state their targets in (our FP8 step over our bf16 step, our FP8 step over torchao float8 +
`torch.compile`, our bf16 step over `torch.compile`), wherever both rows of a ratio are among the files.

    python tools/recipes/headline_table.py benchmarks/results/ch5b/h100_d36_{bf16_and_fp8_delayed,torchao_fp8}.json

Rows are keyed by (preset, mode): give files of one card and one occasion (a later file's row replaces an earlier
one's). Runs on any machine (it only reads JSON).
"""

from __future__ import annotations

import argparse
import json
import sys

# mode -> (the mode whose row it is compared with, whether the ratio is that row over this one, what the ratio says)
RATIOS = {"llmgpu-fp8-graph": ("llmgpu-fast-graph", False, "our FP8 over our bf16"),
          "torch-compile-fp8": ("llmgpu-fp8-graph", True, "our FP8 over torchao float8"),
          "llmgpu-fast-graph": ("torch-compile", False, "ours over torch.compile")}


def timed_rows(paths) -> dict:
    """{(preset, mode): row} of the rows that were timed (a skipped or failed mode has no tokens/s)."""
    rows = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        rows.update({(d["preset"], r["mode"]): r for r in d["results"] if r.get("tokens_per_s")})
    return rows


def ratio(rows: dict, preset: str, mode: str) -> tuple[float, str] | None:
    """(the target's ratio for this row, what it says), or None where the other row is not among ``rows``."""
    other, inverse, said = RATIOS.get(mode, (None, False, ""))
    o, r = rows.get((preset, other)), rows[(preset, mode)]
    if o is None:
        return None
    return (o["tokens_per_s"] / r["tokens_per_s"] if inverse else r["tokens_per_s"] / o["tokens_per_s"]), said


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="llmgpu bench --json files")
    rows = timed_rows(ap.parse_args(argv).files)
    if not rows:
        print("headline_table: no timed rows in these files", file=sys.stderr)
        return 1
    print(f"{'preset':12s} {'mode':18s} {'ms/step':>8s} {'K tok/s':>8s} {'GiB':>6s}  ratio")
    for (preset, mode), r in rows.items():
        x = ratio(rows, preset, mode)
        print(f"{preset:12s} {mode:18s} {r['ms_per_step']:8.1f} {r['tokens_per_s'] / 1e3:8.1f} "
              f"{r['peak_memory_bytes'] / 2**30:6.1f}  " + (f"{x[0]:.3f}x {x[1]}" if x else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
