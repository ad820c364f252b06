"""Run every one of our CUDA kernels once at small sizes: the program compute-sanitizer checks (issue 13).

    S=$(python3 tools/checks/sanitize_kernels.py --find-sanitizer)
    $S --tool memcheck --error-exitcode 1 $(python3 tools/checks/sanitize_kernels.py --filter-args memcheck) \\
        python3 tools/checks/sanitize_kernels.py
    $S --tool racecheck --error-exitcode 1 $(python3 tools/checks/sanitize_kernels.py --filter-args racecheck) \\
        python3 tools/checks/sanitize_kernels.py --no-library    # cuBLAS kernels crash racecheck itself
    python3 tools/checks/sanitize_kernels.py --find-sanitizer    # where compute-sanitizer is (gpu_check.sh uses it)
    python3 tools/checks/sanitize_kernels.py --list-kernels      # our kernels' names (no GPU needed)
    python3 tools/checks/sanitize_kernels.py --cpu-dry           # the same calls on NumPy: the driver's own check

Every kernel of ``llmgpu/kernels/*.cu`` runs through its ops module, each method and dtype, at sizes
that hit the vector and the scalar (tail) paths: vector_add, the chapter-0 matmuls, bias add and
gradient (linear forward / backward), softmax forward / backward (naive, warp, block; causal; odd
and aligned row lengths; fp32 scores with 16-bit probabilities), chapter 2's attention (not cuDNN), our flash
attention (tensor-core forward and every variant of the deterministic backward, the scalar forward; bf16 / fp16,
D = 64 and 128, T = 1, 65, 130, causal or not, on strided views of one QKV buffer, grouped K/V heads too),
layernorm (naive / optimized / fast, register and shared accumulators, residual, fused add+LN), GELU,
cross-entropy (naive / optimized / fast, int32 / int64 targets, ignored rows), embedding (naive /
optimized / counting), cast, the FP8 casts (flat, transposing, amax only) and the amax history's scale
update (one state, and a group of states in one launch), AdamW (flat, per tensor, with working copy, skipped
step), the fused gradient norm / clip, the loss scaler's update, the timing spin kernel; then one tiny training step
of ``GPT`` and of ``FastGPT`` with cuDNN's flash attention switched off (``FastOptions(attention_kernel="math")``,
the chapter 2 kernels instead) followed by clipping and an AdamW step. Ends with a device synchronisation.

Library kernels (cuBLAS / cuBLASLt GEMMs, CuPy's own element-wise kernels) are not ours to fix:
``--filter-args`` prints compute-sanitizer options that restrict checking to our kernels
(``--kernel-name kns=<name>`` once per kernel function of ``llmgpu/kernels``: a substring of the mangled
name; the filters are additive, and unfiltered launches run unchecked) and, for memcheck, turn off
CUDA API error reports (``--report-api-errors no``, a memcheck-only option: library-internal probes
such as a failing ``cuGetProcAddress`` would count as errors; an API failure in our own calls raises in
CuPy and fails the run anyway). cuDNN is never called.

CuPy's memory pool is switched off (``cupy.cuda.set_allocator(None)``): with the pool, an array is a
slice of a larger cudaMalloc block and memcheck cannot see a write past its end; without it every
array is its own allocation. A failing call is reported and the rest still run; the exit status is 1
when any failed, 2 without a GPU, 0 otherwise. Sizes are tiny: a few seconds plain, well under a minute
under memcheck or racecheck once the kernels are compiled (NVRTC; cached in ~/.cupy/kernel_cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from llmgpu import backend  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16")


def kernel_names() -> list[str]:
    """The kernel functions our .cu files instantiate (the names inside their ``// llmgpu:kernel`` lines)."""
    from llmgpu.kernels import loader

    names = set()
    kdir = os.path.join(ROOT, "llmgpu", "kernels")
    for f in sorted(os.listdir(kdir)):
        if f.endswith(".cu"):
            for expr in loader.expressions_in(loader.source(f[:-3])):
                names.add(expr.split("<")[0].strip())
    return sorted(names)


def filter_args(tool: str = "memcheck") -> list[str]:
    """compute-sanitizer options: check only our kernels (each ``--kernel-name`` filter is additive), at most 20
    printed errors; memcheck also without CUDA API error reports (a memcheck-only option)."""
    args = []
    for n in kernel_names():
        args += ["--kernel-name", f"kns={n}"]
    args += ["--print-limit", "20"]
    if tool == "memcheck":
        args += ["--report-api-errors", "no"]
    return args


def find_sanitizer() -> str | None:
    """compute-sanitizer's path: $COMPUTE_SANITIZER, PATH, the CUDA toolkit (/usr/local/cuda*), or the
    ``nvidia-cuda-sanitizer-api`` wheel (``nvidia/cu13/compute-sanitizer/``, e.g. installed into /tmp/site
    from .whl by tools/gpu_check.sh; ``bash tools/maintenance/gpu_wheels.sh 'nvidia-cuda-sanitizer-api==13.*'``)."""
    import glob
    import shutil

    cands = [os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    for root in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]:
        cands += [f"{root}/bin/compute-sanitizer", f"{root}/compute-sanitizer/compute-sanitizer"]
    for site in [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]:
        for sub in (("compute-sanitizer", "compute-sanitizer"), ("bin", "compute-sanitizer")):  # 13.5 / 13.0 wheels
            cands += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", *sub)), reverse=True)
        cands += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_sanitizer_api", "compute-sanitizer",
                                               "compute-sanitizer")))
    for c in cands:
        if c and os.path.isfile(c):
            if not os.access(c, os.X_OK):
                try:  # a wheel unpacked without the executable bit
                    os.chmod(c, os.stat(c).st_mode | 0o111)
                except OSError:
                    continue
            return c
    return None


# --------------------------------------------------------------------------- the calls


# calls that also launch library kernels (cuBLAS GEMMs): racecheck's instrumentation of those crashes on the
# H200 ("Internal Sanitizer Error: failed to handle a hardware exception"), so --no-library leaves them out;
# their own kernels (bias_add, bias_grad, softmax) are called on their own above
LIBRARY_CALLS = ("linear_forward", "linear_backward", "attention ", "GPT ", "FastGPT ")


class Driver:
    def __init__(self, xp, skip=()):
        self.skip, self.skipped = tuple(skip), 0
        self.xp = xp
        self.rng = np.random.default_rng(0)
        self.failed: list[tuple[str, str]] = []
        self.ran = 0

    def arr(self, shape, dtype="fp32", scale=1.0):
        a = (self.rng.standard_normal(shape) * scale).astype(backend.resolve_dtype(dtype))
        return backend.to_device(a, self.xp)

    def ints(self, high, shape, dtype=np.int32):
        return backend.to_device(self.rng.integers(0, high, shape).astype(dtype), self.xp)

    def run(self, name, fn, *args, **kw):
        if self.skip and name.startswith(self.skip):
            self.skipped += 1
            return
        try:
            fn(*args, **kw)
            self.ran += 1
        except Exception as e:
            self.failed.append((name, f"{type(e).__name__}: {e}"))
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=4)


def ops(d: Driver):
    import importlib

    # the modules themselves (llmgpu.ops re-exports functions of the same names, e.g. ops.matmul)
    att, ca, ce, em, ge, ln, li, mm, sm = (importlib.import_module(f"llmgpu.ops.{n}") for n in (
        "attention", "cast", "cross_entropy", "embedding", "gelu", "layernorm", "linear", "matmul", "softmax"))
    from llmgpu.ops.vector_add import vector_add

    for dt in DTYPES:
        for n in (1, 1000, 1027):
            d.run(f"vector_add {dt} n={n}", vector_add, d.arr((n,), dt), d.arr((n,), dt))

    for method in [m for m in mm.METHODS if m != "cublas"]:
        for m_, k_, n_ in ((33, 47, 65), (64, 64, 64)):
            d.run(f"matmul {method} {m_}x{k_}x{n_}", mm.matmul, d.arr((m_, k_)), d.arr((k_, n_)), method)

    for dt in DTYPES:
        for n, cin, cout in ((37, 40, 24), (5, 33, 23), (64, 64, 128)):
            x, w, b = d.arr((n, cin), dt), d.arr((cout, cin), dt), d.arr((cout,), dt)
            d.run(f"linear_forward {dt} {n}x{cin}->{cout}", li.linear_forward, x, w, b)
            dy = d.arr((n, cout), dt)
            d.run(f"linear_backward {dt} {n}x{cin}->{cout}", li.linear_backward, dy, x, w, True)
            dw = d.xp.zeros((cout, cin), np.float32)
            db = d.xp.zeros((cout,), np.float32)
            d.run(f"linear_backward accumulate {dt}", li.linear_backward, dy, x, w, True, dw_out=dw, db_out=db,
                  accumulate=True)
            d.run(f"bias_add {dt} {n}x{cout}", li.add_bias, d.arr((n, cout), dt), b)  # without the GEMM
            d.run(f"bias_grad {dt} {n}x{cout}", li.bias_grad, dy, db, accumulate=True)

    for dt in DTYPES:
        for cols in (1, 7, 32, 100, 128, 257, 1024, 1030):
            x = d.arr((3, 5, cols), dt, 2.0)
            for method in sm.METHODS:
                p = d.xp.empty(x.shape, x.dtype)
                d.run(f"softmax_forward {method} {dt} cols={cols}", sm.softmax_forward, x, method, p, scale=0.5)
                d.run(f"softmax_backward {method} {dt} cols={cols}", sm.softmax_backward, d.arr(x.shape, dt), p,
                      method, scale=0.5)
        for t in (1, 17, 64, 130):
            x = d.arr((2, t, t), dt)
            for method in sm.METHODS:
                d.run(f"softmax causal {method} {dt} T={t}", _softmax_pair, sm, d, x, method, causal=True)
        if dt != "fp32":  # fp32 scores, 16-bit probabilities (attention's pairing)
            for cols in (7, 64, 257):
                d.run(f"softmax fp32->{dt} cols={cols}", _softmax_pair, sm, d, d.arr((4, cols)), "auto",
                      out_dtype=dt)

    for dt in DTYPES:
        for b_, h, t, dd in ((2, 2, 17, 16), (1, 3, 64, 32)):
            q, k, v = (d.arr((b_, h, t, dd), dt) for _ in range(3))
            for causal in (True, False):
                d.run(f"attention {dt} T={t} D={dd} causal={causal}", _attention, att, d, q, k, v, causal)

    from llmgpu.ops import flash_attention as fa  # our flash kernels (flash_attention.cu), never cuDNN here

    for dt in ("bf16", "fp16"):
        for dd in fa.HEAD_DIMS:
            # one key, a partial tile, two full + a partial; then grouped K/V heads (H_kv < H)
            for b_, h, h_kv, t in ((1, 2, 2, 1), (2, 1, 1, 65), (1, 1, 1, 130), (2, 4, 2, 65), (1, 3, 1, 130)):
                qkv = d.arr((b_, t, (h + 2 * h_kv) * dd), dt)
                for causal in (True, False):
                    d.run(f"flash_attention {dt} H={h} H_kv={h_kv} T={t} D={dd} causal={causal}", _flash, fa, d, qkv,
                          h, h_kv, causal)

    for dt in DTYPES:
        for c in (32, 100, 768, 1000, 1600, 2048):  # 1600, 2048: the fast backward's long rows (P = 7, 8)
            x, g, b = d.arr((5, c), dt), d.arr((c,), dt), d.arr((c,), dt)
            for method in ln.METHODS:
                d.run(f"layernorm {method} {dt} C={c}", _layernorm, ln, d, x, g, b, method, None)
                for acc in ln.ACCUMULATORS:
                    d.run(f"layernorm_backward {method} {acc} {dt} C={c}", _layernorm, ln, d, x, g, b, method, acc)
            d.run(f"add_layernorm_forward {dt} C={c}", ln.add_layernorm_forward, d.arr((5, c), dt), x, g, b)

    for dt in DTYPES:
        for n in (1, 1000, 4099):
            for method in ge.METHODS:
                x = d.arr((n,), dt)
                d.run(f"gelu {method} {dt} n={n}", _gelu, ge, d, x, method)

    for dt in DTYPES:
        for v in (37, 1000, 4100):
            logits = d.arr((2, 7, v), dt, 3.0)
            for tdt in (np.int32, np.int64):
                tgt = d.ints(v, (2, 7), tdt)
                tgt[0, 3] = -100  # an ignored row
                for method in ce.METHODS:
                    if method == "naive" and dt == "fp16":
                        continue  # refused by design (module docstring)
                    d.run(f"cross_entropy {method} {dt} V={v} {np.dtype(tdt).name}", _ce, ce, logits, tgt, method)
                d.run(f"cross_entropy_forward_backward {dt} V={v} {np.dtype(tdt).name}",
                      ce.cross_entropy_forward_backward, logits.copy(), tgt, 0.5)

    for dt in DTYPES:
        for v, c, b_, t in ((50, 32, 2, 8), (13, 100, 3, 5)):
            idx = d.ints(v, (b_, t))
            idx[0, :3] = 1  # a repeated token
            wte, wpe = d.arr((v, c), dt), d.arr((t + 2, c), dt)
            for method in em.METHODS:
                d.run(f"embedding {method} {dt} V={v} C={c}", _embedding, em, d, idx, wte, wpe, method)
            x = d.arr((b_, t, c), dt)
            d.run(f"embedding_backward accumulate {dt} V={v} C={c}", em.embedding_backward, x, idx, v, t + 2,
                  method="counting", dwte_out=d.arr((v, c), "fp32"), dwpe_out=d.arr((t + 2, c), "fp32"),
                  accumulate=True)

    for src in DTYPES:
        for dst in DTYPES:
            for n in (1, 1001):
                d.run(f"cast {src}->{dst} n={n}", ca.cast, d.arr((n,), src), dst)

    from llmgpu.ops import fp8

    for dt in DTYPES:
        for fmt in fp8.FP8_FORMATS:
            # scalar and vector paths, partial tiles; (264, 200): the 8 x 8 register transpose (16-bit x), cut tiles
            for shape in ((1,), (7, 13), (64, 64), (65, 129), (264, 200)):
                x, scale = d.arr(shape, dt, 30.0), d.xp.full(1, 2.0, np.float32)
                amax = d.xp.zeros(1, np.float32)
                d.run(f"fp8_cast {dt}->{fmt} {shape}", fp8.fp8_cast, x, scale, fmt, amax=amax)
                d.run(f"fp8_cast transpose {dt}->{fmt} {shape}", fp8.fp8_cast, x, scale, fmt, transpose=True,
                      amax=amax, accumulate_amax=True)
            d.run(f"fp8_amax {dt}", fp8.fp8_amax, d.arr((1001,), dt))
        if dt in ("fp32", "bf16"):  # the act= and column_sums= kernels' dtypes
            x, pre, b = d.arr((264, 200), dt, 3.0), d.arr((264, 200), dt, 3.0), d.arr((200,), dt)
            d.run(f"fp8_cast dgelu + column sums {dt}", fp8.fp8_cast, x, d.xp.full(1, 2.0, np.float32), "e5m2",
                  transpose=True, act="dgelu", pre=pre, bias=b, column_sums=d.xp.zeros(200, np.float32))
    for length in (1, 300):
        d.run(f"AmaxHistory.update length={length}", fp8.AmaxHistory("e4m3", length, xp=d.xp).update)
        group = fp8.AmaxHistories([fp8.AmaxHistory(f, length, xp=d.xp) for f in ("e4m3", "e5m2", "e4m3")])
        d.run(f"AmaxHistories.update_and_clear length={length}", group.update_and_clear)


def dist(d: Driver):
    """Chapter 9's own kernel: the ring all-reduce's reduction (aligned and misaligned, every dtype)."""
    from llmgpu.dist.ring import reduce_add

    for dt in DTYPES:
        for n, off in ((1, 0), (7, 0), (4097, 3), (40_000, 1)):
            a, b = d.arr((n + off,), dt), d.arr((n + off,), dt)
            d.run(f"ring_reduce_add {dt} n={n} offset={off}", reduce_add, a[off:], b[off:])


def _softmax_pair(sm, d, x, method, causal=False, out_dtype=None):
    p = sm.softmax_forward(x, method, causal=causal, out_dtype=out_dtype)
    dp = d.arr(x.shape, "fp32" if out_dtype else backend.dtype_name(x.dtype))
    sm.softmax_backward(dp, p, method, causal=causal)


def _attention(att, d, q, k, v, causal):
    o, stats = att.attention_forward(q, k, v, causal)
    att.attention_backward(d.arr(q.shape, backend.dtype_name(q.dtype)), q, k, v, o, stats, causal)


def _flash(fa, d, qkv, h, h_kv, causal):
    """Our tensor-core forward and backward on strided views of one QKV buffer, then the other forwards (ours is the
    Hopper wgmma one on an sm_90 GPU, mma.sync elsewhere) and the scalar one."""
    q, k, v = fa.split_qkv(qkv, h, h_kv)
    o, st = fa.flash_attention_forward(q, k, v, causal, kernel="ours")
    dqkv = d.xp.empty_like(qkv)
    dq, dk, dv = fa.split_qkv(dqkv, h, h_kv)
    do = d.arr(q.shape, backend.dtype_name(q.dtype))
    for variant in fa.BWD_VARIANTS:  # every candidate backward (flash_launch), the default first
        fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=dq, dk=dk, dv=dv, kernel="ours", variant=variant)
    if fa.forward_impl(q) == "wgmma":
        fa.flash_attention_forward(q, k, v, causal, kernel="mma")
    fa.flash_attention_forward(q, k, v, causal, kernel="scalar")


def _layernorm(ln, d, x, g, b, method, accumulators):
    y, mean, rstd = ln.layernorm_forward(x, g, b, method=method)
    dy = d.arr(x.shape, backend.dtype_name(x.dtype))
    if accumulators is None:
        ln.layernorm_backward(dy, x, g, mean, rstd, method=method)
        return
    dres = d.arr(x.shape, backend.dtype_name(x.dtype))
    dg = d.xp.zeros(g.shape, np.float32)
    dbeta = d.xp.zeros(g.shape, np.float32)
    ln.layernorm_backward(dy, x, g, mean, rstd, method=method, dresidual=dres, dx_out=dres, dgamma_out=dg,
                          dbeta_out=dbeta, accumulate_params=True, accumulators=accumulators)


def _gelu(ge, d, x, method):
    ge.gelu_forward(x, method=method)
    ge.gelu_backward(d.arr(x.shape, backend.dtype_name(x.dtype)), x, method=method)


def _ce(ce, logits, tgt, method):
    loss, cache = ce.cross_entropy_forward(logits, tgt, method=method)
    ce.cross_entropy_backward(cache, 0.5)


def _embedding(em, d, idx, wte, wpe, method):
    x = em.embedding_forward(idx, wte, wpe, method=method)
    em.embedding_backward(d.arr(x.shape, backend.dtype_name(x.dtype)), idx, wte.shape[0], wpe.shape[0],
                          method=method)


def optim(d: Driver):
    from llmgpu.amp import LossScaler, has_inf_or_nan
    from llmgpu.optim.adamw import AdamW, adamw_update
    from llmgpu.optim.clip import GradClipper, grad_norm_fused
    from llmgpu.optim.params import FlatParams

    xp = d.xp
    for dt in DTYPES:
        for n in (1, 1000, 4097):
            p, m, v = d.arr((n,)), xp.zeros(n, np.float32), xp.zeros(n, np.float32)
            g = d.arr((n,), dt)
            d.run(f"adamw_update {dt} n={n}", adamw_update, p, g, m, v, step=1, lr=1e-3, weight_decay=0.1)
            w = xp.empty(n, backend.resolve_dtype(dt))
            d.run(f"adamw_update working+zero_grad {dt} n={n}", adamw_update, p, g, m, v, step=2, lr=1e-3,
                  working=w, zero_grad=True, found_inf=xp.zeros((), np.float32))
            g2 = d.arr((n,), dt)
            d.run(f"grad_norm_fused {dt} n={n}", grad_norm_fused, g2, 1.0)
            d.run(f"has_inf_or_nan {dt} n={n}", has_inf_or_nan, g2)
    shapes = {"a.weight": (7, 5), "a.bias": (7,), "b.weight": (33, 3)}
    for per_tensor in (False, True):
        for wdt in ("fp32", "bf16"):
            P = FlatParams(shapes, xp=xp, working_dtype=wdt)
            P.grad[...] = d.arr(P.grad.shape)
            opt = AdamW(P, per_tensor=per_tensor)
            d.run(f"AdamW per_tensor={per_tensor} working={wdt}", opt.step, zero_grad=True)
            d.run(f"AdamW skipped step per_tensor={per_tensor}", opt.step, found_inf=xp.ones((), np.float32))
    clip = GradClipper(1.0, xp=xp)
    d.run("GradClipper", clip, d.arr((1000,)))
    for kind in LossScaler.KINDS:
        s = LossScaler(kind, xp=xp)
        g = d.arr((1000,), "fp16")
        d.run(f"LossScaler {kind}", _scaler, s, g)
        g[3] = np.inf
        d.run(f"LossScaler {kind} overflow", _scaler, s, g)
    if xp is not np:
        from llmgpu.kernels import get_kernel

        d.run("gpu_spin", get_kernel("spin", "gpu_spin"), (1,), (32,), (np.uint64(10_000),))


def _scaler(s, g):
    r = s.check_and_clip(g, 1.0)
    s.update(r.found_inf)


def models(d: Driver):
    from llmgpu.model import GPT, FastOptions, GPTConfig
    from llmgpu.model.fast import FastGPT
    from llmgpu.optim.adamw import AdamW
    from llmgpu.optim.clip import GradClipper

    xp = d.xp
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=61, block_size=16)
    B, T = 2, 16
    idx, tgt = d.ints(cfg.vocab_size, (B, T)), d.ints(cfg.vocab_size, (B, T))
    variants = [("GPT", GPT, "fp32", 0), ("GPT", GPT, "bf16", 1), ("FastGPT", FastGPT, "bf16", 0),
                ("FastGPT", FastGPT, "fp32", 0)]
    for name, cls, dt, ckpt in variants:
        # FastGPT: chapter 2's attention kernels instead of cuDNN's (excluded from the check)
        opts = {"options": FastOptions(attention_kernel="math")} if cls is FastGPT else {}
        m = cls(cfg, dtype=dt, checkpoint_every=ckpt, xp=xp, seed=1, **opts)
        d.run(f"{name} {dt} checkpoint_every={ckpt} training step", _train_step, m, idx, tgt, AdamW, GradClipper)
        d.run(f"{name} {dt} forward (sampling path)", m.forward, idx, None, last_only=True)


def _train_step(m, idx, tgt, AdamW, GradClipper):
    m.zero_grad()
    m.forward_backward(idx, tgt)
    norm = GradClipper(1.0, xp=m.xp)(m.params.grad)
    AdamW(m.params).step(grad_scale=norm.scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list-kernels", action="store_true", help="print our kernel names and exit")
    ap.add_argument("--filter-args", nargs="?", const="memcheck", choices=("memcheck", "racecheck"),
                    help="print the compute-sanitizer options that check only our kernels (for TOOL), and exit")
    ap.add_argument("--find-sanitizer", action="store_true",
                    help="print compute-sanitizer's path and exit (status 1 and a message when not found)")
    ap.add_argument("--cpu-dry", action="store_true", help="make the same calls on NumPy (checks the driver)")
    ap.add_argument("--keep-pool", action="store_true", help="keep CuPy's memory pool (memcheck sees less)")
    ap.add_argument("--only", choices=("ops", "optim", "dist", "models"), action="append")
    ap.add_argument("--no-library", action="store_true",
                    help="leave out the calls that also launch cuBLAS kernels (for racecheck, see LIBRARY_CALLS)")
    a = ap.parse_args(argv)
    if a.list_kernels:
        print("\n".join(kernel_names()))
        return 0
    if a.filter_args:
        print(" ".join(filter_args(a.filter_args)))
        return 0
    if a.find_sanitizer:
        path = find_sanitizer()
        if path is None:
            print("sanitize_kernels: compute-sanitizer not found (looked at $COMPUTE_SANITIZER, PATH, "
                  "/usr/local/cuda*/bin, /usr/local/cuda*/compute-sanitizer, nvidia/cu*/{bin,compute-sanitizer} "
                  "in sys.path); install the CUDA toolkit's sanitizer or the nvidia-cuda-sanitizer-api wheel",
                  file=sys.stderr)
            return 1
        print(path)
        return 0
    if a.cpu_dry:
        xp = np
    else:
        reason = backend.gpu_unavailable_reason()
        if reason is not None:
            print(f"sanitize_kernels: needs a CUDA GPU: {reason}", file=sys.stderr)
            return 2
        xp = backend.cupy_module()
        if not a.keep_pool:
            xp.cuda.set_allocator(None)
    t0 = time.perf_counter()
    d = Driver(xp, LIBRARY_CALLS if a.no_library else ())
    for part, fn in (("ops", ops), ("optim", optim), ("dist", dist), ("models", models)):
        if not a.only or part in a.only:
            fn(d)
            if xp is not np:
                xp.cuda.Device().synchronize()  # a kernel fault surfaces here at the latest
            print(f"sanitize_kernels: {part} done ({d.ran} calls, {len(d.failed)} failed, "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)
    if xp is not np:
        xp.cuda.Device().synchronize()
    if d.failed:
        print(f"sanitize_kernels: {len(d.failed)} of {d.ran + len(d.failed)} calls FAILED:", file=sys.stderr)
        for name, err in d.failed:
            print(f"  {name}: {err}", file=sys.stderr)
        return 1
    print(f"sanitize_kernels: all {d.ran} calls ran ({'NumPy' if xp is np else 'GPU'}), "
          f"{time.perf_counter() - t0:.1f} s" + (f"; {d.skipped} calls with library kernels left out" if d.skipped
                                                  else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
