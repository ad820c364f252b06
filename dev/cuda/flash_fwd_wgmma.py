"""Check and time the wgmma flash-attention forward (flash_fwd_wgmma.cu) against float64, our flash_fwd and cuDNN.

    python dev/cuda/flash_fwd_wgmma.py                        # checks, then the timings of issue 16's shapes
    python dev/cuda/flash_fwd_wgmma.py --no-time --json out.json
    python dev/cuda/flash_fwd_wgmma.py --only "PIPE=1 BN=64 WG=2"   # the shipped shape only

Run ``wgmma_probe.py`` first: this kernel builds on the layouts its hypotheses pin. On an sm_90 GPU every
instantiation the .cu declares (D = 64 and 128, PIPE = 0 and 1, BN keys per tile, WG warpgroups of 64 query rows
per block; bf16 and fp16) is launched as ``llmgpu.ops.flash_launch.ours_forward`` launches flash_fwd (the same
arguments and launch order, a grid of 64·WG-row blocks) on q, k, v as strided views of a [B, T, 3C] QKV buffer and
o as a view of [B, T, C], with o and lse poisoned (NaN) first; o and lse are checked against the float64 reference of
``llmgpu.ops.flash_reference`` for T = 1, 7, 63, 65, 1000, 1024, causal and not; NaN in q gives NaN rows out. Then
(unless ``--no-time``) causal forward TFLOP/s (FLOPs halved) of every bf16 instantiation, our flash_fwd and cuDNN
in one run: D = 64 at B = 16 and 64, H = 12, T = 1024 (GPT-2) and D = 128 at B = 4, H = 16, T = 4096.

Without a GPU, or on a GPU other than sm_90, one line saying so and exit 0. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _devscript  # noqa: E402  (first: puts the package on the path)
from wgmma_probe import compile_sm90a  # noqa: E402

from llmgpu import backend  # noqa: E402
from llmgpu.ops import flash_attention as fa  # noqa: E402
from llmgpu.ops import flash_launch as fl  # noqa: E402
from llmgpu.ops import flash_reference as ref  # noqa: E402
from llmgpu.perf.timing import time_fn  # noqa: E402
from llmgpu.testing import poisoned, random_array, rel_error  # noqa: E402

SOURCE = HERE / "flash_fwd_wgmma.cu"


@dataclass(frozen=True, order=True)
class Variant:
    """One instantiation ``flash_fwd_wgmma<T, D, PIPE, BN, WG>`` of the .cu."""

    D: int
    bn: int
    wg: int
    pipe: int
    dtype: str
    function: str = "flash_fwd_wgmma"

    @classmethod
    def parse(cls, expr: str) -> Variant:
        f, t, d, pipe, bn, wg = re.fullmatch(r"(flash_fwd_wgmma\w*)<(\w+), (\d+), (\d+), (\d+), (\d+)>", expr).groups()
        return cls(int(d), int(bn), int(wg), int(pipe), {"__half": "fp16", "__nv_bfloat16": "bf16"}[t], f)

    @property
    def expr(self) -> str:
        return (f"{self.function}<{backend.cuda_c_type(self.dtype)}, {self.D}, {self.pipe}, {self.bn}, "
                f"{self.wg}>")

    @property
    def rows(self) -> int:  # query rows (and half the threads) of a block
        return 64 * self.wg

    @property
    def smem(self) -> int:
        return fl.wgmma_smem_bytes(self.D, self.bn, self.wg)

    @property
    def label(self) -> str:
        return f"wgmma PIPE={self.pipe} BN={self.bn} WG={self.wg}"


RTOL = {"bf16": 2e-2, "fp16": 5e-3}  # as tests/test_flash_kernels.py
CASES = [(1, 1, 1), (1, 2, 7), (2, 3, 63), (2, 3, 65), (1, 2, 1000), (2, 2, 1024)]  # (B, H, T)
SPEED = [(64, 16, 12, 1024), (64, 64, 12, 1024), (128, 4, 16, 4096)]  # (D, B, H, T), causal


def launcher(kernels, var: Variant):
    fn = kernels[var.expr]
    fn.max_dynamic_shared_size_bytes = var.smem  # above the 48 KiB default

    def run(q, k, v, o, lse, causal):
        B, H, T, D = q.shape
        args = (q, k, v, o, lse, np.int32(H), np.int32(T), np.float32(1.0 / math.sqrt(D)), np.int32(bool(causal)),
                np.int32(B * H), *fl._strides(q), *fl._strides(k), *fl._strides(v), *fl._strides(o))
        fn(fl.launch_grid(fn, 2 * var.rows, var.smem, B * H, -(-T // var.rows)), (2 * var.rows,), args,
           shared_mem=var.smem)
    return run


def qkv(cp, rng, B, H, T, dtype, D=64):
    """q, k, v as [B, H, T, D] views of one [B, T, 3C] buffer, and a NaN-filled o view of [B, T, C] and lse."""
    C = H * D
    buf = cp.asarray(random_array(rng, (B, T, 3 * C), dtype))
    q, k, v = fa.split_qkv(buf, H)
    return q, k, v, fa.heads_view(poisoned((B, T, C), buf.dtype, cp), H), poisoned((B, H, T), "fp32", cp)


def check(cp, run, dtype, D, rng) -> list[dict]:
    rows = []
    for B, H, T in CASES:
        for causal in (True, False):
            q, k, v, o, lse = qkv(cp, rng, B, H, T, dtype, D)
            run(q, k, v, o, lse, causal)
            cp.cuda.Device().synchronize()
            f = [cp.asnumpy(a).astype(np.float64) for a in (q, k, v)]
            r_o, r_lse = ref.naive_forward(*f, 1.0 / math.sqrt(D), causal)
            e_o, e_lse = rel_error(o, r_o), rel_error(lse, r_lse)  # inf where a value is not finite
            ok = bool(e_o < RTOL[dtype] and e_lse < 1e-4)
            rows.append({"B": B, "H": H, "T": T, "causal": causal, "o_error": e_o, "lse_error": e_lse, "ok": ok})
    q, k, v, o, lse = qkv(cp, rng, 1, 2, 130, dtype, D)
    q[0, 1, 5, 3] = np.nan  # row 5 of head 1: NaN out there, finite everywhere else
    run(q, k, v, o, lse, True)
    out = cp.asnumpy(o).astype(np.float32)
    nan_rows = np.argwhere(np.isnan(out).any(-1)).tolist()
    rows.append({"case": "NaN in q[0, 1, 5]", "nan_rows": nan_rows, "ok": nan_rows == [[0, 1, 5]]})
    return rows


def timing(cp, kernels, dtype, rng) -> list[dict]:
    rows = []
    for D, B, H, T in SPEED:
        q, k, v, o, lse = qkv(cp, rng, B, H, T, dtype, D)
        flops = fa.flash_attention_flops(B, H, T, D, causal=True)
        cands = {var.label: launcher(kernels, var) for var in sorted(map(Variant.parse, kernels))
                 if var.D == D and var.dtype == dtype}
        cands["ours (flash_fwd, mma.sync)"] = lambda *a, D=D: fl.ours_forward(*a[:5], 1.0 / math.sqrt(D), a[5],
                                                                             impl="mma")
        if fa.cudnn_attention.unavailable_reason() is None:
            cands["cuDNN"] = lambda q, k, v, o, lse, causal: fa.flash_attention_forward(
                q, k, v, causal, out=o, kernel="cudnn")
        for name, fn in cands.items():
            ms = time_fn(lambda: fn(q, k, v, o, lse, True), xp=cp, reps=50).median_ms
            rows.append({"B": B, "H": H, "T": T, "D": D, "kernel": name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"  D={D:<3} B={B:<3} H={H} T={T} {name:<32} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s",
                  flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-time", action="store_true", help="checks only")
    ap.add_argument("--json", type=Path, help="write the checks and timings here")
    ap.add_argument("--only", help="the instantiations whose label contains this (e.g. 'PIPE=1 BN=64 WG=2')")
    a = ap.parse_args(argv)
    cp = _devscript.hopper_or_say_why()
    if cp is None:
        return 0
    kernels = compile_sm90a(cp, SOURCE)
    if a.only:
        kernels = {e: f for e, f in kernels.items() if a.only in Variant.parse(e).label}
    rng = np.random.default_rng(0)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result, bad = {"date": date, "device": backend.device_info(cp).summary(), "checks": {}, "timing": {}}, 0
    for var in sorted(map(Variant.parse, kernels)):
        name = f"{var.dtype} D={var.D} {var.label}"
        rows = check(cp, launcher(kernels, var), var.dtype, var.D, rng)
        result["checks"][name] = rows
        fails = [r for r in rows if not r["ok"]]
        bad += len(fails)
        worst = max(r.get("o_error", 0.0) for r in rows)
        print(f"{'ok  ' if not fails else 'FAIL'} {name}: {len(rows) - len(fails)}/{len(rows)} cases, worst o "
              f"error {worst:.2e}" + "".join(f"\n     {r}" for r in fails), flush=True)
        if a.json:  # after every kernel: a launch that kills the context leaves the rows before it
            a.json.write_text(json.dumps(result, indent=1))
    if not a.no_time:
        result["timing"]["bf16"] = timing(cp, kernels, "bf16", rng)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
