"""The measurements the chapters plot: kernels over sizes and variants, layers stage by stage, the model
over checkpointing settings. Each checks before it times: a fast wrong kernel gets no number.

* ``matmul_sweep`` (introduction): naive → tiled → register-blocked GEMMs against cuBLAS and NumPy.
* ``measure_linear`` (chapter 1): the three GEMMs and two bias kernels of one linear layer.
* ``attention_stage_times`` (chapter 2): the eight stages of attention forward and backward.
* ``checkpointing_sweep`` (chapter 6): memory and time of forward + backward per ``checkpoint_every``.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..gemm import gemm
from ..model import GPT, GPTConfig, training_flops
from ..ops.attention import attention_stages
from ..ops.linear import add_bias, bias_grad, linear_backward, linear_flops, linear_forward
from ..ops.matmul import METHODS, matmul, matmul_flops
from ..testing import rel_error
from .timing import time_fn


def matmul_sweep(shapes, methods=METHODS, *, xp=None, reps=10, numpy_max_flops=2e11, seed=0):
    """Time every method on every (M, N, K) shape; returns a list of dicts (one per measurement).

    On a GPU, NumPy (the host's BLAS) is timed too, at shapes up to ``numpy_max_flops`` so the sweep
    stays short. Each GPU result is checked against NumPy before it is timed: a fast wrong kernel
    does not get a number.
    """
    xp = xp or backend.default_xp()
    rng = np.random.default_rng(seed)
    rows = []
    for m, n, k in shapes:
        a_h = rng.standard_normal((m, k), dtype=np.float32)
        b_h = rng.standard_normal((k, n), dtype=np.float32)
        flops = matmul_flops(m, n, k)
        ref = None
        if xp is not np:
            a, b = xp.asarray(a_h), xp.asarray(b_h)
            out = xp.empty((m, n), dtype=np.float32)
            for method in methods:
                matmul(a, b, method=method, out=out)
                if ref is None:
                    ref = a_h.astype(np.float64) @ b_h.astype(np.float64)
                err = rel_error(out, ref)
                if not err < 1e-4:
                    raise AssertionError(f"{method} at {(m, n, k)}: relative error {err:.2e}")
                t = time_fn(lambda: matmul(a, b, method=method, out=out), xp=xp, reps=reps)
                rows.append(dict(method=method, m=m, n=n, k=k, ms=t.median_ms, tflops=t.tflops(flops)))
        if xp is np or flops <= numpy_max_flops:
            out_h = np.empty((m, n), dtype=np.float32)
            t = time_fn(lambda: np.matmul(a_h, b_h, out=out_h), xp=np, warmup=1, reps=3)
            rows.append(dict(method="numpy (CPU)", m=m, n=n, k=k, ms=t.median_ms, tflops=t.tflops(flops)))
    return rows


def measure_linear(n, c_in, c_out, dtype="bf16", *, xp=None, reps=20, seed=0):
    """Time one linear layer's kernels at ``x [n, c_in]``, ``w [c_out, c_in]`` (used by the chapter
    and by ``benchmarks/bench_ch1_linear.py``).

    Returns a dict of median milliseconds and rates: ``fwd`` (:func:`linear_forward` with bias),
    ``dgrad`` and ``wgrad`` (the two :func:`~llmgpu.gemm.gemm` calls :func:`linear_backward` makes,
    with the same arguments, timed one by one), ``bwd`` (all of :func:`linear_backward`: dgrad,
    wgrad and the bias gradient), ``bias_grad`` and ``bias_add``. Each entry holds ``ms`` and
    ``tflops`` (GEMMs) or ``gbps`` (bias kernels, minimum bytes: each input read once, each output
    written once). Outputs are preallocated, so no allocation is timed.
    """
    xp = xp or backend.default_xp()
    dt = backend.resolve_dtype(dtype)
    # Random inputs made where they live (a host generator would take seconds at GPT-2 sizes).
    gen = np.random.default_rng(seed) if xp is np else xp.random.RandomState(seed)
    randn = lambda *shape, scale=1.0: (gen.standard_normal(shape, dtype=np.float32) * scale).astype(dt)
    x, dy = randn(n, c_in), randn(n, c_out)
    w, b = randn(c_out, c_in, scale=c_in**-0.5), randn(c_out)
    y, dx = xp.empty((n, c_out), dt), xp.empty((n, c_in), dt)
    dw, db = xp.empty((c_out, c_in), dt), xp.empty((c_out,), dt)
    fns = {
        "fwd": lambda: linear_forward(x, w, b, out=y),
        "dgrad": lambda: gemm(dy, w, out=dx),
        "wgrad": lambda: gemm(dy, x, trans_a=True, out=dw),
        "bwd": lambda: linear_backward(dy, x, w, dx_out=dx, dw_out=dw, db_out=db),
        "bias_grad": lambda: bias_grad(dy, out=db),
        "bias_add": lambda: add_bias(y, b),
    }
    flops = linear_flops(n, c_in, c_out)
    s = dt.itemsize
    res = {"n": n, "c_in": c_in, "c_out": c_out, "dtype": backend.dtype_name(dt)}
    for name, fn in fns.items():
        t = time_fn(fn, xp=xp, reps=reps)
        entry = {"ms": t.median_ms}
        if name in ("fwd", "dgrad", "wgrad", "bwd"):
            entry["tflops"] = t.tflops(flops * (2 if name == "bwd" else 1))
        elif name == "bias_grad":
            entry["gbps"] = t.gbps((n * c_out + c_out) * s)  # read dy, write db
        else:
            entry["gbps"] = t.gbps((2 * n * c_out + c_out) * s)  # read y and b, write y
        res[name] = entry
    return res


def attention_stage_times(q, k, v, do, causal=True, *, method="auto", fp32_scores=True, reps=20, warmup=3):
    """Median milliseconds of each stage of attention's forward and backward, timed one stage at a time.

    Returns a list of dicts ``{"pass": "fwd"|"bwd", "stage": ..., "kind": "gemm"|"softmax", "ms": ...}``.
    """
    stages = attention_stages(q, k, v, do, causal, method=method, fp32_scores=fp32_scores)
    for *_, fn in stages:
        fn()
    xp = backend.get_array_module(q)
    rows = []
    for pas, stage, kind, fn in stages:
        t = time_fn(fn, xp=xp, warmup=warmup, reps=reps)
        rows.append({"pass": pas, "stage": stage, "kind": kind, "ms": t.median_ms})
    return rows


def checkpointing_sweep(config: GPTConfig, *, batch: int, seq: int, ks=(0, 1, 2, 4), dtype="bf16", xp=None,
                        reps: int = 5, warmup: int = 1, seed: int = 0) -> list[dict]:
    """Memory and time of one forward + backward pass for each ``checkpoint_every`` in ``ks``.

    Per row: ``k``, ``ms`` (median time of forward + backward, CUDA events on the GPU), the activation
    bytes the model kept (``activation_stored_bytes`` after the forward, ``activation_peak_bytes``
    during the backward; counted, both backends), and on the GPU ``peak_bytes``: what the CuPy memory
    pool held at its high-water mark (the pool is emptied of cached blocks before each k, and a pool
    never gives memory back by itself, so its total after the run is the peak), with
    ``static_bytes``: what it held before the pass (weights, gradients, optimizer state, the batch).
    """
    xp = xp or backend.default_xp()
    model = GPT(config, dtype=dtype, xp=xp, seed=seed)
    rng = np.random.default_rng(seed)
    idx = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)
    tgt = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)
    rows = []
    for k in ks:
        model.checkpoint_every = k
        row = {"k": int(k), "label": "off" if k == 0 else f"every {k}",
               "extra_flops": training_flops(config, batch, seq, k)["recompute_fraction"]}
        pool = None
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
            pool = xp.get_default_memory_pool()
            pool.free_all_blocks()
            row["static_bytes"] = int(pool.total_bytes())

        def step():
            model.forward_backward(idx, tgt)

        t = time_fn(step, xp=xp, warmup=warmup, reps=reps)
        row["ms"] = t.median_ms
        row["activation_stored_bytes"] = model.stats["activation_bytes_stored"]
        row["activation_peak_bytes"] = model.stats["activation_bytes_peak"]
        if pool is not None:
            row["peak_bytes"] = int(pool.total_bytes())
        rows.append(row)
    model.zero_grad()
    base = rows[0]
    for r in rows:
        r["time_vs_off"] = r["ms"] / base["ms"]
        key = "peak_bytes" if "peak_bytes" in r else "activation_peak_bytes"
        r["memory_vs_off"] = r[key] / base[key]
    return rows


__all__ = ["attention_stage_times", "checkpointing_sweep", "matmul_sweep", "measure_linear"]
