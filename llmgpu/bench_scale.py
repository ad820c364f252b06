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
  are usually compared at the same batch; on an OOM it halves too. Measured alone (``--modes torch-…``) it
  starts where llmgpu would: ``--batch`` or the estimate.
* ``--checkpoint-every K`` applies where it is needed: a framework whose largest batch without it is below
  ``--min-batch`` is searched again with checkpointing every K blocks (both frameworks can).

On the H200, after one ``torch.compile`` try ran out of memory, the next tries in the same process ran out of
memory too, at batches that fit in a fresh process. So on a GPU every try (one framework, one batch) runs in a
fresh Python process (``python -m llmgpu.bench_scale``, the result handed back as JSON; exit status 3 for out of
memory), and this process only searches, prints and saves; ``--same-process`` runs the tries here instead.
Each framework's row is saved as soon as it is measured and the rows of one preset merge, so the table can
also be measured one framework per command (``--modes llmgpu-fast-graph`` / ``--modes torch-compile``).

Results are merged by preset into ``--json`` (default ``benchmarks/results/ch8/scale_table.json`` when that
folder exists), so the table can be measured one preset per command; ``llmgpu.plotting.plot_scale_table``
draws MFU and peak memory against model size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from . import backend
from .bench import BENCH_DEFAULTS, TRAIN_FLAGS, optimizer_settings, release_memory, run_llmgpu, run_options, torch_sdpa
from .bench_fp8 import FP8_BENCH_MODES
from .model import FastOptions, GPTConfig
from .model.config import activation_bytes, state_bytes_per_parameter
from .perf import timing
from .perf.timing import MFU_DEFINITION, mfu, mfu_ceiling
from .results import RESULTS
from .torch_reference import import_torch, run_torch
from .train.config import TrainConfig, resolve

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
    n = cfg.num_parameters() * sum(state_bytes_per_parameter("bf16").values())
    b = 1
    while b < MAX_BATCH:
        nb = 2 * b
        act = activation_bytes(cfg, nb, seq, checkpoint_every, "bf16", attention="flash", keeps_ln_1=True)["peak"]
        if n + act + 2 * 2 * nb * seq * cfg.padded_vocab_size > free_bytes:
            break
        b = nb
    return b


EXIT_OOM = 3  # a try's process: out of memory


def run_isolated(kind: str, spec: dict) -> dict:
    """One try in a fresh Python process: ``kind`` "llmgpu" (the fast step, a CUDA graph on a GPU) or "torch"
    (``run_torch``), ``spec`` its arguments (``_one_try``). Returns its result; raises MemoryError when the process
    ran out of memory and RuntimeError (with its last lines) when it failed otherwise."""
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "result.json"
        p = subprocess.run([sys.executable, "-m", "llmgpu.bench_scale", kind, json.dumps(spec), str(res)],
                           capture_output=True, text=True)
        if p.returncode == EXIT_OOM:
            raise MemoryError(f"out of memory ({kind} at batch {spec['batch']}, in its own process)")
        if p.returncode != 0 or not res.exists():
            tail = " | ".join((p.stderr or p.stdout or "").strip().splitlines()[-3:])
            raise RuntimeError(f"the {kind} try at batch {spec['batch']} failed in its process (exit {p.returncode}): "
                               f"{tail}")
        return json.loads(res.read_text())


def _one_try(kind: str, spec: dict) -> dict:
    """One try in this process (``run_isolated``'s child, or every try with ``--same-process``)."""
    xp = backend.select_xp(spec["device"])
    gpu = xp is not np
    cfg = GPTConfig(**spec["config"])
    b, seq, steps, k = spec["batch"], spec["seq"], spec["steps"], spec["checkpoint_every"]
    if kind == "llmgpu":
        return run_llmgpu(cfg, b, seq, steps, warmup=spec["warmup"], dtype=spec["dtype"], xp=xp, checkpoint_every=k,
                          seed=spec["seed"], fast=True, graph=gpu,
                          options=FastOptions(attention_kernel=spec.get("attention_kernel", "auto")))
    if kind == "torch":
        return run_torch(cfg, b, seq, steps, spec["mode"], dtype=spec["dtype"], settings=optimizer_settings(xp),
                         warmup=spec["warmup"], device="cuda" if gpu else "cpu", seed=spec["seed"],
                         compile_mode=spec["compile_mode"], sdpa=spec["sdpa"], checkpoint_every=k)
    raise ValueError(f"unknown kind of try {kind!r} (llmgpu or torch)")


def _child_main(argv) -> int:
    """``python -m llmgpu.bench_scale KIND SPEC_JSON RESULT_PATH``: one try, its result written to RESULT_PATH."""
    kind, spec, out = argv[0], json.loads(argv[1]), Path(argv[2])
    try:
        r = _one_try(kind, spec)
    except Exception as e:  # noqa: BLE001 - out of memory is an answer, anything else a failure
        if is_oom(e):
            print(f"out of memory: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_OOM
        raise
    out.write_text(json.dumps(r, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    return 0


def _isolated(args, gpu: bool) -> bool:
    """Whether each try runs in its own process: on a GPU, unless ``--same-process``."""
    return gpu and not getattr(args, "same_process", False)


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


def _sides(args) -> tuple[str, ...]:
    """Which frameworks ``--modes`` asks for: any ``llmgpu*`` mode measures llmgpu, any ``torch*`` PyTorch
    (default both). One side per process keeps one framework's leftovers from squeezing the other."""
    modes = [m.strip() for m in str(getattr(args, "modes", None) or "").split(",") if m.strip()]
    if not modes:
        return ("llmgpu", "torch")
    if fp8 := [m for m in modes if m in FP8_BENCH_MODES]:  # its llmgpu side is the bf16 graph: never FP8 unnoticed
        raise ValueError(f"--modes {','.join(fp8)}: the scale table measures the bf16 steps; FP8 runs one preset per "
                         f"command (llmgpu bench --preset d36 --modes {','.join(FP8_BENCH_MODES)})")
    sides = tuple(s for s in ("llmgpu", "torch") if any(m.startswith(s) for m in modes))
    if not sides:
        raise ValueError(f"--modes {','.join(modes)}: the scale table measures llmgpu* and/or torch* modes")
    return sides


def _merge_row(old: dict | None, new: dict) -> dict:
    """A preset's row after measuring some of its sides: the sides measured now replace the old ones, the
    others are kept (a table measured one framework per command), and the ratio is taken again."""
    row = {**(old or {}), **{k: v for k, v in new.items() if k not in ("llmgpu", "torch")}}
    for side in ("llmgpu", "torch"):
        if side in new:
            row[side] = new[side]
        row.setdefault(side, {"framework": side, "skipped": "not measured"})
    a, b = row["llmgpu"].get("tokens_per_s"), row["torch"].get("tokens_per_s")
    row["llmgpu_over_torch"] = a / b if a and b else None
    return row


def scale_main(args, xp) -> int:
    """The scale table for ``args.preset`` (comma-separated), printed and merged into the JSON file after
    every measurement (a run cut short keeps what it measured)."""
    gpu = xp is not np
    if getattr(args, "arch", None) not in (None, "gpt2"):
        raise ValueError(f"the scale table is GPT-2's; --arch {args.arch} measures one preset (no --scale-table, "
                         "no comma-separated presets)")
    d = BENCH_DEFAULTS["gpu" if gpu else "cpu"]
    presets = list(dict.fromkeys(p.strip() for p in str(args.preset or d["preset"]).split(",") if p.strip()))
    if not presets:
        raise ValueError(f"--preset {args.preset!r} names no preset: give one or several, comma-separated")
    seq = int(getattr(args, "seq", None) or d["seq"])
    steps = int(getattr(args, "steps", None) or (10 if gpu else 1))
    warmup = int(getattr(args, "warmup", None) if getattr(args, "warmup", None) is not None else (3 if gpu else 0))
    given = {k: v for k in TRAIN_FLAGS if (v := getattr(args, k, None)) is not None}
    for p in presets:
        GPTConfig.preset(p)  # a ValueError naming the presets
        resolve(TrainConfig(**{**given, "preset": p, "seq": seq, "steps": steps, "warmup": warmup}), np)  # TRAIN_FLAGS
    sides = _sides(args)
    dtype = getattr(args, "dtype", None) or d["dtype"]
    min_batch = int(getattr(args, "min_batch", 8) or 1)
    ckpt, compile_mode, seed, note = run_options(args, xp)
    ceiling, ceiling_src = mfu_ceiling(xp, dtype)
    print(f"GEMM ceiling ({ceiling_src}): {ceiling:.3g} TFLOP/s; {MFU_DEFINITION}")
    torch, torch_reason = None, None
    if "torch" in sides:
        try:
            torch = import_torch()
            torch_reason = "PyTorch has no CUDA device here" if gpu and not torch.cuda.is_available() else None
        except ImportError as e:
            torch_reason = str(e)
    tmode = "eager" if compile_mode == "none" else "compile"
    try_one = run_isolated if _isolated(args, gpu) else _one_try
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    default = RESULTS / "ch8" / "scale_table.json"  # in a checkout, run from its root
    out = getattr(args, "json", None) or (str(default) if RESULTS.is_dir() and gpu else None)
    table = {}
    for name in presets:
        cfg = GPTConfig.preset(name)
        cfg = replace(cfg, block_size=given.get("block_size", cfg.block_size),
                      pad_vocab_to=int(getattr(args, "pad_vocab", 64) or 0))
        fpt = cfg.flops_per_token(seq)
        log(f"{name}: L={cfg.n_layer} C={cfg.n_embd}, {cfg.num_parameters() / 1e6:.0f}M parameters, T={seq}")
        if getattr(args, "batch", None):
            start = int(args.batch)
        elif gpu:
            release_memory()
            start = estimated_batch(cfg, seq, int(xp.cuda.runtime.memGetInfo()[0]))
        else:
            start = d["batch"]

        base = {"device": "gpu" if gpu else "cpu", "config": asdict(cfg), "seq": seq, "steps": steps, "dtype": dtype,
                "seed": seed, "attention_kernel": getattr(args, "attention_kernel", None) or "auto"}

        def ours(b, k, base=base):
            return try_one("llmgpu", {**base, "batch": b, "checkpoint_every": k, "warmup": warmup})

        row = {"preset": name, "parameters": cfg.num_parameters(), "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
               "seq": seq, "flops_per_token": fpt}

        def done(side, r, row=row, name=name, fpt=fpt):
            if r.get("tokens_per_s"):
                r["mfu"] = mfu(fpt, r["tokens_per_s"], ceiling)
                log(f"  {side}: batch {r['batch']}, checkpoint_every {r.get('checkpoint_every', 0)}, "
                    f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, peak "
                    + ("-" if r.get("peak_memory_bytes") is None else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"))
            else:
                log(f"  {side}: {r.get('skipped') or r.get('error')}")
            # rows merged from several commands (or sessions) say when, and against which ceiling, each side ran
            r["date"] = timing.results_header(xp)["date"]
            r["gemm_ceiling_tflops"] = ceiling
            row[side] = r
            old_file = _saved_file(out)
            saved = old_file.get("presets", {})
            table[name] = _merge_row(saved.get(name), row)
            if out:
                payload = {"benchmark": "llmgpu bench scale table", "gpu": gpu, "note": note, "dtype": dtype,
                           "seq": seq, "steps": steps, "compile_mode": compile_mode, "gemm_ceiling_tflops": ceiling,
                           "gemm_ceiling": ceiling_src, "mfu_definition": MFU_DEFINITION,
                           "torch": getattr(torch, "__version__", None) if torch else old_file.get("torch"),
                           "presets": {**saved, **table}}
                timing.save_results(out, payload, xp=xp)

        if "llmgpu" in sides:
            done("llmgpu", _measure("llmgpu-fast" + ("-graph" if gpu else ""), ours, start, min_batch, ckpt, log))
            release_memory()
        if "torch" in sides:
            b0 = row.get("llmgpu", {}).get("batch") or start
            if torch_reason:
                done("torch", {"framework": "pytorch", "skipped": torch_reason})
            else:
                sdpa, pick = torch_sdpa(args, cfg, b0, seq, dtype, gpu)

                def theirs(b, k, sdpa=sdpa, base=base):
                    return try_one("torch", {**base, "batch": b, "checkpoint_every": k, "mode": tmode, "sdpa": sdpa,
                                             "warmup": warmup + (3 if tmode == "compile" else 0),
                                             "compile_mode": "default" if tmode == "eager" else compile_mode})

                r = _measure(f"torch-{tmode}", theirs, b0, min_batch, ckpt, log)
                r["sdpa_pick"] = pick
                done("torch", r)
                release_memory()
    print()
    print(format_scale_table(list(table.values())))
    if out:
        print(f"wrote {out}")
    # 1 when a framework asked for measured nothing (every batch out of memory); a skipped one (PyTorch not
    # installed, no CUDA for it) is said in its row and is not a failure
    return 0 if all(table[n][s].get("tokens_per_s") or table[n][s].get("skipped") for n in table for s in sides) \
        else 1


def _saved_file(out) -> dict:
    """What the JSON file ``out`` already holds (its ``presets`` and header; empty if missing or unreadable)."""
    if not out or not Path(out).exists():
        return {}
    try:
        data = json.loads(Path(out).read_text())
    except (ValueError, OSError):
        return {}
    return data if isinstance(data, dict) else {}


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
    lines += textwrap.wrap("B: the largest power-of-two batch that fit (cK: with checkpointing every K blocks); ratio: "
                           "llmgpu / PyTorch tokens/s", len(head))
    return "\n".join(lines)


__all__ = ["estimated_batch", "format_scale_table", "is_oom", "largest_batch", "scale_main"]


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
