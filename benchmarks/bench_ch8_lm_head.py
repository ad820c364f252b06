"""Chapter 8 benchmark: the LM head and cross-entropy in chunks of rows against all rows at once.

    python benchmarks/bench_ch8_lm_head.py            # GPU: writes benchmarks/results/ch8/ch8_lm_head.json
    python benchmarks/bench_ch8_lm_head.py --quick    # small sizes (the default on a CPU; nothing written)

``FastGPT.forward_backward`` makes the logits ``FastOptions.lm_head_rows`` rows at a time (8192), so the
``[B·T, 50304]`` logits never exist whole. This times the fast training step (one CUDA graph, GPT-2 124M, bf16,
B = 64, T = 1024, vocabulary 50304) with the default chunk and with one chunk of all rows (the step before the
change), alternating the two twice in one process, and reports ms per step and the peak of CuPy's pool plus the
graph's pool. Prediction written before the first run: 5.4 GiB less peak memory (the 6.6 GB of whole logits
against 0.8 GB of one chunk), and +0.5 % step time (each chunk's weight gradient reads and writes the fp32
[50304, 768] gradient once more, 8 × 0.3 GB).
"""

from __future__ import annotations

import sys

import _common

from llmgpu.bench import release_memory, run_llmgpu
from llmgpu.model import FastOptions, GPTConfig

RESULTS = _common.RESULTS_DIR / "ch8" / "ch8_lm_head.json"


def main(argv=None):
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--steps", type=int, help="timed steps per run (default 20 on a GPU)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    preset, batch, seq, dtype, steps = _common.step_case(on_gpu, quick)
    steps = a.steps or steps
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    whole = batch * seq
    chunk = FastOptions().lm_head_rows  # the default
    cases = {f"chunks of {chunk} rows": chunk, f"all {whole} rows at once": whole}
    rows = []
    for _ in range(2):
        for label, r in cases.items():
            res = run_llmgpu(cfg, batch, seq, steps, warmup=3 if on_gpu else 1, dtype=dtype, xp=xp, fast=True,
                             graph=on_gpu, options=FastOptions(lm_head_rows=r))
            release_memory()
            res["case"], res["lm_head_rows"] = label, r
            rows.append(res)
            mem = res.get("peak_memory_bytes")
            print(f"{label:>26}: {res['ms_per_step']:8.2f} ms/step, peak "
                  + ("-" if mem is None else f"{mem / 2**30:.2f} GiB"), flush=True)
    summary = {}
    for label in cases:
        rs = [r for r in rows if r["case"] == label]
        summary[label] = {"ms_per_step": min(r["ms_per_step"] for r in rs),
                          "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0) for r in rs)}
    (lc, c), (lw, w) = summary.items()
    print(f"chunked / whole: time {c['ms_per_step'] / w['ms_per_step']:.3f}x (best of two each)"
          + (f", peak memory {c['peak_memory_bytes'] / 2**30:.2f} vs {w['peak_memory_bytes'] / 2**30:.2f} GiB"
             if on_gpu else "") + ("" if on_gpu and not quick else " (smoke test)"))
    payload = {"benchmark": "ch8_lm_head", "preset": preset, "batch": batch, "seq": seq, "dtype": dtype,
               "graph": on_gpu, "summary": summary, "rows": rows}
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
