"""``llmgpu bench --preset gpt2,d24,d36,d48``: the scale table of chapter 8.

For each preset, for llmgpu (the fast step as one CUDA graph on the GPU; ``FastGPT`` eager on NumPy) and
for PyTorch (``torch.compile`` in ``--compile-mode``, the SDPA backend ``llmgpu bench`` picks; eager with
``--compile-mode none``): the **largest power-of-two batch that fits**, tried from a start downwards, an
out-of-memory error caught and the memory released before the next try; then tokens/s, MFU
(``GPTConfig.flops_per_token``, the bench's GEMM ceiling) and peak memory at that batch.

* llmgpu starts at ``--batch`` (default: the largest power of two that ``activation_bytes``, the parameter
  state and the logits say fits in the free memory; the formula leaves out workspaces and the pool's
  slack, so it is optimistic: a first try may fail);
* PyTorch starts at llmgpu's batch (each torch.compile try compiles anew: a minute or more), so the two
  are usually compared at the same batch; on an OOM it halves too.
* ``--checkpoint-every K`` applies where it is needed: a framework whose largest batch without it is below
  ``--min-batch`` is searched again with checkpointing every K blocks (both frameworks can).

Results are merged by preset into ``--json`` (default ``benchmarks/results/scale_table.json`` when that
folder exists), so the table can be measured one preset per command; ``llmgpu.plotting.plot_scale_table``
draws MFU and peak memory against model size.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from .bench import BENCH_DEFAULTS, optimizer_settings, release_memory, run_llmgpu, run_options, torch_sdpa
from .model import GPTConfig
from .model.config import activation_bytes
from .perf import timing
from .perf.timing import MFU_DEFINITION, mfu, mfu_ceiling
from .torch_reference import import_torch, run_torch

STATE_BYTES = 18  # per parameter in bf16 training: fp32 master, gradient, m, v + the bf16 copy
MAX_BATCH = 1024


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory error of CuPy, PyTorch or the host."""
    if isinstance(e, MemoryError):
        return True
    name, text = type(e).__name__, str(e).lower()
    return name in ("OutOfMemoryError", "CUDAOutOfMemoryError") or "out of memory" in text or \
        "alloc_failed" in text  # cuBLAS / cuDNN: CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED


def largest_batch(run, start: int, *, min_batch: int = 1, log=print) -> tuple[int | None, dict | None, list]:
    """``(batch, result, tried)``: ``run(batch)`` for batch = start, start/2, ... ≥ ``min_batch`` until one does
    not run out of memory; ``tried`` lists ``(batch, "OOM")`` for the ones that did. Other errors propagate."""
    b, tried = int(start), []
    while b >= max(1, min_batch):
        try:
            return b, run(b), tried
        except Exception as e:
            if not is_oom(e):
                raise
            log(f"    batch {b}: out of memory")
            tried.append((b, "OOM"))
            del e
            release_memory()
            b //= 2
    return None, None, tried


def estimated_batch(cfg: GPTConfig, seq: int, free_bytes: int, checkpoint_every: int = 0) -> int:
    """The largest power-of-two batch whose parameter state, activations (``activation_bytes``, flash) and
    bf16 logits with their gradient fit in ``free_bytes`` (1 if none)."""
    n = cfg.num_parameters() * STATE_BYTES
    b = 1
    while b < MAX_BATCH:
        nb = 2 * b
        act = activation_bytes(cfg, nb, seq, checkpoint_every, "bf16", attention="flash", keeps_ln_1=True)["peak"]
        if n + act + 2 * 2 * nb * seq * cfg.padded_vocab_size > free_bytes:
            break
        b = nb
    return b


def _measure(label, run, start, min_batch, ckpt, log):
    """One framework on one preset: the search without checkpointing, then with it where needed."""
    log(f"  {label}: from batch {start}")
    lo = min(min_batch, start) if ckpt else 1  # without a fallback, down to batch 1
    b, r, tried = largest_batch(lambda n: run(n, 0), start, min_batch=lo, log=log)
    if b is None and ckpt:
        log(f"  {label}: nothing fits from batch {min_batch} up without checkpointing; --checkpoint-every {ckpt}")
        b, r, more = largest_batch(lambda n: run(n, ckpt), start, min_batch=1, log=log)
        tried += more
    if r is None:
        return {"framework": label, "error": f"out of memory at every batch tried ({[t[0] for t in tried]})",
                "tried": tried}
    r["tried"] = tried
    return r


def scale_main(args, xp) -> int:
    """The scale table for ``args.preset`` (comma-separated), printed and merged into the JSON file."""
    gpu = xp is not np
    presets = list(dict.fromkeys(p.strip() for p in str(args.preset or "").split(",") if p.strip()))
    for p in presets:
        GPTConfig.preset(p)  # a ValueError naming the presets
    d = BENCH_DEFAULTS["gpu" if gpu else "cpu"]
    seq = int(getattr(args, "seq", None) or d["seq"])
    steps = int(getattr(args, "steps", None) or (10 if gpu else 1))
    warmup = int(getattr(args, "warmup", None) if getattr(args, "warmup", None) is not None else (3 if gpu else 0))
    dtype = getattr(args, "dtype", None) or d["dtype"]
    min_batch = int(getattr(args, "min_batch", 8) or 1)
    ckpt, compile_mode, seed, note = run_options(args, xp)
    ceiling, ceiling_src = mfu_ceiling(xp, dtype)
    print(f"GEMM ceiling ({ceiling_src}): {ceiling:.3g} TFLOP/s; {MFU_DEFINITION}")
    try:
        torch = import_torch()
        torch_reason = "PyTorch has no CUDA device here" if gpu and not torch.cuda.is_available() else None
    except ImportError as e:
        torch, torch_reason = None, str(e)
    tmode = "eager" if compile_mode == "none" else "compile"
    log = print
    table = {}
    for name in presets:
        cfg = GPTConfig.preset(name)
        cfg = replace(cfg, block_size=max(cfg.block_size, seq), pad_vocab_to=int(getattr(args, "pad_vocab", 64) or 0))
        fpt = cfg.flops_per_token(seq)
        print(f"\n{name}: L={cfg.n_layer} C={cfg.n_embd}, {cfg.num_parameters() / 1e6:.0f}M parameters, T={seq}")
        if getattr(args, "batch", None):
            start = int(args.batch)
        elif gpu:
            release_memory()
            start = estimated_batch(cfg, seq, int(xp.cuda.runtime.memGetInfo()[0]))
        else:
            start = d["batch"]

        def ours(b, k, cfg=cfg):
            return run_llmgpu(cfg, b, seq, steps, warmup=warmup, dtype=dtype, xp=xp, checkpoint_every=k, seed=seed,
                              fast=True, graph=gpu)

        row = {"preset": name, "parameters": cfg.num_parameters(), "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
               "seq": seq, "flops_per_token": fpt}
        row["llmgpu"] = _measure("llmgpu-fast" + ("-graph" if gpu else ""), ours, start, min_batch, ckpt, log)
        release_memory()
        b0 = row["llmgpu"].get("batch") or start
        if torch_reason:
            row["torch"] = {"framework": "pytorch", "skipped": torch_reason}
        else:
            sdpa, pick = torch_sdpa(args, cfg, b0, seq, dtype, gpu)

            def theirs(b, k, cfg=cfg, sdpa=sdpa):
                return run_torch(cfg, b, seq, steps, tmode, dtype=dtype, settings=optimizer_settings(xp),
                                 warmup=warmup + (3 if tmode == "compile" else 0), device="cuda" if gpu else "cpu",
                                 seed=seed, compile_mode="default" if tmode == "eager" else compile_mode, sdpa=sdpa,
                                 checkpoint_every=k)

            row["torch"] = _measure(f"torch-{tmode}", theirs, b0, min_batch, ckpt, log)
            row["torch"]["sdpa_pick"] = pick
            release_memory()
        for side in ("llmgpu", "torch"):
            r = row[side]
            if r.get("tokens_per_s"):
                r["mfu"] = mfu(fpt, r["tokens_per_s"], ceiling)
                print(f"  {side:>6}: batch {r['batch']}, checkpoint_every {r.get('checkpoint_every', 0)}, "
                      f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, peak "
                      + ("-" if r.get("peak_memory_bytes") is None else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"))
        a, b = row["llmgpu"].get("tokens_per_s"), row["torch"].get("tokens_per_s")
        row["llmgpu_over_torch"] = a / b if a and b else None
        table[name] = row
    print()
    print(format_scale_table(list(table.values())))
    out = getattr(args, "json", None) or (str(Path("benchmarks/results/scale_table.json"))
                                          if Path("benchmarks/results").is_dir() and gpu else None)
    if out:
        old = {}
        if Path(out).exists():
            try:
                old = json.loads(Path(out).read_text()).get("presets", {})
            except (ValueError, OSError):
                old = {}
        payload = {"benchmark": "llmgpu bench scale table", "gpu": gpu, "note": note, "dtype": dtype, "seq": seq,
                   "steps": steps, "compile_mode": compile_mode, "gemm_ceiling_tflops": ceiling,
                   "gemm_ceiling": ceiling_src, "mfu_definition": MFU_DEFINITION,
                   "torch": getattr(torch, "__version__", None) if torch else None,
                   "presets": {**old, **table}}
        timing.save_results(out, payload, xp=xp)
        print(f"wrote {out}")
    return 0 if all(r["llmgpu"].get("tokens_per_s") for r in table.values()) else 1


def format_scale_table(rows) -> str:
    """One line per preset: parameters, then batch, tokens/s, MFU, peak GiB for llmgpu and PyTorch, and the ratio."""
    head = (f"{'preset':<7}{'params':>8} | {'llmgpu B':>8}{'tokens/s':>11}{'MFU':>7}{'GiB':>7} | "
            f"{'torch B':>8}{'tokens/s':>11}{'MFU':>7}{'GiB':>7} | {'ratio':>6}")
    lines = [head, "-" * len(head)]

    def cells(r):
        if not r.get("tokens_per_s"):
            return f"{'-':>8}{(r.get('skipped') or r.get('error') or '-')[:30]:>32}"
        k = r.get("checkpoint_every") or 0
        mem = r.get("peak_memory_bytes")
        return (f"{str(r['batch']) + ('c' + str(k) if k else ''):>8}{r['tokens_per_s']:>11,.0f}"
                f"{100 * r['mfu'] if r.get('mfu') is not None else float('nan'):>6.1f}%"
                f"{'-' if mem is None else f'{mem / 2**30:.1f}':>7}")

    for row in rows:
        ratio = row.get("llmgpu_over_torch")
        lines.append(f"{row['preset']:<7}{row['parameters'] / 1e6:>7.0f}M | {cells(row['llmgpu'])} | "
                     f"{cells(row['torch'])} | {'-' if ratio is None else f'{ratio:.2f}x':>6}")
    lines.append("B: the largest power-of-two batch that fit (cK: with checkpointing every K blocks); ratio: llmgpu / "
                 "PyTorch tokens/s")
    return "\n".join(lines)


__all__ = ["estimated_batch", "format_scale_table", "is_oom", "largest_batch", "scale_main"]
