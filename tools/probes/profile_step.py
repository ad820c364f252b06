"""Chapter 8's per-op table for any preset: where the time of one training step goes.

    python tools/probes/profile_step.py --preset d36 --batch 16            # the fast step on the GPU, bf16
    python tools/probes/profile_step.py --preset gpt2 --book --top 30        # the book step instead
    python tools/probes/profile_step.py --preset tiny --batch 2 --seq 32     # on NumPy where there is no GPU (fp32)

One row per ``instrument.region`` of the step (``perf.profile.profile_step``): calls, ms per step, % of the
step, GB/s and TFLOP/s against the copy and GEMM ceilings measured in the same run. The scale table of
chapter 8 found llmgpu's MFU lower at 774M and 1.5B than at 124M and 350M; this table, at those sizes beside
GPT-2 small's, is where to look for why. On a GPU it ends with the step's floor (``perf.profile.step_floor``) and the
ops furthest above theirs. ``--json`` writes the rows with the run's configuration.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step
from llmgpu.model.family import FAMILIES, arch_of_preset
from llmgpu.model.options import FastOptions
from llmgpu.ops.fp8 import RECIPES as FP8_RECIPES
from llmgpu.perf import profile, timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2",
                    help="model size, any family (default gpt2; d24, smollm-135m, llama-tiny, ...)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--book", action="store_true", help="the book step (GPT) instead of the fast one (FastGPT)")
    ap.add_argument("--reps", type=int, default=3, help="profiled steps (default 3), after one warm-up step")
    ap.add_argument("--top", type=int, default=24, help="rows printed (default 24; the JSON keeps all)")
    ap.add_argument("--fp8", choices=FP8_RECIPES, help="the fast step with FastOptions(fp8=...) (chapter 5b)")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    xp = backend.select_xp(a.device)
    gpu = xp is not np
    dtype = "bf16" if gpu else "fp32"
    config_class = FAMILIES[arch_of_preset(a.preset)][0]  # GPTConfig or LlamaConfig, by the preset's family
    cfg = config_class.preset(a.preset, pad_vocab_to=64)
    if a.seq > cfg.block_size:
        cfg = config_class.preset(a.preset, pad_vocab_to=64, block_size=a.seq)
    print(backend.device_info(xp).summary(), flush=True)
    copy = timing.copy_bandwidth(2**31 if gpu else 2**24, xp=xp)
    gemm = timing.gemm_ceiling(8192 if gpu else 256, dtype, xp=xp)
    if a.fp8 and a.book:
        ap.error("--fp8 is the fast step's (FastOptions.fp8); drop --book")
    options = FastOptions(fp8=a.fp8) if a.fp8 else None
    step, _ = make_train_step(cfg, a.batch, a.seq, dtype=dtype, xp=xp, fast=not a.book, options=options)
    rows = profile.profile_step(step, reps=a.reps, gbps_ceiling=copy, tflops_ceiling=gemm, xp=xp)
    ms = rows[0]["step_ms"]
    kind = "book" if a.book else ("fast fp8-" + a.fp8 if a.fp8 else "fast")
    print(f"{a.preset} ({cfg.num_parameters() / 1e6:.0f}M) {kind} step, B={a.batch} T={a.seq} {dtype}: {ms:.2f} ms "
          f"= {a.batch * a.seq / ms * 1e3:,.0f} tokens/s under the timer (copy {copy:,.0f} GB/s, GEMM {gemm:.3g} "
          f"TFLOP/s)\n")
    print(profile.format_table(rows[:a.top]))
    floor = profile.step_floor(rows, copy)  # chapter 8: every op at the best rate of its kind in this table
    if floor["gemm_tflops"]:  # GEMM rows (above 50 TFLOP/s): a GPU's table
        print(f"\nfloor {floor['floor_ms']:.2f} ms (the step is {ms / floor['floor_ms']:.2f}x it): every GEMM at "
              f"{floor['gemm_tflops']:.0f} TFLOP/s (the table's best), every memory-bound op at 90 % of copy, "
              "cuDNN's attention as measured; largest gaps: "
              + ", ".join(f"{op} {g:.2f} ms" for g, op in floor["gaps"][:4]))
    if a.json:
        payload = {"benchmark": "profile_step", "preset": a.preset, "step": kind, "batch": a.batch, "seq": a.seq,
                   "dtype": dtype, "copy_gbps": copy, "gemm_tflops": gemm, "rows": rows}
        timing.save_results(a.json, payload, xp=xp)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
