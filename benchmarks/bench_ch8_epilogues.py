"""Chapter 8 benchmark: the bias gradient in the weight-gradient GEMM's epilogue, and GELU in or out of the fc GEMM.

    python benchmarks/bench_ch8_epilogues.py            # GPU: writes benchmarks/results/ch8_epilogues.json
    python benchmarks/bench_ch8_epilogues.py --quick    # small sizes (the default on a CPU; nothing written)

Times the fast training step (one CUDA graph, GPT-2 124M, bf16, B = 64, T = 1024, vocabulary 50304) with the four
settings of ``model.fast.BIAS_GRAD_IN_WGRAD`` x ``GELU_IN_FC_GEMM``, each twice, alternated, in one process, and
reports ms per step (best of the two) and the ratio to the step before (separate bias gradient, GELU in the
epilogue). Predictions written before the first run, from ``profile_step_gpt2_b64.json`` (106.3 ms):

* BGRADB: the four bias gradients are 3.2 ms of separate passes over dy (near the copy rate); summed inside the
  weight-gradient GEMM, which streams dy anyway, they should cost little: -2 to -3 ms if the GEMM keeps its rate
  (plus 48 tiny adds of the sum into the fp32 gradient, ~0.05 ms).
* GELU outside the fc GEMM: the GELU_AUX_BIAS GEMM runs at 504 TFLOP/s (7.36 ms) against ~760 for the BIAS-only
  GEMMs of the same size (4.9 ms); a separate GELU pass reads and writes [N, 4C] bf16 (0.8 GB per block, 2.3 ms
  over 12 blocks at the copy rate): 4.9 + 2.3 = 7.2 ms, i.e. -0.2 ms, within noise.
"""

from __future__ import annotations

import itertools
import sys

import _common

from llmgpu.bench import release_memory, run_llmgpu
from llmgpu.model import GPTConfig, fast

RESULTS = _common.RESULTS_DIR / "ch8_epilogues.json"
SWITCHES = ("BIAS_GRAD_IN_WGRAD", "GELU_IN_FC_GEMM")
BEFORE = (False, True)  # the step before this benchmark's change


def label(setting) -> str:
    bias, gelu = setting
    return f"bias grad {'in wgrad' if bias else 'separate'}, GELU {'in fc GEMM' if gelu else 'separate'}"


def main(argv=None):
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--steps", type=int, help="timed steps per run (default 20 on a GPU)")
    ap.add_argument("--rounds", type=int, default=2, help="times each setting is timed, alternated (default 2)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    preset, batch, seq, dtype, steps = _common.step_case(on_gpu, quick)
    steps = a.steps or steps
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    settings = [BEFORE] + [s for s in itertools.product((True, False), repeat=2) if s != BEFORE]
    default = tuple(getattr(fast, s) for s in SWITCHES)
    rows = []
    try:
        for _ in range(a.rounds):
            for setting in settings:
                for name, value in zip(SWITCHES, setting):
                    setattr(fast, name, value)
                res = run_llmgpu(cfg, batch, seq, steps, warmup=3 if on_gpu else 1, dtype=dtype, xp=xp, fast=True,
                                 graph=on_gpu)
                release_memory()
                res["case"], res["switches"] = label(setting), dict(zip(SWITCHES, setting))
                rows.append(res)
                print(f"{label(setting):>44}: {res['ms_per_step']:8.2f} ms/step", flush=True)
    finally:
        for name, value in zip(SWITCHES, default):
            setattr(fast, name, value)
    summary = {}
    for setting in settings:
        ms = min(r["ms_per_step"] for r in rows if r["case"] == label(setting))
        summary[label(setting)] = {"ms_per_step": ms, **dict(zip(SWITCHES, setting))}
    base = summary[label(BEFORE)]["ms_per_step"]
    for k, v in summary.items():
        v["time_vs_before"] = v["ms_per_step"] / base
        print(f"{k:>44}: {v['ms_per_step']:8.2f} ms/step, {v['time_vs_before']:.3f}x the step before (best of "
              f"{a.rounds})" + ("" if on_gpu and not quick else " (smoke test)"))
    payload = {"benchmark": "ch8_epilogues", "preset": preset, "batch": batch, "seq": seq, "dtype": dtype,
               "graph": on_gpu, "steps": steps, "summary": summary, "rows": rows}
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
