"""Chapter 8 benchmark (issue 19): the projections' bias gradients summed by the LayerNorm backward.

    python benchmarks/bench_ch8_bias_in_layernorm.py          # GPU: writes results/ch8_bias_in_layernorm.json
    python benchmarks/bench_ch8_bias_in_layernorm.py --quick  # B = 16 only, fewer steps (the default on a CPU:
                                                              # a NumPy smoke test; nothing written)

In a pre-LN block the residual gradient ``dx`` that enters ``ln_2``'s backward is the output gradient of the
MLP's projection, and the one entering ``ln_1``'s backward that of the attention's projection. Their bias
gradients are ``Σ_rows dx``: two reductions over ``[N, C]`` per block, each a read of ``B·T·C`` bf16 values.
The fused LayerNorm backward reads ``dx`` anyway (it adds it into its own ``dx``), so with
``BIAS_GRAD_IN_LAYERNORM`` (``llmgpu/model/fast.py``) it also sums it, a third column sum beside dγ and dβ
(``layernorm_backward(..., dresidual_sum_out=)``), and the two bias-gradient kernels go.

Measured, A/B in one process: the captured GPT-2 124M step (bf16, T = 1024, vocabulary 50304) with the switch
off and on, one CUDA graph each, alternating rounds (B = 16, and B = 64 unless ``--quick``); the kernels alone at
the step's shape (the LayerNorm backward with dresidual plus the bias-gradient kernel, against the LayerNorm
backward that also sums dresidual); and the gradients of the two settings from the same weights and batch.

Prediction written before the first run: the profile of 2026-12-01 (B = 64) has the two projections' bias
gradients at 0.96 ms per step (0.040 ms per call at ~2.5 TB/s, 24 calls), the LayerNorm backwards at
0.114 ms per call. The third column sum adds shared-memory work to a kernel that streams four arrays, not
bytes: predicted +0-5 % on the LayerNorm backward (<= 0.14 ms per step) and -0.8 ms per B = 64 step
(-0.75 %), -0.2 ms per B = 16 step.
"""

from __future__ import annotations

import statistics
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step, release_memory
from llmgpu.model import FastGPT, GPTConfig, fast
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch8_bias_in_layernorm.json"
SETTINGS = {"separate bias reductions": False, "bias sums in the LayerNorm backward": True}


def _switch(on: bool):
    return lambda: setattr(fast, "BIAS_GRAD_IN_LAYERNORM", on)


def _gradients(cfg, batch, seq, dtype, xp):
    """Loss and gradient differences of the fold against the separate reductions (same weights, same batch)."""
    rng = np.random.default_rng(0)
    idx, tgt = (backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
                for _ in range(2))
    res = {}
    for label, on in SETTINGS.items():
        _switch(on)()
        m = FastGPT(cfg, dtype=dtype, xp=xp, seed=0)
        res[label] = (float(m.forward_backward(idx, tgt)), m.params.grad.astype(np.float64))
        del m
        release_memory()
    (l0, g0), (l1, g1) = res.values()
    d = g1 - g0
    return {"loss_equal": l0 == l1, "grad_rel_diff": float(xp.linalg.norm(d) / xp.linalg.norm(g0)),
            "grad_max_abs_diff_over_max_abs": float(xp.abs(d).max() / xp.abs(g0).max())}


def _kernels(xp, ceiling, rows, reps):
    """The kernels alone at [rows, 768] bf16: LayerNorm backward with dresidual (+ the bias-gradient kernel)
    against the one that also sums dresidual. Median ms and GB/s of the bytes each must move."""
    from llmgpu.ops.layernorm import layernorm_backward, layernorm_forward
    from llmgpu.ops.linear import bias_grad

    c = 768
    xp.random.seed(2)
    x, dy, dres = ((xp.random.standard_normal((rows, c), dtype=np.float32)).astype(backend.bfloat16)
                   for _ in range(3))
    gamma = xp.ones(c, backend.bfloat16)
    _, mean, rstd = layernorm_forward(x, gamma, gamma)
    dg, db, dsum = (xp.zeros(c, np.float32) for _ in range(3))
    dx = xp.empty_like(x)

    def ln(**kw):
        layernorm_backward(dy, x, gamma, mean, rstd, method="fast", dresidual=dres, dx_out=dx, dgamma_out=dg,
                           dbeta_out=db, accumulate_params=True, **kw)

    ln_bytes = 4 * rows * c * 2 + 8 * rows
    cases = [("LayerNorm backward (dresidual)", lambda: ln(), ln_bytes),
             ("bias gradient of dresidual", lambda: bias_grad(dres, out=dsum, accumulate=True), rows * c * 2),
             ("both", lambda: (ln(), bias_grad(dres, out=dsum, accumulate=True)), ln_bytes + rows * c * 2),
             ("LayerNorm backward summing dresidual", lambda: ln(dresidual_sum_out=dsum), ln_bytes)]
    out = []
    for label, fn, nbytes in cases:
        tm = timing.time_fn(fn, xp=xp, warmup=5, reps=reps)
        gb = _common.gbps(nbytes, tm.median_ms)
        out.append({"kernel": label, "rows": rows, "ms": tm.median_ms, "bytes": nbytes, "gbps": gb,
                    "of_copy_ceiling": gb / ceiling})
        print(f"{label:>38} [{rows} x {c}]: {tm.median_ms:7.4f} ms  {gb:6.0f} GB/s ({100 * gb / ceiling:.0f}% of copy)",
              flush=True)
    return out


def main(argv=None):
    ap = _common.parser(__doc__, reps=30)
    ap.add_argument("--steps", type=int, help="timed steps per setting per round (default 10 on a GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    default = fast.BIAS_GRAD_IN_LAYERNORM
    if on_gpu:
        preset, dtype, seq = "gpt2", "bf16", 1024
        batches = [16] if quick else [16, 64]
        steps = a.steps or (5 if quick else 10)
    else:  # NumPy: the tiny model in fp32 (a smoke test)
        preset, dtype, seq, batches, steps = "tiny", "fp32", 64, [4], a.steps or 1
    rounds = a.rounds if on_gpu else 1
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    payload = {"benchmark": "ch8_bias_in_layernorm", "preset": preset, "dtype": dtype, "seq": seq, "graph": on_gpu,
               "rows": [], "kernels": [], "gradients": {}}
    try:
        if on_gpu:
            ceiling = _common.copy_ceiling(xp, 2**30)
            for b in batches:
                payload["kernels"] += _kernels(xp, ceiling, b * seq, a.reps)
                release_memory()
        for batch in batches:
            times = _common.alternating_step_times(
                {label: _switch(on) for label, on in SETTINGS.items()},
                lambda: make_train_step(cfg, batch, seq, dtype=dtype, xp=xp, fast=True, graph=on_gpu), xp, on_gpu,
                rounds, steps)
            base = statistics.median(next(iter(times.values())))
            for label, ms_list in times.items():
                ms = statistics.median(ms_list)
                payload["rows"].append({"case": label, "bias_grad_in_layernorm": SETTINGS[label], "batch": batch,
                                        "seq": seq, "ms_per_step": ms, "ms_min": min(ms_list),
                                        "tokens_per_s": batch * seq / (ms * 1e-3), "steps_timed": len(ms_list),
                                        "speedup": base / ms})
                print(f"B={batch:<3} {label:>36}: {ms:8.2f} ms/step  {batch * seq / (ms * 1e-3):10,.0f} tok/s  "
                      f"{base / ms:.4f}x", flush=True)
            release_memory()
            g = payload["gradients"][f"B={batch}"] = _gradients(cfg, min(batch, 16), seq, dtype, xp)
            print(f"   gradients, fold vs separate: loss equal {g['loss_equal']}, rel diff {g['grad_rel_diff']:.1e}, "
                  f"max {g['grad_max_abs_diff_over_max_abs']:.1e}", flush=True)
    finally:
        _switch(default)()
    r = payload["rows"]
    print(f"fold / separate: {r[1]['ms_per_step'] / r[0]['ms_per_step']:.4f}x time at B={r[0]['batch']}"
          + ("" if on_gpu and not quick else " (smoke test)"))
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
