"""Chapter 5b benchmark (issue 37): LayerNorm writing FP8, delayed weights and the BIAS epilogue, A/B in one run.

    python benchmarks/bench_ch5b_layernorm_casts.py            # GPU: d36, B = 16, T = 1024, FP8 delayed; the JSON
    python benchmarks/bench_ch5b_layernorm_casts.py --quick    # a tiny model (the default on a CPU: a NumPy smoke test)

Under delayed scaling the residual add + LayerNorm before QKV and MLP-in can write its output as the layer's FP8
bytes and amax (``ops/fp8_layernorm.py``), then a byte transpose gives the transposed bytes, instead of a bf16
output that the layer's cast reads back: per element of the output 3 bytes moved instead of 6. Timed here: the op
alone at the step's shape (fused against add_layernorm_forward + fp8_cast with the transpose), against this run's
copy ceiling; and the whole FP8 step with the defaults and with one of them off per setting (``--settings``), each
setting with its own model and CUDA graph, timed in alternating rounds (``_common.alternating_step_times``). Four
d36 models at B = 16 need an H200; on an H100 pass fewer settings or a smaller batch (2026-12-07: B = 6, the first
three settings; the BIAS epilogue's A/B ran as the inline script in ``results/ch5b/h100_bias_epilogue_ab.log``).

``FastOptions.fp8_delayed_weights``: the delayed recipe casts the weights with their history's scale, recording their
amax in the cast, instead of an amax pass, a scale update and a memset before each weight's cast (108 weights at d36:
324 launches and 1.4 GB less a step). ``FastOptions.fp8_fused_epilogues``: "bias" in it fuses cuBLASLt's BIAS
epilogue into the QKV and MLP-out forward GEMMs instead of an ``add_bias`` pass after each.

Prediction written before the first run (from the traffic model): the op alone ~25 % less time (9 bytes per element
instead of 12: the add's 6, then 3 instead of 6); at d36 B = 16 (72 such LayerNorms of 16384 × 1280) ~4.5 GB less per
step, ~1.5 ms of the ~145 ms FP8 step on an H100 (~1.0 %), ~1.2 ms of ~137 ms on an H200. The weights' delayed
scaling: ~0.5-0.8 ms for the launches (~2 µs each in a graph) and ~0.4 ms for the bytes, ~0.7 % of the step.
"""

from __future__ import annotations

import statistics
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step
from llmgpu.model import FastOptions, GPTConfig
from llmgpu.ops.fp8 import fp8_cast
from llmgpu.ops.fp8_layernorm import fp8_add_layernorm
from llmgpu.ops.layernorm import add_layernorm_forward
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch5b" / "ch5b_layernorm_casts.json"
_ON = FastOptions()
# label: the FastOptions fields that differ from the defaults (the first setting: none)
SETTINGS = {"defaults": {}, "bf16 layernorm + cast": {"fp8_layernorm_casts": False},
            "weights current": {"fp8_delayed_weights": False},
            "bias unfused": {"fp8_fused_epilogues": tuple(e for e in _ON.fp8_fused_epilogues if e != "bias")}}


def parse_args(argv):
    ap = _common.parser(__doc__, reps=10, no_torch=False)
    ap.add_argument("--preset", default="d36")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of --reps steps each (default 4)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, the first is the baseline (default: all, {', '.join(SETTINGS)})")
    args = ap.parse_args(argv)
    args.settings = _common.names(args.settings)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        ap.error(f"--settings takes {', '.join(SETTINGS)}; got {', '.join(unknown) or 'none'}")
    return args


def _op_alone(n, c, dt, xp, reps):
    """The op at the step's shape: median ms and GB/s of the fused LayerNorm + transpose and of the unfused pair."""
    rng = np.random.default_rng(0)
    a, b = (backend.to_device(rng.standard_normal((n, c), dtype=np.float32).astype(dt), xp) for _ in range(2))
    gamma, beta = (backend.to_device(np.ones(c, np.float32).astype(dt), xp) for _ in range(2))
    scale, amax, sinv = (backend.to_device(np.array([v], np.float32), xp) for v in (16.0, 0.0, 1.0))
    it = np.dtype(dt).itemsize
    add = 3 * n * c * it  # read a, b; write s (both forms)
    cases = {"layernorm writes fp8": (lambda: fp8_add_layernorm(a, b, gamma, beta, scale, residual_out=b,
                                                                transpose=True, amax=amax, accumulate_amax=True,
                                                                scale_inv=sinv), add + 3 * n * c),
             "bf16 layernorm + cast": (lambda: fp8_cast(add_layernorm_forward(a, b, gamma, beta, residual_out=b)[1],
                                                        scale, "e4m3", transpose=True, amax=amax,
                                                        accumulate_amax=True, scale_inv=sinv), add + 2 * n * c * it
                                       + 2 * n * c)}
    out = {}
    for label, (fn, nbytes) in cases.items():
        ms = timing.time_fn(fn, xp=xp, warmup=3, reps=reps).median_ms
        out[label] = {"ms": ms, "bytes": nbytes, "gbps": _common.gbps(nbytes, ms)}
        print(f"{label:<22} alone: {ms:7.3f} ms, {out[label]['gbps']:6.0f} GB/s ({nbytes / 1e6:.0f} MB)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    cfg = GPTConfig.preset("tiny" if quick else args.preset)
    b, t = (2, 64) if quick else (args.batch, args.seq)
    dt = "bf16" if on_gpu else "fp32"
    rounds, reps = (1, 2) if quick else (max(1, args.rounds), args.reps)
    n, c = b * t, cfg.n_embd
    ceiling = _common.copy_ceiling(xp, 2 * n * c * 2) if on_gpu else None
    alone = _op_alone(n, c, backend.resolve_dtype(dt), xp, reps) if on_gpu else {}
    options = {label: FastOptions(fp8="delayed", **SETTINGS[label]) for label in args.settings}
    times = _common.alternating_step_times(
        {label: (lambda o=o: make_train_step(cfg, b, t, dtype=dt, xp=xp, fast=True, graph=on_gpu, options=o))
         for label, o in options.items()}, xp, rounds, reps)
    rows = []
    for label, o in options.items():
        ms = statistics.median(times[label])
        rows.append({"case": label, "fp8_layernorm_casts": o.fp8_layernorm_casts,
                     "fp8_delayed_weights": o.fp8_delayed_weights, "fp8_fused_epilogues": list(o.fp8_fused_epilogues),
                     "ms_per_step": ms, "ms_min": min(times[label]), "tokens_per_s": b * t / (ms * 1e-3),
                     "steps_timed": len(times[label])})
        print(f"{label:<22} {ms:9.3f} ms/step  {rows[-1]['tokens_per_s'] / 1e3:8.1f} K tokens/s")
    base = rows[0]["ms_per_step"]
    gains = {r["case"]: r["ms_per_step"] / base for r in rows[1:]}
    print(f"{rows[0]['case']} over " + ", ".join(f"{k}: {v:.4f}x" for k, v in gains.items()))
    payload = {"benchmark": "ch5b_layernorm_casts", "preset": "tiny" if quick else args.preset, "batch": b, "seq": t,
               "dtype": dt, "fp8_recipe": "delayed", "rounds": rounds, "reps": reps, "rows": rows,
               "baseline": rows[0]["case"], "baseline_over": gains, "op_alone": alone, "copy_ceiling_gbps": ceiling}
    out = args.out or (RESULTS if on_gpu and not quick else None)
    _common.save(out, payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
