"""Chapter 8 benchmark (issue 19): the fused cross-entropy's row staged in shared memory by cp.async.

    python benchmarks/bench_ch8_ce_staging.py          # GPU: writes benchmarks/results/ch8_ce_staging.json
    python benchmarks/bench_ch8_ce_staging.py --quick  # B = 16 only, fewer steps (the default on a CPU: a NumPy
                                                       # smoke test of the step A/B; nothing written)

``cross_entropy_forward_backward`` (one block per row of logits) keeps the row in shared memory between its two
sweeps. With ``FB_STAGE_ASYNC`` off (the kernel's STAGE = 1) each thread loads four 16-byte packs at a time into
registers, stores them to shared memory and folds them into its running (max, sum); three such rounds make a
GPT-2 row. With it on (STAGE = 2) each thread first sends all of its packs of the row to shared memory by
cp.async, so the whole 100 KB row is in flight at once and no registers wait on it, then folds them from shared
memory. In chapter 8's per-op table the fused kernel runs at 73 % of the copy bandwidth, the LM head's GEMMs
around it at 85-98 % of the GEMM ceiling.

Measured, A/B in one process: the kernel alone on one chunk of the step (8192 x 50304 bf16, in place), both
settings alternated; the captured GPT-2 124M step (bf16, T = 1024, vocabulary 50304) with the switch off and on,
one CUDA graph each, alternating rounds (B = 16, and B = 64 unless ``--quick``); the loss and gradients of one
step with each setting (the same arithmetic on the same values: the same bits).

Prediction written before the first run: bytes in flight per SM rise from at most 64 KB (two blocks, 32 KB each
in their first sweep) to a row per block, so the kernel goes from 73 % to ~88 % of the copy bandwidth: 0.53 ->
0.44 ms per chunk, -0.7 ms per B = 64 step (eight chunks, -0.65 %) and -0.2 ms per B = 16 step.
"""

from __future__ import annotations

import statistics
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step, release_memory
from llmgpu.model import FastGPT, GPTConfig
from llmgpu.ops import cross_entropy as ce
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch8_ce_staging.json"
SETTINGS = {"registers (STAGE = 1)": False, "cp.async (STAGE = 2)": True}


def _switch(on: bool):
    return lambda: setattr(ce, "FB_STAGE_ASYNC", on)


def _kernel(xp, ceiling, reps):
    """The fused kernel alone on one chunk, in place (as in the step), the settings alternated five times."""
    n, v = 8192, 50304
    xp.random.seed(3)
    logits = (xp.random.standard_normal((n, v), dtype=np.float32) * 2).astype(backend.bfloat16)
    logits[:, 50257:] = -1e4
    t = xp.asarray(np.random.default_rng(3).integers(0, 50257, n).astype(np.int32))
    n_total = xp.asarray(2 * n, dtype=np.int32)

    def run():  # in place, as the step does it; the values the next call reads stay finite
        ce.cross_entropy_forward_backward(logits, t, 1.0, n_total, out=logits)

    nbytes = 2 * n * v * 2
    ms = {label: [] for label in SETTINGS}
    for _ in range(5):
        for label, on in SETTINGS.items():
            _switch(on)()
            ms[label].append(timing.time_fn(run, xp=xp, warmup=3, reps=reps).median_ms)
    rows = []
    for label, vals in ms.items():
        m = statistics.median(vals)
        gb = _common.gbps(nbytes, m)
        rows.append({"kernel": f"CE fused fwd+bwd, {label}", "rows": n, "vocab": v, "ms": m, "ms_rounds": vals,
                     "bytes": nbytes, "gbps": gb, "of_copy_ceiling": gb / ceiling})
        print(f"CE fused fwd+bwd [{n} x {v}] bf16, {label:>22}: {m:.4f} ms  {gb:6.0f} GB/s "
              f"({100 * gb / ceiling:.0f}% of copy)", flush=True)
    return rows


def _same_step(cfg, batch, seq, dtype, xp):
    """One forward + backward per setting from the same weights and batch: are loss and gradients the same bits?"""
    rng = np.random.default_rng(0)
    idx, tgt = (backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
                for _ in range(2))
    out = []
    for on in SETTINGS.values():
        _switch(on)()
        m = FastGPT(cfg, dtype=dtype, xp=xp, seed=0)
        out.append((float(m.forward_backward(idx, tgt)), backend.to_numpy(m.params.grad).tobytes()))
        del m
        release_memory()
    return {"loss_equal": out[0][0] == out[1][0], "grads_bitwise_equal": out[0][1] == out[1][1]}


def main(argv=None):
    ap = _common.parser(__doc__, reps=20)
    ap.add_argument("--steps", type=int, help="timed steps per setting per round (default 10 on a GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    default = ce.FB_STAGE_ASYNC
    if on_gpu:
        preset, dtype, seq = "gpt2", "bf16", 1024
        batches = [16] if quick else [16, 64]
        steps = a.steps or (5 if quick else 10)
    else:  # NumPy: the tiny model in fp32 (a smoke test; NumPy has no kernel to stage)
        preset, dtype, seq, batches, steps = "tiny", "fp32", 64, [4], a.steps or 1
    rounds = a.rounds if on_gpu else 1
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    payload = {"benchmark": "ch8_ce_staging", "preset": preset, "dtype": dtype, "seq": seq, "graph": on_gpu,
               "rows": [], "kernels": [], "same_bits": {}}
    try:
        if on_gpu:
            payload["kernels"] = _kernel(xp, _common.copy_ceiling(xp, 2**30), a.reps)
            release_memory()
        for batch in batches:
            times = _common.alternating_step_times(
                {label: _switch(on) for label, on in SETTINGS.items()},
                lambda: make_train_step(cfg, batch, seq, dtype=dtype, xp=xp, fast=True, graph=on_gpu), xp, on_gpu,
                rounds, steps)
            base = statistics.median(next(iter(times.values())))
            for label, ms_list in times.items():
                ms = statistics.median(ms_list)
                payload["rows"].append({"case": label, "fb_stage_async": SETTINGS[label], "batch": batch, "seq": seq,
                                        "ms_per_step": ms, "ms_min": min(ms_list),
                                        "tokens_per_s": batch * seq / (ms * 1e-3), "steps_timed": len(ms_list),
                                        "speedup": base / ms})
                print(f"B={batch:<3} {label:>22}: {ms:8.2f} ms/step  {batch * seq / (ms * 1e-3):10,.0f} tok/s  "
                      f"{base / ms:.4f}x", flush=True)
            release_memory()
        same = payload["same_bits"] = _same_step(cfg, min(batches[0], 8), seq, dtype, xp)
        print(f"one step, the two settings: loss equal {same['loss_equal']}, gradients bitwise equal "
              f"{same['grads_bitwise_equal']}", flush=True)
    finally:
        _switch(default)()
    r = payload["rows"]
    print(f"cp.async / registers: {r[1]['ms_per_step'] / r[0]['ms_per_step']:.4f}x time at B={r[0]['batch']}"
          + ("" if on_gpu and not quick else " (smoke test)"))
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
