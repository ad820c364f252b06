"""Chapter 10 benchmark (issue 36): RoPE's backward folded into the flash attention backward, A/B in one process.

    python benchmarks/bench_ch10_rope_fold.py           # GPU: SmolLM-360M, B = 16, T = 1024, bf16; writes the JSON
    python benchmarks/bench_ch10_rope_fold.py --quick   # a tiny Llama (the default on a CPU: a NumPy smoke test)

``FastOptions.rope_in_attention_backward``: on (our wide backward kernels rotate dq and dk back in registers before
their stores) or off (the attention backward, then ``rope_backward`` in place over q's and k's heads of the
q|k|v gradient rows: one more read and write of them). Both settings get their own model and CUDA graph and are
timed in alternating rounds (``_common.alternating_step_times``), so drift falls on both alike; B = 16 so that
the two 360M models fit on one 80 GB GPU together. Also timed: the attention backward alone at the step's shape
with the fold and with the separate pass, and the fold's gradients against the pass (one forward + backward).

Prediction written before the first run (H100, from the B = 32 profile: "rope q,k bwd" 2.25 ms of 181 ms): the
step ~1.1-1.2 % faster with the fold (the pass gone, the fold's table reads and four more FMAs per stored pair
nearly free); the attention backward alone ~7 % faster with the fold than attention + pass.
"""

from __future__ import annotations

import statistics
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step, release_memory
from llmgpu.model import FastLlama, FastOptions, LlamaConfig
from llmgpu.ops import flash_attention as fa
from llmgpu.ops.rope import rope_backward, rope_tables
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch10" / "ch10_rope_fold.json"
SETTINGS = (("fold", True), ("separate pass", False))


def parse_args(argv):
    ap = _common.parser(__doc__, reps=20)
    ap.add_argument("--preset", default="smollm-360m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of --reps steps each (default 4)")
    return ap.parse_args(argv)


def _attention_alone(cfg, b, t, dt, xp, reps):
    """The attention backward at the step's shape, "ours" with the fold and with the separate pass: median ms."""
    h, hk, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    rng = np.random.default_rng(0)
    buf = backend.to_device(rng.standard_normal((b, t, (h + 2 * hk) * d), dtype=np.float32).astype(dt), xp)
    q, k, v = fa.split_qkv(buf, h, hk)
    o, st = fa.flash_attention_forward(q, k, v, kernel="ours")
    do = backend.to_device(rng.standard_normal(q.shape, dtype=np.float32).astype(dt), xp)
    dbuf = xp.empty_like(buf)
    dq, dk, dv = fa.split_qkv(dbuf, h, hk)
    cos, sin = rope_tables(t, d, cfg.rope_theta, xp=xp)
    out = {}
    for label, fold in SETTINGS:
        def run(fold=fold):
            fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="ours", rope=(cos, sin)
                                        if fold else None)
            if not fold:  # the model's pass: q's and k's heads of the token-major rows, in place
                heads = dbuf.reshape(b, t, h + 2 * hk, d)[:, :, :h + hk]
                rope_backward(heads, cos, sin, out=heads, seq_axis=1)
        out[label] = timing.time_fn(run, xp=xp, warmup=2, reps=reps).median_ms
    return out


def _agreement(cfg, b, t, dt, xp):
    """One forward + backward of fresh models with the same weights and batch: fold against separate pass."""
    rng = np.random.default_rng(1)
    idx, tgt = (backend.to_device(rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32), xp) for _ in range(2))
    res = {}
    for label, fold in SETTINGS:
        m = FastLlama(cfg, dtype=dt, xp=xp, seed=0, options=FastOptions(rope_in_attention_backward=fold))
        res[label] = (float(m.forward_backward(idx, tgt)), m.params.grad.astype(np.float64))
        del m
        release_memory()
    (lf, gf), (lp, gp) = res["fold"], res["separate pass"]
    return {"loss_fold": lf, "loss_pass": lp, "loss_equal": lf == lp,
            "grad_rel_diff": float(xp.linalg.norm(gf - gp) / xp.linalg.norm(gp))}


def main(argv=None) -> int:
    args = parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    cfg = LlamaConfig.preset("llama-tiny" if quick else args.preset)
    b, t = (2, 64) if quick else (args.batch, args.seq)
    dt = "bf16" if on_gpu else "fp32"
    rounds, reps = (1, 2) if quick else (max(1, args.rounds), args.reps)
    agree = _agreement(cfg, b, t, dt, xp)
    print(f"fold vs separate pass: {agree}")
    ours_runs = on_gpu and cfg.head_dim in fa.HEAD_DIMS  # --quick's llama-tiny (D = 32): cuDNN only, nothing to time
    alone = _attention_alone(cfg, b, t, backend.resolve_dtype(dt), xp, reps) if ours_runs else {}
    if alone:
        print("attention backward alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    times = _common.alternating_step_times(
        {label: (lambda fold=fold: make_train_step(cfg, b, t, dtype=dt, xp=xp, fast=True, graph=on_gpu,
                                                   options=FastOptions(rope_in_attention_backward=fold)))
         for label, fold in SETTINGS}, xp, rounds, reps)
    rows = []
    for label, fold in SETTINGS:
        ms = statistics.median(times[label])
        rows.append({"case": label, "rope_in_attention_backward": fold, "batch": b, "seq": t, "ms_per_step": ms,
                     "ms_min": min(times[label]), "tokens_per_s": b * t / (ms * 1e-3),
                     "steps_timed": len(times[label])})
        print(f"{label:<14} {ms:9.3f} ms/step  {rows[-1]['tokens_per_s'] / 1e3:8.1f} K tokens/s")
    speedup = rows[1]["ms_per_step"] / rows[0]["ms_per_step"]
    print(f"fold over separate pass: {speedup:.4f}x")
    payload = {"benchmark": "ch10_rope_fold", "preset": "llama-tiny" if quick else args.preset,
               "batch": b, "seq": t, "dtype": dt, "rounds": rounds, "reps": reps, "rows": rows,
               "fold_over_pass": speedup, "attention_backward_alone_ms": alone, "agreement": agree}
    out = args.out or (RESULTS if on_gpu and not quick else None)
    _common.save(out, payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
