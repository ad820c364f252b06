"""Check and time a pipelined rewrite of the Hopper dK/dV kernel (PIPE = 0 and 1) beside the package's kernels.

    python dev/cuda/flash_bwd_dkdv_wgmma.py                 # checks, then timings; prints a table
    python dev/cuda/flash_bwd_dkdv_wgmma.py --json out.json

``flash_bwd_dkdv_wgmma_pipe`` (``flash_bwd_dkdv_wgmma.cu``) is the package's ``flash_bwd_dkdv_wgmma`` with the steps of
a tile as lambdas that two loops share. PIPE = 0 keeps the package kernel's order; PIPE = 1 is FlashAttention-3's
intra-warpgroup overlap: iteration i issues Sᵀ of tile i + 1, dV and dK of tile i, then dPᵀ of tile i + 1, and
computes the exponentials of tile i + 1 while the tensor cores run the rest. The settings the .cu builds (bf16,
ROPE = 0; PIPE = 1 at D = 64 only) are launched as ``llmgpu.ops.flash_launch.ours_backward`` launches the package's
kernel, after the wide backward has written the row statistics, with dk and dv poisoned (NaN) first. They must equal
the wide kernel's dk and dv **bit for bit** (the same products, summed in the same order) on causal and full
attention, odd T and grouped K/V heads; then each kernel alone is timed (median of CUDA events) beside the package's
wide and wgmma dK/dV kernels, on GPT-2's attention (B = 16 and 64, H = 12, T = 1024, D = 64) and a long-context head
(B = 4, H = 16, T = 4096, D = 128).

Without a GPU, or on a GPU other than sm_90, one line saying so and exit 0. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _devscript  # noqa: E402  (first: puts the package on the path)
from wgmma_probe import compile_sm90a  # noqa: E402

from llmgpu import backend  # noqa: E402
from llmgpu.ops import flash_attention as fa  # noqa: E402
from llmgpu.ops import flash_launch as fl  # noqa: E402
from llmgpu.perf.timing import time_fn  # noqa: E402
from llmgpu.testing import poisoned, random_array  # noqa: E402

SOURCE = HERE / "flash_bwd_dkdv_wgmma.cu"
CHECKS = [(1, 2, 2, 7, 64), (2, 3, 3, 257, 64), (1, 6, 2, 300, 64), (2, 2, 2, 1024, 64), (1, 2, 2, 300, 128),
          (1, 4, 2, 1000, 128)]  # (B, H, H_kv, T, D)
SPEED = [(16, 12, 1024, 64), (64, 12, 1024, 64), (4, 16, 4096, 128)]  # (B, H, T, D), causal
PIPES = {64: (0, 1), 128: (0,)}  # what the .cu builds (PIPE = 1 spills at D = 128)


def problem(cp, rng, B, H, H_kv, T, D, causal):
    """q [B, H, T, D] and k, v [B, H_kv, T, D] (strided views of one QKV buffer when H_kv = H), dO, the forward, and
    the wide backward's dq, dk, dv (which also leaves the row statistics that the dK/dV kernels read)."""
    if H_kv == H:
        q, k, v = fa.split_qkv(random_array(rng, (B, T, 3 * H * D), "bf16", cp), H)
    else:
        q = cp.asarray(random_array(rng, (B, H, T, D), "bf16"))
        k, v = (cp.asarray(random_array(rng, (B, H_kv, T, D), "bf16")) for _ in range(2))
    do = cp.asarray(random_array(rng, (B, H, T, D), "bf16"))
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    want = fa.flash_attention_backward(do, q, k, v, o, st, causal, kernel="ours", variant="wide")
    return q, k, v, do, o, st, want


def smem_bytes(D: int, wg: int, pipe: int) -> int:
    """bw_pipe_cfg::SMEM: the package's bwd_smem_bytes with 2 + pipe Q/dO buffers (and row statistics) instead of 2."""
    return fl.bwd_smem_bytes(D, wg) + pipe * (2 * fl.BW_BQ * D * 2 + fl.BW_BQ * 8)


def launcher(kernels, D, pipe):
    wg = fl.WGMMA_BWD_WG
    fn = kernels[f"flash_bwd_dkdv_wgmma_pipe<__nv_bfloat16, {D}, 0, {wg}, {pipe}>"]
    smem = smem_bytes(D, wg, pipe)
    fn.max_dynamic_shared_size_bytes = smem

    def run(q, k, v, do, st, dk, dv, causal):
        B, H, T, _ = q.shape
        H_kv = k.shape[1]
        # the row statistics the wide dQ kernel wrote in the last backward of this shape
        stats = fl.row_stats_buffer(backend.cupy_module(), B, H, T, "wgmma")
        head = (np.int32(H), np.int32(H // H_kv), np.int32(T), np.float32(st.scale), np.int32(bool(causal)),
                np.int32(B * H_kv))
        views = [fl._strides(a) for a in (q, k, v, do, dk, dv)]
        args = (q, k, v, do, stats, dk, dv, *head, *[s for view in views for s in view], np.uint64(0), np.uint64(0))
        fn(fl.launch_grid(fn, 128 * wg, smem, B * H_kv, -(-T // (64 * wg))), (128 * wg,), args, shared_mem=smem)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the checks and timings here")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    cp = _devscript.hopper_or_say_why(": nothing checked or timed")
    if cp is None:
        return 0
    kernels = compile_sm90a(cp, SOURCE)
    rng = np.random.default_rng(0)
    runs = {(D, p): launcher(kernels, D, p) for D, pipes in PIPES.items() for p in pipes}
    checks, failures = [], []
    for B, H, H_kv, T, D in CHECKS:
        for causal in (True, False):
            q, k, v, do, o, st, (_, dk_w, dv_w) = problem(cp, rng, B, H, H_kv, T, D, causal)
            for pipe in PIPES[D]:
                dk, dv = poisoned(k.shape, k.dtype, cp), poisoned(v.shape, v.dtype, cp)
                runs[D, pipe](q, k, v, do, st, dk, dv, causal)
                same = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all()) for a, b in ((dk, dk_w), (dv, dv_w)))
                checks.append({"B": B, "H": H, "H_kv": H_kv, "T": T, "D": D, "causal": causal, "pipe": pipe,
                               "bitwise_equal_to_wide": same})
                if not same:
                    failures.append(f"PIPE={pipe} B={B} H={H}/{H_kv} T={T} D={D} causal={causal}")
    print(f"checks: {len(checks) - len(failures)} of {len(checks)} bit for bit equal to the wide kernel")
    rows = []
    for B, H, T, D in SPEED:
        q, k, v, do, o, st, _ = problem(cp, rng, B, H, H, T, D, True)
        dq, dk, dv = (cp.empty(q.shape, q.dtype) for _ in range(3))
        times = {}
        for name in ("flash_bwd_dkdv_wide", "flash_bwd_dkdv_wgmma"):
            variant = "wide" if name.endswith("wide") else "wgmma"
            fl.ours_backward(do, q, k, v, o, st.lse, st.scale, True, dq, dk, dv, variant)  # the row stats
            times[f"package {variant}"] = time_fn(
                lambda: fl.ours_backward(do, q, k, v, o, st.lse, st.scale, True, dq, dk, dv, variant, only=name),
                xp=cp, reps=args.reps).median_ms
        for pipe in PIPES[D]:
            times[f"PIPE={pipe}"] = time_fn(lambda: runs[D, pipe](q, k, v, do, st, dk, dv, True), xp=cp,
                                            reps=args.reps).median_ms
        rows.append({"B": B, "H": H, "T": T, "D": D, "ms": times})
        print(f"B={B:<3} H={H} T={T} D={D:<4} " + "  ".join(f"{n} {t:.3f} ms" for n, t in times.items()) +
              (f"  PIPE 1/0: {times['PIPE=1'] / times['PIPE=0']:.3f}" if "PIPE=1" in times else ""))
    if args.json:
        args.json.write_text(json.dumps({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                         "pipes": {str(d): p for d, p in PIPES.items()}, "checks": checks,
                                         "failures": failures, "rows": rows}, indent=1))
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
