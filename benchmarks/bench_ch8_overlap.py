"""Chapter 8 benchmark (issue 19): weight gradients on a second stream, beside the chain of input gradients.

    python benchmarks/bench_ch8_overlap.py            # GPU: writes benchmarks/results/ch8_overlap.json
    python benchmarks/bench_ch8_overlap.py --quick    # B = 16 only, fewer steps (the default on a CPU: a
                                                      # NumPy smoke test; nothing written)

Two switches of ``llmgpu/model/fast.py`` (``model/overlap.py``): ``OVERLAP_WEIGHT_GRADS`` ("blocks": each
block's four weight-gradient GEMMs and bias-gradient reductions on a side stream, beside the chain of input
gradients, instead of between its links) and ``OVERLAP_HEAD_WGRAD`` ("head": each LM-head chunk's weight
gradient on it, beside the next chunk's logits GEMM and cross-entropy). GPT-2 124M, bf16, T = 1024,
vocabulary 50304, the fast step as one CUDA graph; every setting gets its own model and graph (the switches
are read while the step is captured), and the graphs' replays are timed in alternating rounds, so drift
falls on all settings alike. A fifth setting at B = 16 also lets cuDNN's attention backward use its default
(non-deterministic, dQ by atomics) algorithm, to price the determinism that bit-exact resume needs. Beside
the steps: cuDNN's backward alone at B = 64, both algorithms. Correctness: the loss and gradients with both
switches on against the serial step's, bit for bit.

Prediction written before the first run: "blocks" hides part of the 19 ms of weight and bias gradients, but
the weight GEMMs compete with the chain's GEMMs for the same tensor cores and a full-size GEMM block leaves no
room on its SM for another kernel's, so the gain comes from partial waves, the memory-bound kernels (bias
reductions, LayerNorm backward) and gaps: 1-3 ms of the 106-109 ms B = 64 step (1-3 %), 2-4 % at B = 16.
"head": the cross-entropy (0.5 ms per chunk, memory-bound) beside the previous chunk's weight GEMM (0.8 ms):
0.5-1.5 ms at B = 64. cuDNN's non-deterministic backward: 5-15 % faster than the deterministic one.
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

RESULTS = _common.RESULTS_DIR / "ch8_overlap.json"
# name -> (OVERLAP_WEIGHT_GRADS, OVERLAP_HEAD_WGRAD, cuDNN DETERMINISTIC_BACKWARD)
SETTINGS = {"serial": (False, False, True), "blocks": (True, False, True), "head": (False, True, True),
            "blocks + head": (True, True, True), "blocks + head, cuDNN non-det.": (True, True, False)}


def _set(name):
    from llmgpu.ops import cudnn_attention

    fast.OVERLAP_WEIGHT_GRADS, fast.OVERLAP_HEAD_WGRAD, cudnn_attention.DETERMINISTIC_BACKWARD = SETTINGS[name]


def _bitwise(cfg, batch, seq, dtype, xp):
    """The side stream's loss and gradients against the serial step's (fresh models, same weights and
    batch, two micro-batches accumulated): equal bit for bit, and the largest difference."""
    rng = np.random.default_rng(0)
    batches = [tuple(backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
                     for _ in range(2)) for _ in range(2)]
    out = {}
    for name in ("serial", "blocks + head"):
        _set(name)
        m = FastGPT(cfg, dtype=dtype, xp=xp, seed=0)
        losses = [m.forward_backward(i, t) for i, t in batches]
        out[name] = ([float(v) for v in losses], m.params.grad.copy())
        del m
        release_memory()
    (l0, g0), (l1, g1) = out["serial"], out["blocks + head"]
    res = {"losses_equal": l0 == l1, "grads_bitwise_equal": bool(xp.all(g0 == g1)),
           "grad_max_abs_diff": float(xp.abs(g1.astype(np.float64) - g0).max())}
    print(f"side stream vs serial (B={batch}): losses equal {res['losses_equal']}, gradients bit for bit "
          f"{res['grads_bitwise_equal']} (max |diff| {res['grad_max_abs_diff']:.3g})", flush=True)
    return res


def _steps(cfg, batch, seq, dtype, xp, on_gpu, names, rounds, steps):
    """Median ms per step of each setting's step (one CUDA graph on a GPU), timed in alternating rounds."""
    runs = {}
    for name in names:
        _set(name)
        run, _ = make_train_step(cfg, batch, seq, dtype=dtype, xp=xp, fast=True, graph=on_gpu)
        for _ in range(3):  # two eager steps, then the capture (graph) -- all with this setting
            run()
        runs[name] = run
    times = {n: [] for n in names}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name] += _gpu_times(run, xp, steps) if on_gpu else _host_times(run, steps)
    rows = []
    for name in names:
        ms = statistics.median(times[name])
        blocks, head, det = SETTINGS[name]
        rows.append({"case": name, "overlap_weight_grads": blocks, "overlap_head_wgrad": head,
                     "cudnn_deterministic_backward": det,
                     "batch": batch, "seq": seq, "ms_per_step": ms, "ms_min": min(times[name]),
                     "tokens_per_s": batch * seq / (ms * 1e-3), "steps_timed": len(times[name])})
    del runs
    release_memory()
    return rows


def _gpu_times(run, xp, steps):
    """ms of each of ``steps`` back-to-back calls, from CUDA events (launch cost included, as in training)."""
    evs = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(steps)]
    for a, b in evs:
        a.record()
        run()
        b.record()
    evs[-1][1].synchronize()
    return [xp.cuda.get_elapsed_time(a, b) for a, b in evs]


def _host_times(run, steps):
    import time

    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _cudnn_backward(xp, batch, reps):
    """cuDNN's attention backward alone at GPT-2's shape, deterministic and default: median ms, TFLOP/s."""
    from llmgpu.ops import cudnn_attention
    from llmgpu.ops.flash_attention import flash_attention_backward, flash_attention_forward

    B, H, T, D = batch, 12, 1024, 64
    xp.random.seed(2)
    q, k, v, do = (xp.random.standard_normal((B, H, T, D), dtype=np.float32).astype(backend.bfloat16)
                   for _ in range(4))
    o, stats = flash_attention_forward(q, k, v, causal=True, kernel="cudnn")
    dq, dk, dv = (xp.empty_like(q) for _ in range(3))
    flops = 5.0 * B * H * T * T * D  # five [T, T] x D products of 2 BHTTD FLOPs each, causal: half the scores
    rows = []
    for det in (True, False):
        cudnn_attention.DETERMINISTIC_BACKWARD = det

        def bwd():
            flash_attention_backward(do, q, k, v, o, stats, causal=True, kernel="cudnn", dq=dq, dk=dk, dv=dv)

        tm = timing.time_fn(bwd, xp=xp, warmup=3, reps=reps)
        rows.append({"kernel": f"cuDNN backward, {'deterministic' if det else 'default (atomics)'}", "batch": B,
                     "ms": tm.median_ms, "tflops": flops / (tm.median_ms * 1e-3) / 1e12})
        print(f"{rows[-1]['kernel']:>40} B={B}: {tm.median_ms:7.3f} ms  {rows[-1]['tflops']:5.0f} TFLOP/s", flush=True)
    cudnn_attention.DETERMINISTIC_BACKWARD = True
    return rows


def _concurrency(xp, reps):
    """Does work on the side stream run at the same time as the main stream's? Pairs of kernels timed one
    after the other on one stream and split over the two (``SideStream``): ms each way."""
    from llmgpu.gemm.cublaslt import lt_gemm
    from llmgpu.model.overlap import SideStream
    from llmgpu.ops.linear import bias_grad
    from llmgpu.perf.timing import gpu_spin

    xp.random.seed(3)
    N, C = 65536, 768
    bf = backend.bfloat16
    df = xp.random.standard_normal((N, 4 * C), dtype=np.float32).astype(bf)
    h2 = xp.random.standard_normal((N, C), dtype=np.float32).astype(bf)
    w = xp.random.standard_normal((4 * C, C), dtype=np.float32).astype(bf)
    dh, db = xp.empty((N, C), bf), xp.zeros(4 * C, np.float32)
    dw = xp.zeros((4 * C, C), np.float32)
    pairs = {
        "two 2 ms spin kernels (1 block each)": (lambda: gpu_spin(2.0), lambda: gpu_spin(2.0)),
        "fc dgrad GEMM + fc bias gradient": (lambda: lt_gemm(df, w, out=dh),
                                             lambda: bias_grad(df, out=db, accumulate=True)),
        "fc dgrad GEMM + fc weight-gradient GEMM": (lambda: lt_gemm(df, w, out=dh),
                                                    lambda: lt_gemm(df, h2, trans_a=True, out=dw, beta=1.0)),
    }
    side = SideStream(xp)
    rows = []
    for label, (a, b) in pairs.items():
        def serial():
            a()
            b()

        def split():
            side.run(b)
            a()
            side.join()

        ms = {how: timing.time_fn(fn, xp=xp, warmup=3, reps=reps).median_ms for how, fn in
              (("one stream", serial), ("two streams", split))}
        rows.append({"pair": label, "ms_one_stream": ms["one stream"], "ms_two_streams": ms["two streams"]})
        print(f"{label:>40}: {ms['one stream']:7.3f} ms on one stream, {ms['two streams']:7.3f} ms on two",
              flush=True)
    return rows


def main(argv=None):
    ap = _common.parser(__doc__, reps=None)
    ap.add_argument("--steps", type=int, help="timed steps per setting per round (default 10 on a GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    from llmgpu.ops import cudnn_attention

    default = (fast.OVERLAP_WEIGHT_GRADS, fast.OVERLAP_HEAD_WGRAD, cudnn_attention.DETERMINISTIC_BACKWARD)
    both = ("serial", "blocks + head")
    if on_gpu:
        preset, dtype, seq = "gpt2", "bf16", 1024
        batches = [(16, tuple(SETTINGS))] + ([] if quick else [(64, tuple(SETTINGS)[:4])])
        steps = a.steps or (5 if quick else 10)
    else:  # NumPy: the tiny model in fp32, a smoke test (the cuDNN switch does nothing there)
        preset, dtype, seq = "tiny", "fp32", 64
        batches, steps = [(4, both)], a.steps or 1
    rounds = a.rounds if on_gpu else 1
    cfg = GPTConfig.preset(preset, pad_vocab_to=64)
    payload = {"benchmark": "ch8_overlap", "preset": preset, "dtype": dtype, "seq": seq, "graph": on_gpu,
               "vocab": 50304 if on_gpu else None, "rows": [], "bitwise": {}, "kernels": []}
    try:
        if on_gpu:
            payload["kernels"] = _cudnn_backward(xp, 64, 10 if quick else 30)
            release_memory()
            payload["concurrency"] = _concurrency(xp, 10 if quick else 30)
            release_memory()
        payload["bitwise"] = _bitwise(cfg, 16 if on_gpu else 4, seq, dtype, xp)
        for batch, names in batches:
            rows = _steps(cfg, batch, seq, dtype, xp, on_gpu, names, rounds, steps)
            base = rows[0]["ms_per_step"]
            for r in rows:
                r["speedup_vs_serial"] = base / r["ms_per_step"]
                print(f"B={batch:<3} {r['case']:>28}: {r['ms_per_step']:8.2f} ms/step  {r['tokens_per_s']:10,.0f} "
                      f"tok/s  {r['speedup_vs_serial']:.4f}x", flush=True)
            payload["rows"] += rows
    finally:
        fast.OVERLAP_WEIGHT_GRADS, fast.OVERLAP_HEAD_WGRAD, cudnn_attention.DETERMINISTIC_BACKWARD = default
    assert payload["bitwise"]["grads_bitwise_equal"] and payload["bitwise"]["losses_equal"], payload["bitwise"]
    _common.save(a.out or (RESULTS if on_gpu and not quick else None), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
