"""Chapter 8 benchmark (issue 19): the fused cross-entropy of the LM head and the embedding backward into fp32.

    python benchmarks/bench_ch8_head_items.py            # GPU: writes benchmarks/results/ch8/ch8_head_items.json
    python benchmarks/bench_ch8_head_items.py --quick    # B = 16 only, fewer steps (the default on a CPU: a
                                                         # NumPy smoke test of the four settings; nothing written)

Two fields of ``FastOptions`` (``llmgpu/model/fast.py``), A/B in one process: ``fused_cross_entropy`` (each chunk's
cross-entropy forward and backward as one kernel, ``cross_entropy_forward_backward``: one read of the logits
instead of two) and ``embedding_grad_into_fp32`` (the counting-sort embedding backward adds its fp32 row sums
into the fp32 gradients, touched rows only, instead of a bf16 ``[Vp, C]`` array that is cast and added).
GPT-2 124M, bf16, T = 1024, vocabulary 50304, the fast step as one CUDA graph: each of the four settings gets
its own model and graph (built with its options), and the graphs' replays are
timed in alternating rounds, so drift (clocks, heat) falls on all four alike. Reported: median ms/step and
tokens/s per setting (B = 16, and B = 64 for both off and both on unless ``--quick``), the isolated kernels at
the step's shapes (CE forward + backward vs the fused kernel on one chunk of 8192 x 50304; embedding backward
+ the two casts-and-adds vs the accumulating backward at B = 16), and each setting's loss and gradients
against both off (one forward + backward from the same weights and batch).

Prediction written before the first run: the fused CE saves one read of the logits, 16384 x 50304 x 2 B =
1.65 GB per B = 16 step, ~0.35-0.4 ms of ~28 ms (kernel: ~0.4 ms per 8192-row chunk against ~0.8 for forward
+ backward); the embedding item saves ~0.2-0.3 ms per B = 16 step (no [50304, 768] bf16 write, no fp32 cast
temporary, no read-modify-write of all 50304 rows); together ~2 % at B = 16.
"""

from __future__ import annotations

import statistics
import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step, release_memory
from llmgpu.model import FastGPT, FastOptions, GPTConfig
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch8" / "ch8_head_items.json"
COMBOS = ((False, False), (True, False), (False, True), (True, True))  # (fused_cross_entropy, embedding_grad_into_fp32)


def _label(combo):
    f, e = combo
    return f"fused CE {'on ' if f else 'off'} / emb->fp32 {'on ' if e else 'off'}"


def _options(combo):
    return FastOptions(fused_cross_entropy=combo[0], embedding_grad_into_fp32=combo[1])


def _correctness(cfg, batch, seq, dtype, xp, combos):
    """Per setting: (loss, relative loss difference, gradient ||diff|| / ||ref||, max |diff| / max |ref|)
    against both off, from one forward + backward of fresh models with the same weights and batch."""
    rng = np.random.default_rng(0)
    idx = backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
    tgt = backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
    out, ref = {}, None
    for combo in combos:
        m = FastGPT(cfg, dtype=dtype, xp=xp, seed=0, options=_options(combo))
        loss = float(m.forward_backward(idx, tgt))
        g = m.params.grad.astype(np.float64)
        if ref is None:
            ref = (loss, g)
        rl, rg = ref
        dg = g - rg
        out[_label(combo)] = {
            "loss": loss, "loss_rel_diff": abs(loss - rl) / abs(rl),
            "grad_rel_diff": float(xp.linalg.norm(dg) / xp.linalg.norm(rg)),
            "grad_max_rel_diff": float(xp.abs(dg).max() / xp.abs(rg).max()),
        }
        del m, g, dg
        release_memory()
    return out


def _steps(cfg, batch, seq, dtype, xp, on_gpu, combos, rounds, steps):
    """Median ms per step of each setting's step (one CUDA graph on a GPU), timed in alternating rounds."""
    by_label = _common.alternating_step_times(
        {_label(c): (lambda c=c: make_train_step(cfg, batch, seq, dtype=dtype, xp=xp, fast=True, graph=on_gpu,
                                                 options=_options(c))) for c in combos}, xp, rounds, steps)
    times = {c: by_label[_label(c)] for c in combos}
    rows = []
    for combo in combos:
        ms = statistics.median(times[combo])
        rows.append({"case": _label(combo), "fused_cross_entropy": combo[0], "embedding_grad_into_fp32": combo[1],
                     "batch": batch, "seq": seq, "ms_per_step": ms, "ms_min": min(times[combo]),
                     "tokens_per_s": batch * seq / (ms * 1e-3), "steps_timed": len(times[combo])})
    release_memory()
    return rows


def _kernels(xp, ceiling, quick):
    """The isolated kernels at the step's shapes: median ms and GB/s (bytes each must move)."""
    from llmgpu.model.base import accumulate_grad
    from llmgpu.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward, cross_entropy_forward_backward
    from llmgpu.ops.embedding import embedding_backward

    rng = np.random.default_rng(1)
    reps = 10 if quick else 30  # the random inputs are made on the device: no GB-sized host arrays
    n, v = 8192, 50304  # one chunk of the LM head
    xp.random.seed(1)
    logits = (xp.random.standard_normal((n, v), dtype=np.float32) * 2).astype(backend.bfloat16)
    t = xp.asarray(rng.integers(0, 50257, n).astype(np.int32))
    logits[:, 50257:] = -1e4
    buf = xp.empty_like(logits)
    n_total = xp.asarray(2 * n, dtype=np.int32)  # the count of a B = 16 batch, as in the step

    def ce_old():
        _, cache = cross_entropy_forward(logits, t, method="fast")
        cross_entropy_backward(cache, 1.0, out=buf)

    def ce_new():
        cross_entropy_forward_backward(logits, t, 1.0, n_total, out=buf)

    b, seq, c = 16, 1024, 768
    dx = xp.random.standard_normal((b, seq, c), dtype=np.float32).astype(backend.bfloat16)
    idx = xp.asarray(rng.integers(0, 50257, (b, seq)).astype(np.int32))
    g_te, g_pe = xp.zeros((v, c), np.float32), xp.zeros((1024, c), np.float32)

    def emb_old():
        dwte, dwpe = embedding_backward(dx, idx, v, 1024, method="counting")
        accumulate_grad(g_te, dwte)
        accumulate_grad(g_pe, dwpe)

    def emb_new():
        embedding_backward(dx, idx, v, 1024, method="counting", dwte_out=g_te, dwpe_out=g_pe, accumulate=True)

    lb = n * v * 2
    touched = int(xp.unique(idx).size)
    cases = [
        ("CE fwd + bwd (fast, fused bwd)", ce_old, 3 * lb),
        ("CE fused fwd+bwd", ce_new, 2 * lb),
        ("embedding bwd + 2x cast/add", emb_old, b * seq * c * 2 + (v + 1024) * c * (2 + 2 + 4 + 4 + 4 + 4)),
        ("embedding bwd into fp32", emb_new, b * seq * c * 2 + (touched + seq) * c * 8),
    ]
    rows = []
    for label, fn, nbytes in cases:
        tm = timing.time_fn(fn, xp=xp, warmup=3, reps=reps)
        rows.append({"kernel": label, "ms": tm.median_ms, "bytes": nbytes, "gbps": nbytes / (tm.median_ms * 1e-3) / 1e9,
                     "of_copy_ceiling": nbytes / (tm.median_ms * 1e-3) / 1e9 / ceiling})
        print(f"{label:>34}: {tm.median_ms:7.3f} ms  {rows[-1]['gbps']:6.0f} GB/s (bytes it must move; "
              f"{100 * rows[-1]['of_copy_ceiling']:.0f}% of copy)", flush=True)
    return rows  # the inputs go with this frame; main calls release_memory


def main(argv=None):
    ap = _common.parser(__doc__, reps=None)
    ap.add_argument("--steps", type=int, help="timed steps per setting per round (default 10 on a GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    if on_gpu:
        preset, dtype, seq = "gpt2", "bf16", 1024
        batches = [(16, COMBOS)] + ([] if quick else [(64, (COMBOS[0], COMBOS[3]))])
        steps = a.steps or (5 if quick else 10)
    else:  # NumPy: the tiny model in fp32, every setting once (a smoke test)
        preset, dtype, seq = "tiny", "fp32", 64
        batches, steps = [(4, COMBOS)], a.steps or 1
    rounds = a.rounds if on_gpu else 1
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    payload = {"benchmark": "ch8_head_items", "preset": preset, "dtype": dtype, "seq": seq, "graph": on_gpu,
               "vocab": 50304 if on_gpu else None, "rows": [], "correctness": {}, "kernels": []}
    if on_gpu:
        payload["kernels"] = _kernels(xp, _common.copy_ceiling(xp, 2**30), quick)
        release_memory()
    for batch, combos in batches:
        rows = _steps(cfg, batch, seq, dtype, xp, on_gpu, combos, rounds, steps)
        base = rows[0]["ms_per_step"]
        for r in rows:
            r["speedup_vs_both_off"] = base / r["ms_per_step"]
            print(f"B={batch:<3} {r['case']}: {r['ms_per_step']:8.2f} ms/step  {r['tokens_per_s']:10,.0f} tok/s  "
                  f"{r['speedup_vs_both_off']:.4f}x", flush=True)
        payload["rows"] += rows
        if payload["correctness"]:
            continue
        corr = _correctness(cfg, batch, seq, dtype, xp, combos)
        payload["correctness"][f"B={batch}"] = corr
        for label, c in corr.items():
            print(f"   {label}: loss {c['loss']:.6f} (rel diff {c['loss_rel_diff']:.1e}), grads rel diff "
                  f"{c['grad_rel_diff']:.1e}, max {c['grad_max_rel_diff']:.1e}", flush=True)
    r16 = [r for r in payload["rows"] if r["batch"] == payload["rows"][0]["batch"]]
    print(f"both on / both off: {r16[-1]['ms_per_step'] / r16[0]['ms_per_step']:.4f}x time at B={r16[0]['batch']}"
          + ("" if on_gpu and not quick else " (smoke test)"))
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
