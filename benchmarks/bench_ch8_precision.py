"""Chapter 8 benchmark: the fast step in bf16 against fp16 with the dynamic loss scaler, same model and batch.

    python benchmarks/bench_ch8_precision.py            # GPU: writes benchmarks/results/ch8/ch8_precision.json
    python benchmarks/bench_ch8_precision.py --quick    # small sizes (the default on a CPU; nothing written)

The whole training step of ``llmgpu train --fast`` (``FastGPT`` through ``TrainStep``; as one CUDA graph on a
GPU) on GPT-2 124M, B = 64, T = 1024, vocabulary padded to 50304, synthetic tokens, once per precision: the
median ms per step and tokens/s. fp16 adds the loss scaler's work to the step (the scaled loss, the inf/NaN
check of the gradient, the conditional update and scale change, all on the device). Issue 19's target: fp16
within 3 % of bf16's throughput. The loss curves of the two (300 steps of real training) come from
``llmgpu train`` and ``tools/recipes/compare_runs.py`` instead.
"""

from __future__ import annotations

import sys

import _common

from llmgpu.bench import release_memory, run_llmgpu
from llmgpu.model import GPTConfig

RESULTS = _common.RESULTS_DIR / "ch8" / "ch8_precision.json"
TARGET = 0.97  # fp16 tokens/s at least this fraction of bf16's


def main(argv=None):
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--steps", type=int, help="timed steps per precision (default 20 on a GPU)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    preset, batch, seq, steps = ("gpt2", 64, 1024, 20) if on_gpu and not quick else ("tiny", 4, 64, 2)
    steps = a.steps or steps
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    rows = []
    for dtype in (("bf16", "fp16") if on_gpu else ("fp32", "fp16")):
        r = run_llmgpu(cfg, batch, seq, steps, warmup=3 if on_gpu else 1, dtype=dtype, xp=xp, fast=True,
                       graph=on_gpu)
        release_memory()
        rows.append(r)
        print(f"{dtype}: {r['ms_per_step']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, final loss "
              f"{r['final_loss']:.3f}")
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    ok = ratio >= TARGET
    print(f"fp16 / {rows[0]['dtype']} tokens/s: {ratio:.3f} (target >= {TARGET}): {'met' if ok else 'NOT met'}"
          + ("" if on_gpu and not quick else " (smoke test)"))
    payload = {"benchmark": "ch8_precision", "preset": preset, "batch": batch, "seq": seq, "graph": on_gpu,
               "fp16_over_bf16": ratio, "target": TARGET, "target_met": ok, "rows": rows}
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0 if ok or quick else 1


if __name__ == "__main__":
    sys.exit(main())
