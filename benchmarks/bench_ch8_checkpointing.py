"""Chapter 8 benchmark: activation checkpointing on the fast step, peak memory against step time.

    python benchmarks/bench_ch8_checkpointing.py            # GPU: writes benchmarks/results/ch8/ch8_checkpointing.json
    python benchmarks/bench_ch8_checkpointing.py --quick    # small sizes (the default on a CPU; nothing written)

For ``checkpoint_every`` k ∈ {off, 1, 2, 4}: the whole training step of ``llmgpu train --fast`` (``FastGPT``
through ``TrainStep``: forward, backward with the recomputation, clip, AdamW), as one CUDA graph by default
(``--eager``: launched op by op), on GPT-2 124M, bf16, B = 64, T = 1024, vocabulary padded to 50304. Per k:
the median ms per step (CUDA events, ``llmgpu.bench.run_llmgpu``), the peak memory (the high-water mark of
CuPy's pool plus the graph's private pool: weights, gradients, AdamW state, the activations, the logits),
the activation bytes the model kept (counted) and the FLOPs the recomputation adds. The targets of issue 19:
at k = 1 at most half the peak memory of the plain step, for at most 1.3× its step time; the script says
whether they hold (exit code 1 when not).

On a CPU (NumPy, the ``tiny`` preset, eager) it is a smoke test: counted activation bytes instead of pool
memory, nothing written unless ``--out`` is given.
"""

from __future__ import annotations

import sys

import _common

from llmgpu.bench import release_memory, run_llmgpu
from llmgpu.model import GPTConfig
from llmgpu.model.config import training_flops

RESULTS = _common.RESULTS_DIR / "ch8" / "ch8_checkpointing.json"
KS = (0, 1, 2, 4)
TARGET_MEMORY, TARGET_TIME = 0.50, 1.30  # k = 1 against off (issue 19)


def main(argv=None):
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--preset")
    ap.add_argument("--steps", type=int, help="timed steps per k (default 20 on a GPU)")
    ap.add_argument("--eager", action="store_true", help="launch the step op by op instead of one CUDA graph")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    if on_gpu and not quick:
        preset, batch, seq, dtype, steps = "gpt2", 64, 1024, "bf16", 20
    elif on_gpu:
        preset, batch, seq, dtype, steps = "d6", 8, 256, "bf16", 5
    else:
        preset, batch, seq, dtype, steps = "tiny", 4, 64, "fp32", 2
    preset, batch, seq, steps = a.preset or preset, a.batch or batch, a.seq or seq, a.steps or a.reps or steps
    graph = on_gpu and not a.eager
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    cfg = GPTConfig.preset(preset, pad_vocab_to=64, block_size=max(seq, cfg.block_size))
    print(f"model: {preset} ({cfg.num_parameters() / 1e6:.1f}M parameters), {dtype}, batch {batch} x {seq}, "
          f"fast step{' as one CUDA graph' if graph else ', eager'}")
    rows = []
    for k in KS:
        r = run_llmgpu(cfg, batch, seq, steps, warmup=3 if on_gpu else 1, dtype=dtype, xp=xp, checkpoint_every=k,
                       fast=True, graph=graph)
        release_memory()
        r["k"], r["label"] = k, "off" if k == 0 else f"every {k}"
        r["extra_flops"] = training_flops(cfg, batch, seq, k)["recompute_fraction"]
        rows.append(r)
    mem_key = "peak_memory_bytes" if on_gpu else "activation_bytes_peak"
    base = rows[0]
    print(f"\n{'checkpointing':>14} {'ms/step':>9} {'time x':>7} {'extra FLOPs':>12} "
          f"{'peak GiB' if on_gpu else 'act. MiB':>10} {'memory x':>9} {'kept act. GiB':>14}")
    for r in rows:
        r["time_vs_off"] = r["ms_per_step"] / base["ms_per_step"]
        r["memory_vs_off"] = r[mem_key] / base[mem_key]
        mem = r[mem_key] / (2**30 if on_gpu else 2**20)
        print(f"{r['label']:>14} {r['ms_per_step']:9.2f} {r['time_vs_off']:7.2f} {100 * r['extra_flops']:11.0f}% "
              f"{mem:10.2f} {r['memory_vs_off']:9.2f} {r['activation_bytes_peak'] / 2**30:14.2f}")
    one = next(r for r in rows if r["k"] == 1)
    ok = one["memory_vs_off"] <= TARGET_MEMORY and one["time_vs_off"] <= TARGET_TIME
    print(f"\ncheckpointing every block: {100 * (1 - one['memory_vs_off']):.0f}% less peak memory for "
          f"{100 * (one['time_vs_off'] - 1):.0f}% more time; targets memory <= {TARGET_MEMORY:.2f}x, time <= "
          f"{TARGET_TIME:.2f}x: {'met' if ok else 'NOT met'}" + ("" if on_gpu and not quick else " (smoke test)"))
    payload = {"benchmark": "ch8_checkpointing", "preset": preset, "batch": batch, "seq": seq, "dtype": dtype,
               "graph": graph, "memory_metric": "CuPy pool + graph pool high-water mark" if on_gpu
               else "counted activation bytes", "targets": {"memory_vs_off": TARGET_MEMORY,
                                                           "time_vs_off": TARGET_TIME},
               "targets_met": ok, "rows": rows}
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0 if ok or quick else 1


if __name__ == "__main__":
    sys.exit(main())
