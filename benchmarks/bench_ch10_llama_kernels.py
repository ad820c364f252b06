"""Chapter 10 benchmark: the Llama step's memory-bound kernels (RMSNorm, RoPE) at SmolLM-360M sizes, old against new.

    python benchmarks/bench_ch10_llama_kernels.py            # GPU: SmolLM-360M, B = 32, T = 1024, bf16; writes the JSON
    python benchmarks/bench_ch10_llama_kernels.py --quick    # small sizes (the default on CPU)

Issue 36's profile of the fast step found the norms' backward (with the residual gradient, in place, dweight
accumulated into the fp32 gradient buffer: the model's call) at 72-74 % of the copy bandwidth and RoPE at
~78 %, where the forward norms reach 94-96 %. Each line reports the minimum bytes (``traffic_bytes``; RoPE:
q and k read and written once) per time against two copies measured in the same run: a device-to-device copy
of the same bytes (``pct_of_copy``, the fair bar at this size) and of 2 GiB (``pct_of_big_copy``, the figure
``tools/probes/profile_step.py`` divides by). Both methods ("optimized", "fast") of the RMSNorm backward and of
RoPE are timed alternately in ``--rounds`` rounds (median of the round medians), and their results compared in
the same run (max relative difference, bitwise equality; ``dweight``: relative norm difference). Rows of
N = B·T = 32768, C = 960; RoPE on the q and k heads (15 + 5 of D = 64) of the fused q|k|v rows [B, T, 25, 64],
in place.

On the GPU the results go to benchmarks/results/ch10/llama_kernels.json; on the CPU (NumPy, a smoke test of the
script) nothing is written unless --out is given.
"""

from __future__ import annotations

import sys

import _common
import numpy as np

from llmgpu import backend
from llmgpu.model.llama_config import LlamaConfig
from llmgpu.ops import rmsnorm as rms
from llmgpu.ops import rope
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch10" / "llama_kernels.json"


def parse_args(argv):
    ap = _common.parser(__doc__, reps=30, no_torch=False)
    ap.add_argument("--preset", default="smollm-360m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every case (default 3)")
    return ap.parse_args(argv)


def _rand(rng, xp, dt, *shape):
    return backend.to_device(rng.standard_normal(shape, dtype=np.float32).astype(dt), xp)


def rmsnorm_cases(xp, rng, n, c, dt):
    """(op, method, fn, bytes) of the norms, in the model's calls."""
    x, w, dy, a = (_rand(rng, xp, dt, *s) for s in ((n, c), (c,), (n, c), (n, c)))
    y, s = xp.empty_like(x), xp.empty_like(x)
    dres = _rand(rng, xp, dt, n, c)
    dw32 = xp.zeros(c, dtype=np.float32)
    _, inv = rms.rmsnorm_forward(x, w)
    dx = xp.empty_like(x)
    cases = [("rmsnorm fwd", "optimized", lambda: rms.rmsnorm_forward(x, w, out=y), rms.traffic_bytes(n, c, dt)),
             ("add+rmsnorm fwd", "optimized", lambda: rms.add_rmsnorm_forward(x, a, w, residual_out=s, out=y),
              rms.traffic_bytes(n, c, dt, residual=True))]
    for m in rms.METHODS:
        cases.append(("rmsnorm bwd", m, lambda m=m: rms.rmsnorm_backward(dy, x, w, inv, dx=dx, dweight=dw32,
                                                                          accumulate=True, method=m),
                      rms.traffic_bytes(n, c, dt, backward=True)))
        # the model's call: dx written over the residual gradient (which therefore drifts run to run: timing only)
        cases.append(("rmsnorm+residual bwd", m,
                      lambda m=m: rms.rmsnorm_backward(dy, x, w, inv, dweight=dw32, accumulate=True, dresidual=dres,
                                                       dx=dres, method=m),
                      rms.traffic_bytes(n, c, dt, backward=True, residual=True)))
    return cases


def compare_methods(xp, rng, n, c, dt):
    """"fast" against "optimized" on the same inputs (the model's call with dresidual, not in place)."""
    x, w, dy, dres = (_rand(rng, xp, dt, *s) for s in ((n, c), (c,), (n, c), (n, c)))
    _, inv = rms.rmsnorm_forward(x, w)
    got = {m: rms.rmsnorm_backward(dy, x, w, inv, dresidual=dres, dweight=xp.zeros(c, dtype=np.float32), method=m)
           for m in rms.METHODS}
    (dx_o, dw_o), (dx_f, dw_f) = (tuple(backend.to_numpy(t).astype(np.float64) for t in got[m]) for m in rms.METHODS)
    plan = rms.fast_backward_plan(n, c, dt, residual=True, xp=xp) if xp is not np else None
    return {"dx_max_rel_diff": float(np.max(np.abs(dx_f - dx_o)) / max(np.max(np.abs(dx_o)), 1e-30)),
            "dx_bitwise_equal": bool(np.array_equal(dx_f, dx_o)),
            "dweight_rel_diff": float(np.linalg.norm(dw_f - dw_o) / max(np.linalg.norm(dw_o), 1e-30)),
            "fast_grid": None if plan is None else {"blocks": plan[1], "threads": plan[2], "smem": plan[3]}}


def rope_cases(xp, rng, cfg, b, t, dt):
    """RoPE in place on q's and k's heads of the fused q|k|v rows, as FastLlama calls it."""
    hd, h, hk = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    qkv = _rand(rng, xp, dt, b, t, h + 2 * hk, hd)
    heads = qkv[:, :, :h + hk]
    cos, sin = rope.rope_tables(t, hd, cfg.rope_theta, xp=xp)
    nbytes = 2 * b * t * (h + hk) * hd * np.dtype(dt).itemsize
    cases = []
    for m in rope.METHODS:
        cases.append(("rope q,k fwd", m, lambda m=m: rope.rope_forward(heads, cos, sin, out=heads, seq_axis=1,
                                                                       method=m), nbytes))
        cases.append(("rope q,k bwd", m, lambda m=m: rope.rope_backward(heads, cos, sin, out=heads, seq_axis=1,
                                                                        method=m), nbytes))
    return cases


def compare_rope(xp, rng, cfg, b, t, dt):
    """RoPE "fast" against "optimized" on the same q|k heads (not in place)."""
    hd, h, hk = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    heads = _rand(rng, xp, dt, b, t, h + 2 * hk, hd)[:, :, :h + hk]
    cos, sin = rope.rope_tables(t, hd, cfg.rope_theta, xp=xp)
    out = {}
    for fn in (rope.rope_forward, rope.rope_backward):
        o, f = (backend.to_numpy(fn(heads, cos, sin, seq_axis=1, method=m)).astype(np.float64) for m in rope.METHODS)
        out[fn.__name__] = {"max_rel_diff": float(np.max(np.abs(f - o)) / max(np.max(np.abs(o)), 1e-30)),
                            "bitwise_equal": bool(np.array_equal(f, o))}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    cfg = LlamaConfig.preset(args.preset)
    b, t = (2, 64) if quick else (args.batch, args.seq)
    dt = backend.resolve_dtype("bf16" if on_gpu else "fp32")
    n, c = b * t, cfg.n_embd
    rng = np.random.default_rng(0)
    cases = rmsnorm_cases(xp, rng, n, c, dt) + rope_cases(xp, rng, cfg, b, t, dt)
    reps = 3 if not on_gpu else args.reps
    big = _common.copy_ceiling(xp, 2**31 if on_gpu and not quick else 2**22)
    same = {}
    for nbytes in sorted({cb for *_, cb in cases}):
        same[nbytes] = timing.copy_bandwidth(nbytes // 2, xp=xp, reps=reps)  # reads + writes nbytes in all
    times = {(op, m): [] for op, m, *_ in cases}
    for _ in range(max(1, args.rounds)):
        for op, m, fn, _nb in cases:
            times[(op, m)].append(timing.time_fn(fn, xp=xp, warmup=2, reps=reps).median_ms)
    rows = []
    print(f"{'op':<22} {'method':<10} {'ms':>8} {'GB/s':>7} {'% copy':>7} {'% big copy':>10}")
    for op, m, _fn, nb in cases:
        ms = float(np.median(times[(op, m)]))
        gbps = _common.gbps(nb, ms)
        rows.append({"op": op, "method": m, "shape": f"{n}x{c}" if "rmsnorm" in op else f"{b}x{t}x{cfg.n_head}+"
                     f"{cfg.n_kv_head}x{cfg.head_dim}", "ms": ms, "round_ms": times[(op, m)], "bytes": nb,
                     "gbps": gbps, "copy_same_bytes_gbps": same[nb], "pct_of_copy": 100 * gbps / same[nb],
                     "pct_of_big_copy": 100 * gbps / big})
        print(f"{op:<22} {m:<10} {ms:8.4f} {gbps:7.0f} {rows[-1]['pct_of_copy']:7.1f} "
              f"{rows[-1]['pct_of_big_copy']:10.1f}")
    agree = compare_methods(xp, rng, n, c, dt)
    print(f"rmsnorm fast vs optimized (with dresidual): {agree}")
    agree_rope = compare_rope(xp, rng, cfg, b, t, dt)
    print(f"rope fast vs optimized: {agree_rope}")
    speed = {op: next(r["ms"] for r in rows if r["op"] == op and r["method"] == "optimized")
             / next(r["ms"] for r in rows if r["op"] == op and r["method"] == "fast")
             for op in ("rmsnorm bwd", "rmsnorm+residual bwd", "rope q,k fwd", "rope q,k bwd")}
    print("fast speedup over optimized: " + ", ".join(f"{k} {v:.3f}x" for k, v in speed.items()))
    payload = {"benchmark": "ch10_llama_kernels", "preset": args.preset, "batch": b, "seq": t,
               "dtype": backend.dtype_name(dt), "copy_ceiling_gbps": big, "rows": rows,
               "fast_vs_optimized": agree, "rope_fast_vs_optimized": agree_rope, "fast_speedup": speed}
    out = args.out or (RESULTS if on_gpu and not quick else None)
    _common.save(out, payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
