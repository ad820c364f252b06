"""Chapter 4 benchmark: fused AdamW (one launch) vs per-tensor launches, cast, grad norm, PyTorch.

On a GPU: GPT-2 124M's real parameter list (148 tensors, 124.4 M parameters), fp32 master weights,
fp32 gradients, bf16 working copy. Bandwidth counts the minimum bytes per parameter:

    AdamW:  read p, g, m, v (16 B) + write p, m, v (12 B) + write bf16 working copy (2 B) = 30 B
    cast:   read fp32 (4 B) + write bf16 (2 B)
    norm:   read fp32 (4 B)
    torch.optim.AdamW(fused=True): 28 B (no working copy)

and compares with the device-to-device copy ceiling measured in the same run. Writes
benchmarks/results/ch4/ch4_adamw.json on a GPU (or to --out). On the CPU it runs tiny sizes on NumPy
(a smoke test) and writes nothing unless --out is given.

    python benchmarks/bench_ch4_adamw.py [--quick] [--out PATH]
"""

from __future__ import annotations

import _common
import numpy as np

import llmgpu
from llmgpu import backend
from llmgpu.amp import cast
from llmgpu.model.config import gpt2_param_shapes
from llmgpu.optim import AdamW, GradClipper
from llmgpu.optim.params import FlatParams
from llmgpu.perf import timing

RESULTS = _common.RESULTS_DIR / "ch4" / "ch4_adamw.json"


def make_params(shapes, xp, working="bf16", seed=0):
    P = FlatParams(shapes, xp=xp, working_dtype=working)
    rng = np.random.default_rng(seed)
    if xp is np:
        P.data[...] = rng.standard_normal(P.numel).astype(np.float32) * 0.02
        P.grad[...] = rng.standard_normal(P.numel).astype(np.float32) * 0.01
    else:
        rs = xp.random.RandomState(seed)
        P.data[...] = rs.standard_normal(P.numel, dtype=np.float32) * 0.02
        P.grad[...] = rs.standard_normal(P.numel, dtype=np.float32) * 0.01
    P.sync_working()
    return P


def torch_adamw(shapes, seed=0):
    """torch.optim.AdamW(fused=True) over the same tensors (fp32 params and grads), or None."""
    try:
        import torch
    except ImportError:
        return None, "torch not importable"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for s in shapes.values():
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)
        p.grad = torch.randn(s, device="cuda", generator=gen) * 0.01
        params.append(p)
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return opt, torch.__version__


def main(argv=None):
    args = _common.parser(__doc__, reps=None, no_torch=False).parse_args(argv)

    xp = llmgpu.default_xp()
    on_gpu = xp is not np
    quick = args.quick or not on_gpu
    shapes = gpt2_param_shapes(n_layer=2, n_embd=64, vocab=1000, block_size=64) if quick else gpt2_param_shapes()
    reps = args.reps or (5 if not on_gpu else 50)
    print(backend.device_info(xp).summary())

    ceiling = timing.copy_bandwidth(2**31 if on_gpu else 2**24, xp=xp, reps=min(reps, 20))
    P = make_params(shapes, xp)
    n_real, n_buf = P.num_parameters, P.numel
    print(f"{len(shapes)} tensors, {n_real:,} parameters (buffer {n_buf:,}); copy ceiling {ceiling:.0f} GB/s\n")

    rows = []

    def record(name, launches, t, nbytes):
        gbps = t.gbps(nbytes)
        rows.append({"kernel": name, "launches": launches, "params": n_real, "median_ms": t.median_ms,
                     "min_ms": t.min_ms, "GB/s": gbps, "pct_of_copy": 100 * gbps / ceiling, "bytes": nbytes})

    fused = AdamW(P, lr=6e-4, weight_decay=0.1)
    per_tensor = AdamW(P, lr=6e-4, weight_decay=0.1, per_tensor=True)
    adamw_bytes = n_real * (16 + 12 + 2)
    record("adamw fused (1 launch)", 1, timing.time_fn(lambda: fused.step(lr=6e-4), xp=xp, reps=reps), adamw_bytes)
    record("adamw fused + zero_grad", 1,
           timing.time_fn(lambda: fused.step(lr=6e-4, zero_grad=True), xp=xp, reps=reps), adamw_bytes + 4 * n_real)
    record(f"adamw per-tensor ({len(shapes)} launches)", len(shapes),
           timing.time_fn(lambda: per_tensor.step(lr=6e-4), xp=xp, reps=reps), adamw_bytes)
    # clip factor on the device, then the step reads it (what the trainer does each step)
    clipper = GradClipper(1.0, xp=xp)
    record("grad norm + clip factor (1 launch)", 1, timing.time_fn(lambda: clipper(P.grad), xp=xp, reps=reps),
           4 * n_real)
    record("cast fp32 -> bf16 (sync_working)", 1,
           timing.time_fn(lambda: cast(P.data, "bf16", out=P.working), xp=xp, reps=reps), 6 * n_real)
    bf = P.working
    out32 = xp.empty(P.numel, dtype=np.float32)
    record("cast bf16 -> fp32", 1, timing.time_fn(lambda: cast(bf, "fp32", out=out32), xp=xp, reps=reps), 6 * n_real)

    torch_info = None
    if on_gpu:
        opt, ver = torch_adamw(shapes)
        if opt is None:
            torch_info = {"skipped": ver}
        else:
            t = timing.time_fn(opt.step, xp=xp, reps=reps)
            record("torch.optim.AdamW(fused=True)", None, t, n_real * 28)
            ours = rows[0]["median_ms"]
            torch_info = {"version": ver, "median_ms": t.median_ms, "ours_over_torch_time": ours / t.median_ms,
                          "speedup_vs_torch": t.median_ms / ours}
            del opt

    print(f"{'kernel':<40} {'launches':>8} {'median ms':>10} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        la = "-" if r["launches"] is None else str(r["launches"])
        print(f"{r['kernel']:<40} {la:>8} {r['median_ms']:>10.3f} {r['GB/s']:>8.0f} {r['pct_of_copy']:>6.1f}%")
    if torch_info and "speedup_vs_torch" in torch_info:
        print(f"\nfused AdamW vs torch fused: {torch_info['speedup_vs_torch']:.2f}x "
              f"(ours {rows[0]['median_ms']:.3f} ms incl. the bf16 copy, torch {torch_info['median_ms']:.3f} ms)")
    elif torch_info:
        print(f"\ntorch: {torch_info['skipped']}")
    speed = rows[2]["median_ms"] / rows[0]["median_ms"]
    print(f"per-tensor / fused time: {speed:.2f}x; fused at {rows[0]['pct_of_copy']:.1f}% of the copy ceiling")

    payload = {"benchmark": "ch4_adamw", "quick": quick, "copy_ceiling_GBps": ceiling, "n_tensors": len(shapes),
               "n_params": n_real, "rows": rows, "torch": torch_info,
               "bytes_per_param": {"adamw": 30, "cast": 6, "grad_norm": 4, "torch_adamw": 28}}
    _common.save(args.out or (RESULTS if on_gpu and not args.quick else None), payload, xp)
    return payload


if __name__ == "__main__":
    main()
