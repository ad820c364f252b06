"""Flash attention benchmark: our tensor-core and scalar kernels against cuDNN and PyTorch's flash SDPA, TFLOP/s.

    python benchmarks/bench_flash_attention.py            # GPU: the shapes below, writes results JSON
    python benchmarks/bench_flash_attention.py --quick    # B=16 GPT-2 shape only, fewer repetitions, nothing written
    python benchmarks/bench_flash_attention.py --shape 8,9,3,2048,64 --out x.json   # one shape, B,H,H_kv,T,D

Shapes (bf16, causal; the D = 128 one also non-causal): GPT-2 124M attention B=16 and B=64, H=12, T=1024, D=64,
and a long-context head of D=128: B=4, H=16, T=4096 (64 M score elements per head-batch, 8× the GPT-2 B=16 work
per head, the regime where FlashAttention-2 reports its numbers). ``--shape B,H,H_kv,T,D`` times one causal shape
instead, with H_kv < H for grouped-query attention (e.g. SmolLM-135M's 9 query and 3 K/V heads of D = 64; q, k, v
are then views of one [B, T, (H + 2·H_kv)·D] buffer, as a fused Llama projection gives). FLOPs by
``flash_attention_flops`` (forward 4·B·H·T²·D, halved when causal; backward 2.5 × forward), time = median of
CUDA-event timings. Rows:

* ``ours``        our tensor-core kernels, forward and the deterministic backward: what ``kernel="ours"`` runs (the
                  forward is kernels/flash_attention_wgmma.cu on Hopper, flash_attention.cu's mma.sync elsewhere)
* ``ours mma``    on Hopper, the mma.sync forward too (``kernel="mma"``), the portable one
* ``scalar``      the fp32 teaching kernel, forward only (run on the B=16 shape and on the D=128 one)
* ``cudnn``       cuDNN's fused attention (deterministic backward), when the cuDNN frontend is installed
* ``torch flash`` PyTorch SDPA with the flash backend (``--no-torch`` skips it)

Results go to benchmarks/results/ch2b/flash_attention.json on a GPU (or to --out), with device, date and versions.
"""

from __future__ import annotations

import argparse

import _common
import numpy as np

from llmgpu import backend
from llmgpu.ops import cudnn_attention
from llmgpu.ops import flash_attention as fa
from llmgpu.ops.attention import kv_group
from llmgpu.perf.timing import time_fn, time_torch
from llmgpu.testing import random_array

RESULTS = _common.RESULTS_DIR / "ch2b" / "flash_attention.json"
SHAPES = [  # (B, H, H_kv, T, D, causal)
    (16, 12, 12, 1024, 64, True),
    (64, 12, 12, 1024, 64, True),
    (4, 16, 16, 4096, 128, True),
    (4, 16, 16, 4096, 128, False),
]


def _row(table, **kw):
    table.append(kw)
    print(f"  {kw['impl']:<12} {kw['direction']:<4} {kw['shape']:<28} {kw['ms']:9.3f} ms {kw['tflops']:7.1f} TF/s")


def parse_shape(text: str) -> tuple:
    """``"B,H,H_kv,T,D"`` -> (B, H, H_kv, T, D, causal=True); an ArgumentTypeError naming the form otherwise."""
    try:
        B, H, H_kv, T, D = (int(x) for x in text.split(","))
        kv_group(H, H_kv)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--shape takes B,H,H_kv,T,D (H_kv dividing H), got {text!r}: {e}") from e
    return B, H, H_kv, T, D, True


def bench_shape(xp, rng, B, H, H_kv, T, D, causal, reps, torch, table, scalar):
    shape = (B, H, T, D)
    label = f"B={B} H={H}{f' H_kv={H_kv}' if H_kv != H else ''} T={T} D={D}{' causal' if causal else ''}"
    print(f"\n{label}")
    qkv = random_array(rng, (B, T, (H + 2 * H_kv) * D), "bf16", xp)
    q, k, v = fa.split_qkv(qkv, H, H_kv)  # the layout FastGPT uses: strided views of the QKV buffer
    do = random_array(rng, shape, "bf16", xp)
    o = xp.empty(shape, backend.bfloat16)
    lse = xp.empty((B, H, T), np.float32)
    dq = xp.empty(shape, backend.bfloat16)
    dk, dv = (xp.empty(k.shape, backend.bfloat16) for _ in range(2))
    fl = {d: fa.flash_attention_flops(B, H, T, D, causal, d) for d in ("fwd", "bwd")}
    impls = ["ours"] + (["mma"] if fa.forward_impl(q) == "wgmma" else []) + (["scalar"] if scalar else [])
    if cudnn_attention.available():
        impls.append("cudnn")
    else:
        print(f"  (cuDNN: {cudnn_attention.unavailable_reason()})")
    for impl in impls:
        _, st = fa.flash_attention_forward(q, k, v, causal, out=o, lse=lse, kernel=impl)
        ms = time_fn(lambda: fa.flash_attention_forward(q, k, v, causal, out=o, lse=lse, kernel=impl), xp=xp,
                     reps=reps).median_ms
        name = "ours mma" if impl == "mma" else impl
        _row(table, impl=name, direction="fwd", shape=label, ms=ms, tflops=fl["fwd"] / ms / 1e9)
        if impl in ("mma", "scalar"):  # forward only
            continue
        ms = time_fn(lambda: fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=dq, dk=dk, dv=dv, kernel=impl),
                     xp=xp, reps=reps).median_ms
        _row(table, impl=impl, direction="bwd", shape=label, ms=ms, tflops=fl["bwd"] / ms / 1e9)
    if torch is not None:
        bench_torch(torch, xp, q, k, v, do, causal, label, fl, reps, table)


def bench_torch(torch, xp, q, k, v, do, causal, label, fl, reps, table):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    xp.cuda.Device().synchronize()
    tq, tk, tv = (torch.from_dlpack(xp.ascontiguousarray(a)).requires_grad_(True) for a in (q, k, v))
    tdo = torch.from_dlpack(do)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # PyTorch >= 2.5
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, **gqa)

        try:
            fwd()
        except Exception as e:  # no flash kernel for this shape in this PyTorch
            print(f"  (torch flash: {str(e).splitlines()[0]})")
            return
        ms = time_torch(torch, lambda: fwd().detach(), reps)
        _row(table, impl="torch flash", direction="fwd", shape=label, ms=ms, tflops=fl["fwd"] / ms / 1e9)
        out = fwd()
        ms = time_torch(torch, lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), reps)
        _row(table, impl="torch flash", direction="bwd", shape=label, ms=ms, tflops=fl["bwd"] / ms / 1e9)


def main(argv=None):
    ap = _common.parser(__doc__)
    ap.add_argument("--shape", type=parse_shape, metavar="B,H,H_KV,T,D",
                    help="time this one causal shape instead of the list (H_kv < H: grouped-query attention)")
    args = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(args)
    if not on_gpu:
        print("flash attention kernels need a GPU: nothing to time on NumPy")
        return {}
    reps = 5 if quick else args.reps
    rng = np.random.default_rng(0)
    torch = _common.torch_or_none(args, on_gpu)
    shapes = [args.shape] if args.shape else SHAPES[:1] if quick else SHAPES
    table = []
    for i, (B, H, H_kv, T, D, causal) in enumerate(shapes):
        bench_shape(xp, rng, B, H, H_kv, T, D, causal, reps, torch, table, scalar=i in (0, 2) and not args.shape)
    versions = {"cupy": xp.__version__, "torch": getattr(torch, "__version__", None)}
    try:
        versions["cudnn"] = int(cudnn_attention._cudnn().backend_version()) if cudnn_attention.available() else None
    except Exception:
        versions["cudnn"] = None
    payload = {"quick": quick, "reps": reps,
               "shapes": [dict(zip(("B", "H", "H_kv", "T", "D", "causal"), s)) for s in shapes],
               "versions": versions, "auto_choices": {" ".join(map(str, k)): c for k, c in fa.auto_choices().items()},
               "rows": table}
    # a --quick or --shape run keeps the full results
    _common.save(args.out or (None if quick or args.shape else RESULTS), payload, xp)
    return payload


if __name__ == "__main__":
    main()
