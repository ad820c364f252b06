"""``llmgpu bench``: GPT-2 (or Llama) training throughput, llmgpu next to PyTorch on the same GPU (chapters 8, 10).

One run trains the same model on the same synthetic tokens with

* **llmgpu**: ``llmgpu.model.GPT`` (the book step) or ``FastGPT`` (chapter 8; Llama: ``Llama``, ``FastLlama``),
  driven by ``llmgpu.train.TrainStep``, the step of ``llmgpu train`` (fused clip, fused AdamW, eager or one
  CUDA graph), with the optimizer settings of ``TrainConfig``;
* **PyTorch** (when importable): the same GPT-2 in ``llmgpu.torch_reference`` (nanoGPT-style, flash
  SDPA), bf16 autocast, fused AdamW, the same clipping; eager and ``torch.compile``.

and reports per mode the median milliseconds per optimizer step, tokens per second, MFU and peak memory. **MFU**
(``llmgpu.perf.timing.mfu``) divides the FLOPs the model needs (``GPTConfig.flops_per_token``: 6·N + 12·L·C·T) per
second by the bf16 GEMM ceiling *measured in the same run* (``mfu_ceiling``: cuBLAS 8192³); the datasheet peak is
printed beside it, labelled. Recomputation (activation checkpointing) does not count: MFU measures useful work. The
same N enters both frameworks: the tokens/s ratio compares them, MFU says how far each is from the hardware.

**Fair settings.** Both frameworks train the same vocabulary: ``--pad-vocab`` defaults to 64 for both (50257 → 50304,
what nanoGPT and llm.c train; ``FastGPT`` pads to a multiple of 64 in any case), and the mode
``torch-compile-unpadded`` adds PyTorch at the unpadded 50257, so the ratio to both is printed. PyTorch runs with the
SDPA backend that is fastest on this GPU for the model's attention (flash or cuDNN, timed once:
``torch_reference.pick_sdpa_backend``; ``--sdpa`` forces one) and the ``torch.compile`` mode of ``--compile-mode``.

``--preset gpt2,d24,d36,d48`` (several presets, or ``--scale-table``) makes the scale table instead
(``llmgpu.bench_scale``): per preset the largest power-of-two batch that fits, tokens/s, MFU and peak memory for llmgpu
and torch.compile side by side.

Peak memory: ``torch.cuda.max_memory_allocated`` for PyTorch; for llmgpu the high-water mark of CuPy's memory pool (it
keeps freed blocks cached, so ``total_bytes`` after the run is the most it held: fragmentation may add a little).

``--arch llama`` (or a Llama preset: ``smollm-135m`` by default on a GPU, ``llama-tiny`` on a CPU) measures the
Llama family, with the same modes: llmgpu's book step (``llmgpu.model.Llama``) and fast step (``FastLlama``, chapter
10) against ``torch_reference.build_torch_llama``, eager and compiled, on the same padded vocabulary; MFU from
``LlamaConfig.flops_per_token``.

FP8 (chapter 5b): ``--modes llmgpu-fp8-graph,torch-compile-fp8``, llmgpu's against torchao's (``llmgpu.bench_fp8``).
Use: ``llmgpu bench`` (the CLI calls ``bench_main``), or ``run_llmgpu`` / ``run_torch`` directly.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np

from . import backend
from .bench_fp8 import FP8_BENCH_MODES, fp8_ratios, fp8_recipe, fp8_skip_reason
from .gemm import lt_splitk
from .model import FastOptions
from .model.family import ARCHS, FAMILIES, arch_of_preset, fast_model_class, model_class
from .model.options import FLASH_KERNELS
from .perf import clocks, timing
from .perf.timing import MFU_DEFINITION, datasheet_peak_tflops, mfu, mfu_ceiling
from .torch_reference import COMPILE_MODES, SDPA_BACKENDS, import_torch, pick_sdpa_backend, run_torch
from .train.config import CPU_DEFAULTS, FP8_RECIPES, GPU_DEFAULTS, TrainConfig, resolve
from .train.step import EAGER_WARMUP, TrainStep

MODES = ("llmgpu", "llmgpu-fast", "llmgpu-fast-graph", "torch-eager", "torch-compile", "torch-compile-unpadded",
         *FP8_BENCH_MODES)
DEFAULT_MODES = ("llmgpu", "llmgpu-fast-graph", "torch-eager", "torch-compile")  # on the CPU: llmgpu-fast
# the benchmark's own sizes (a throughput measurement, not a training run's defaults)
BENCH_DEFAULTS = {"gpu": {"preset": "gpt2", "batch": 64, "seq": 1024, "steps": 20, "warmup": 5, "dtype": "bf16"},
                  "cpu": {"preset": "tiny", "batch": 4, "seq": 64, "steps": 3, "warmup": 1, "dtype": "fp32"}}
# the Llama family: its presets instead of GPT-2's, the same modes
LLAMA_PRESETS = {"gpu": "smollm-135m", "cpu": "llama-tiny"}
# llmgpu train's flags too: checked by its rules before a model is built (train.config.resolve; NumPy: no device probed)
TRAIN_FLAGS = ("batch", "seq", "steps", "warmup", "vocab_size", "block_size", "pad_vocab", "checkpoint_every", "seed")


def optimizer_settings(xp) -> TrainConfig:
    """The optimizer settings both frameworks train with: ``llmgpu train``'s on this device."""
    d = GPU_DEFAULTS if xp is not np else CPU_DEFAULTS
    return TrainConfig(lr=d["lr"])


def release_memory():
    """Give cached GPU memory back between modes: CuPy's pool and PyTorch's caching allocator (and
    torch.compile's caches), so one framework's leftovers do not squeeze the next one."""
    gc.collect()
    cp = backend.cupy_module()
    if cp is not None and backend.gpu_available():
        cp.cuda.Device().synchronize()
        cp.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            torch._dynamo.reset()
        except Exception:
            pass
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- llmgpu


def make_train_step(config, batch: int, seq: int, *, dtype: str = "bf16", xp=None, checkpoint_every: int = 0,
                    seed: int = 0, fast: bool = False, graph: bool = False, options: FastOptions | None = None):
    """``(step, model)``: ``step()`` runs ``llmgpu train``'s step (``TrainStep``) on one fixed synthetic batch and
    returns its device record ``[loss, grad norm, found_inf]`` without waiting for the GPU. ``fast=True``
    uses the family's fast step (``FastGPT``, ``FastLlama``; with ``options``, a ``FastOptions``; None: the
    defaults); ``graph=True`` (with ``fast``)
    replays the step as one CUDA graph from the second call on. ``step.train_step`` is the ``TrainStep`` (its
    ``.graph`` once captured)."""
    xp = xp or backend.default_xp()
    if options is not None and not fast:
        raise ValueError("options= are the fast model's (FastOptions): pass fast=True")
    kw = {"options": options} if fast else {}
    cls = fast_model_class(config) if fast else model_class(config)  # the family's fast step or book step
    model = cls(config, dtype=dtype, checkpoint_every=checkpoint_every, xp=xp, seed=seed, **kw)
    settings = optimizer_settings(xp)
    train_step = TrainStep(model, settings, graph=graph)
    rng = np.random.default_rng(seed)
    x = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)
    y = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)

    def step():
        return train_step([(x, y)], settings.lr)

    step.train_step = train_step
    return step, model


def run_llmgpu(config, batch: int, seq: int, steps: int = 20, *, warmup: int = 3, dtype: str = "bf16", xp=None,
               checkpoint_every: int = 0, seed: int = 0, graph: bool = False, fast: bool = False,
               options: FastOptions | None = None) -> dict:
    """Train the book step of ``config``'s family (``llmgpu.model.GPT`` or ``Llama``; ``fast=True``: its fast step,
    ``FastGPT`` or ``FastLlama``, with ``options``) for ``warmup + steps`` steps on synthetic tokens through
    ``TrainStep``; returns the metrics (with the fast model: the attention kernels its "auto" resolved to,
    ``attention_kernels``).

    ``graph=True`` replays the step as one CUDA graph (``TrainStep``: the first warm-up step eager, the
    second captured) and times its replays: this needs every GEMM of the step routed through
    ``llmgpu.gemm.cublaslt`` (CuPy's cuBLAS refuses capture), i.e. ``fast=True``, otherwise the capture
    error is raised. Times: CUDA events around each step (launch cost included), median.
    """
    xp = xp or backend.default_xp()
    gpu = xp is not np
    if graph and not gpu:
        raise ValueError("graph=True needs the GPU (CuPy) backend")
    pool = xp.get_default_memory_pool() if gpu else None
    if gpu:
        xp.cuda.Device().synchronize()
        pool.free_all_blocks()
    run, model = make_train_step(config, batch, seq, dtype=dtype, xp=xp, checkpoint_every=checkpoint_every,
                                 seed=seed, fast=fast, graph=graph, options=options)
    static_bytes = int(pool.used_bytes()) if gpu else None
    t0 = time.perf_counter()
    for _ in range(max(warmup, EAGER_WARMUP + 1 if graph else 0)):  # graph: the eager warm-up, then the capture
        run()
    if gpu:
        xp.cuda.Device().synchronize()
    warmup_s = time.perf_counter() - t0
    times = []
    t_begin = time.time()  # the timed steps' wall-clock window (to match the clock readings: perf.clocks)
    if gpu:
        evs = [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(steps)]
        for a, b in evs:
            a.record()
            rec = run()
            b.record()
        evs[-1][1].synchronize()
        times = [xp.cuda.get_elapsed_time(a, b) for a, b in evs]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            rec = run()
            times.append((time.perf_counter() - t) * 1e3)
    t_end = time.time()
    ms = statistics.median(times)
    final = float(backend.to_numpy(rec)[0])
    captured = run.train_step.graph
    peak = None
    if gpu:
        peak = int(pool.total_bytes()) + (int(captured.pool.total_bytes()) if captured and captured.pool else 0)
    fp8 = model.options.fp8 if fast else "off"  # FastOptions(fp8=...): the FP8 step (bench_fp8)
    mode = "llmgpu" + ("-fp8" if fp8 != "off" else "-fast" if fast else "") + ("-graph" if graph else "")
    res = {"framework": "llmgpu", "arch": config.arch, "mode": mode, "batch": batch, "seq": seq,
           "dtype": backend.dtype_name(dtype), "steps": steps, "warmup": warmup, "warmup_s": warmup_s,
           "ms_per_step": ms, "ms_min": min(times), "tokens_per_s": batch * seq / (ms * 1e-3),
           "final_loss": final, "peak_memory_bytes": peak, "static_memory_bytes": static_bytes,
           "checkpoint_every": checkpoint_every, "device": backend.device_info(xp).name,
           "vocab": model.config.padded_vocab_size,
           "activation_bytes_peak": model.stats.get("activation_bytes_peak"),  # counted by the model
           "timed_window": [t_begin, t_end]}
    if captured is not None:
        res["graph_nodes"] = captured.node_counts()
    if fast:
        res["attention_kernel"] = model.options.attention_kernel
        res["deterministic_attention"] = model.options.deterministic_attention
        res["attention_kernels"] = model.kernel_choices.as_dict()
        res.update({"fp8_recipe": fp8, "fp8_fused_casts": model.options.fp8_fused_casts} if fp8 != "off" else {})
    if captured is not None and captured.pool is not None:
        # the graph's private pool keeps its freed blocks cached for as long as anything allocated from it lives;
        # drop the step, then hand those blocks back so that the next mode (PyTorch) gets the memory
        graph_pool = captured.pool
        del run, model, captured, rec
        gc.collect()  # the step's reference cycles; bench_main's release_memory() frees the default pool after
        graph_pool.free_all_blocks()
    return res


# --------------------------------------------------------------------------- output


def format_results(rows, *, ceiling_tflops=None) -> str:
    """The benchmark table: mode, batch × seq, dtype, ms/step, tokens/s, MFU, peak memory, ratio to torch.compile (the
    first torch-compile row; an FP8 row's to torch-compile-fp8 too: "vs fp8"), or the reason a mode did not run. The
    mode column is as wide as the longest mode (``torch-compile-unpadded``); the notes below wrap at its width."""
    ref = next((r for r in rows if r.get("mode") == "torch-compile" and r.get("tokens_per_s")), None)
    ref8 = next((r for r in rows if r.get("mode") == "torch-compile-fp8" and r.get("tokens_per_s")), None)
    w = max(len("mode"), *(len(r["mode"]) for r in rows)) + 2
    head = (f"{'mode':<{w}}{'B x T':>11}{'dtype':>6}{'ms/step':>9}{'tokens/s':>10}{'MFU':>7}{'peak GiB':>10}"
            f"{'vs compile':>12}" + (f"{'vs fp8':>8}" if ref8 else "") + f"{'SM MHz':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error") or r.get("skipped"):
            lines.append(f"{r['mode']:<{w}}{'skipped' if r.get('skipped') else 'FAILED'}: "
                         f"{r.get('skipped') or r.get('error')}")
            continue
        mem = r.get("peak_memory_bytes")
        m = r.get("mfu")
        ratio = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        ratio8 = r["tokens_per_s"] / ref8["tokens_per_s"] if ref8 and r.get("fp8_recipe") else None  # FP8 rows only
        clk = (r.get("gpu_clocks") or {}).get("sm_mhz")
        lines.append(f"{r['mode']:<{w}}{str(r['batch']) + ' x ' + str(r['seq']):>11}{r['dtype']:>6}"
                     f"{r['ms_per_step']:>9.2f}{r['tokens_per_s']:>10,.0f}"
                     f"{'-' if m is None or m != m else f'{100 * m:.1f}%':>7}"
                     f"{'-' if mem is None else f'{mem / 2**30:.2f}':>10}"
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>12}"
                     + (f"{'-' if ratio8 is None else f'{ratio8:.2f}x':>8}" if ref8 else "") +
                     f"{'-' if clk is None else f'{clk:.0f}':>8}")
    lines.append("-" * len(head))
    notes = ["SM MHz: the median SM clock over the timed steps (nvidia-smi; the power limit lowers it)"
             ] if any(r.get("gpu_clocks") for r in rows) else []
    notes.append(f"{MFU_DEFINITION}; ceiling {ceiling_tflops:.3g} TFLOP/s" if ceiling_tflops else MFU_DEFINITION)
    lines += [ln for note in notes for ln in textwrap.wrap(note, max(len(head), 72), break_on_hyphens=False)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``llmgpu bench`` (the CLI's sub-parser calls this)."""
    p.add_argument("--arch", choices=ARCHS, help="model family (default: the --preset's, else gpt2); llama: "
                   "llmgpu's Llama steps (book and fast) against the PyTorch Llama of the same shape")
    p.add_argument("--preset", help="model size (default: gpt2 on GPU, tiny on CPU; --arch llama: smollm-135m, "
                                    "llama-tiny); several, comma-separated (gpt2,d24,d36,d48): the scale table")
    p.add_argument("--scale-table", action="store_true", help="the scale table also for one preset: the largest "
                   "power-of-two batch that fits (from --batch down), tokens/s, MFU, peak memory per framework")
    p.add_argument("--min-batch", type=int, default=8, help="scale table: below this batch use --checkpoint-every "
                   "(when given) instead (default 8)")
    p.add_argument("--same-process", action="store_true", help="scale table on a GPU: every try in this process "
                   "(default: each framework at each batch in a fresh process, so an out-of-memory try frees all)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile mode of the PyTorch reference (none: no torch.compile rows)")
    p.add_argument("--sdpa", choices=("auto",) + SDPA_BACKENDS, default="auto",
                   help="PyTorch's attention backend (auto: flash or cuDNN, whichever is faster here, timed once)")
    p.add_argument("--batch", type=int, help="sequences per step (default 64 on GPU, 4 on CPU)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 1024 on GPU, 64 on CPU)")
    p.add_argument("--block-size", type=int, help="context length of the model (default: the preset's; >= --seq)")
    p.add_argument("--steps", type=int, help="timed steps per mode (default 20 on GPU, 3 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 5 on GPU, 1 on CPU; torch.compile: +5)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="compute precision (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--vocab-size", type=int, help="vocabulary (default: the preset's, 50257 for gpt2)")
    p.add_argument("--pad-vocab", type=int, default=64, metavar="M",
                   help="pad the vocabulary to a multiple of M in both frameworks (default 64: 50257 -> 50304; "
                        "0: unpadded, except FastGPT, which always pads)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="activation checkpointing, both frameworks (0 = off; scale table: where needed)")
    p.add_argument("--attention-kernel", choices=FLASH_KERNELS, default="auto",
                   help="flash attention of llmgpu's fast modes (auto: ours or cuDNN, whichever is faster here, per "
                        "shape; the result says which ran)")
    p.add_argument("--nondeterministic-attention", action="store_true",
                   help="let llmgpu's attention backward run cuDNN's default algorithm (atomics: faster, gradients "
                        "not bitwise repeatable; what PyTorch's SDPA runs); default: deterministic")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="scaling of llmgpu-fp8-graph's GEMMs: current (each tensor's amax this step, as torchao's "
                        "tensorwise) or delayed (an amax history, one read per cast: faster); default current")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)}; "
                        "llmgpu-fast instead of llmgpu-fast-graph on the CPU; scale table: llmgpu* and/or torch* pick "
                        "the frameworks, default both)")
    p.add_argument("--json", metavar="PATH", help="write the results here (default on GPU: bench.json)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the GEMM ceiling measurement (no MFU)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p


def run_options(args, xp) -> tuple:
    """(checkpoint_every, torch.compile mode, seed, the CPU note or None) of a bench run, after printing the
    note and the device line every result starts from."""
    gpu = xp is not np
    note = None if gpu else cpu_note(getattr(args, "device", "auto"))
    if note:
        print(note)
    print(f"device: {backend.device_info(xp).summary()}")
    return (int(getattr(args, "checkpoint_every", 0) or 0), getattr(args, "compile_mode", "default") or "default",
            int(getattr(args, "seed", 0) or 0), note)


def cpu_note(device: str = "auto") -> str:
    """The line a CPU run starts with: its figures say nothing about the GPU the benchmark is for."""
    why = "--device cpu" if device == "cpu" else (backend.gpu_unavailable_reason() or "LLMGPU_DEVICE=cpu")
    why = why.split(" (")[0]  # the short reason; `llmgpu info` prints the whole one
    return (f"note: no GPU in use ({why}). These figures are NumPy on the CPU, a smoke test only: "
            "the benchmark's numbers (ms/step, tokens/s, MFU, llmgpu vs PyTorch) need a GPU")


def bench_arch(args) -> str:
    """The family a bench run measures: ``--arch``, else its ``--preset``'s, else GPT-2; a preset of another family
    than ``--arch`` names is refused (ValueError, one line)."""
    arch, preset = getattr(args, "arch", None), getattr(args, "preset", None)
    of_preset = arch_of_preset(preset) if preset and "," not in preset else None
    if arch and of_preset and of_preset != arch:
        raise ValueError(f"--preset {preset} is a {of_preset} model, not --arch {arch}'s; its presets: "
                         f"{', '.join(FAMILIES[arch][1])}")
    return arch or of_preset or "gpt2"


def _defaults(a, gpu, arch="gpt2"):
    d = dict(BENCH_DEFAULTS["gpu" if gpu else "cpu"])
    if arch == "llama":
        d["preset"] = LLAMA_PRESETS["gpu" if gpu else "cpu"]
    return {k: (getattr(a, k, None) if getattr(a, k, None) is not None else v) for k, v in d.items()}


def bench_modes(args, arch: str, gpu: bool) -> list[str]:
    """The modes of ``--modes`` (or the family's defaults), each checked (ValueError, one line)."""
    default = DEFAULT_MODES if gpu else tuple(m.replace("llmgpu-fast-graph", "llmgpu-fast") for m in DEFAULT_MODES)
    modes = [m.strip() for m in str(getattr(args, "modes", None) or ",".join(default)).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:  # a typo, or '--modes ,'
        said = f"unknown mode(s) {bad}" if bad else f"--modes {args.modes!r} names no mode"
        raise ValueError(f"{said}; choose from {', '.join(MODES)}")
    return modes


def wants_scale_table(args) -> bool:
    """Whether ``llmgpu bench``'s arguments ask for the scale table (several presets, or --scale-table)."""
    return "," in str(getattr(args, "preset", None) or "") or bool(getattr(args, "scale_table", False))


def torch_sdpa(args, cfg, batch: int, seq: int, dtype: str, gpu: bool) -> tuple[str | None, dict | None]:
    """``(backend, measurement)``: the SDPA backend PyTorch runs with: ``--sdpa``, or (auto) the faster of
    flash and cuDNN on this GPU for the model's attention, timed once and printed (None on a CPU: PyTorch's
    own choice)."""
    want = getattr(args, "sdpa", "auto") or "auto"
    if want != "auto":
        return want, None
    if not gpu:
        return None, None
    pick = pick_sdpa_backend(cfg, batch, seq, dtype=dtype)
    times = ", ".join(f"{n} {'-' if t is None else f'{t:.3f} ms'}" for n, t in pick["ms"].items())
    print(f"PyTorch SDPA backend: {pick['backend'] or 'default'} (causal fwd+bwd at B={batch} T={seq}: {times})")
    return pick["backend"], pick


def bench_main(args) -> int:
    """Run the benchmark described by ``args`` (``add_arguments``'s namespace), print the table, write JSON."""
    xp = backend.select_xp(getattr(args, "device", "auto"))
    gpu = xp is not np
    if wants_scale_table(args):
        raise ValueError("several presets (or --scale-table) make the scale table: llmgpu.bench_scale.scale_main "
                         "(the `llmgpu bench` command calls it)")
    arch = bench_arch(args)
    o = _defaults(args, gpu, arch)
    modes = bench_modes(args, arch, gpu)
    base = FAMILIES[arch][0].preset(o["preset"])  # an unknown preset: its family's message
    given = {k: v for k in TRAIN_FLAGS if (v := getattr(args, k, None)) is not None}
    resolve(TrainConfig(arch=arch, **{**given, **{k: o[k] for k in ("preset", "batch", "seq", "steps", "warmup")}}), np)
    sizes = {k: given[k] for k in ("vocab_size", "block_size") if k in given}
    cfg = replace(base, **sizes, pad_vocab_to=int(getattr(args, "pad_vocab", 64) or 0))
    ckpt, compile_mode, seed, note = run_options(args, xp)
    recipe = fp8_recipe(getattr(args, "fp8_recipe", None), modes)
    kv = f", {cfg.n_kv_head} K/V heads, ffn {cfg.ffn_dim}" if arch == "llama" else ""
    print(f"model: {o['preset']} ({arch}: L={cfg.n_layer}, H={cfg.n_head}{kv}, C={cfg.n_embd}, vocab {cfg.vocab_size}"
          f"{' padded to ' + str(cfg.padded_vocab_size) if cfg.padded_vocab_size != cfg.vocab_size else ''}); "
          f"B={o['batch']} T={o['seq']} {o['dtype']}; {o['steps']} timed steps after {o['warmup']} warm-up")
    ceiling = ceiling_src = None
    if not getattr(args, "no_ceiling", False):
        ceiling, ceiling_src = mfu_ceiling(xp, o["dtype"])
        sheet, gpu_model = datasheet_peak_tflops(xp, o["dtype"])
        print(f"GEMM ceiling ({ceiling_src}): {ceiling:.3g} TFLOP/s"
              + (f" (datasheet peak of the {gpu_model}: {sheet:.4g} TFLOP/s, not used)" if sheet else ""))
    fpt = cfg.flops_per_token(o["seq"])
    print(f"FLOPs per token: {fpt / 1e9:.3f} GFLOP (6N + 12LCT, N = {cfg.flop_parameters():,})")

    monitor = clocks.ClockMonitor(device=backend.device_info(xp).pci_bus_id or 0).start() if gpu else None
    rows = []
    torch_reason = None
    try:
        torch = import_torch()
        if gpu and not torch.cuda.is_available():
            torch_reason = "PyTorch has no CUDA device here"
    except ImportError as e:
        torch, torch_reason = None, str(e)
    sdpa, sdpa_pick = (torch_sdpa(args, cfg, o["batch"], o["seq"], o["dtype"], gpu) if torch is not None
                       and not torch_reason else (None, None))
    for mode in modes:
        print(f"running {mode} ...", flush=True)
        try:
            fp8 = recipe if mode in FP8_BENCH_MODES else "off"  # llmgpu-fp8-graph, torch-compile-fp8
            why = (torch_reason or ("--compile-mode none" if "-compile" in mode and compile_mode == "none" else None)
                   if mode.startswith("torch") else None) or fp8_skip_reason(mode, arch, o["dtype"], xp, torch)
            if why:
                rows.append({"mode": mode, "skipped": why})
                continue
            if mode.startswith("llmgpu"):
                fast = "-fast" in mode or fp8 != "off"
                opts = FastOptions(attention_kernel=getattr(args, "attention_kernel", None) or "auto",
                                   deterministic_attention=not getattr(args, "nondeterministic_attention", False),
                                   fp8=fp8) if fast else None
                r = run_llmgpu(cfg, o["batch"], o["seq"], o["steps"], warmup=o["warmup"], dtype=o["dtype"], xp=xp,
                               checkpoint_every=ckpt, seed=seed, graph=mode.endswith("-graph"), fast=fast, options=opts)
                if r.get("attention_kernels"):  # what "auto" resolved to, per (direction, shape)
                    print(f"  attention ({r['attention_kernel']}): " + ", ".join(
                        f"{key.split(' ')[0]} {choice}" for key, choice in r["attention_kernels"].items()))
            else:
                tm = mode.split("-")[1]
                tcfg = replace(cfg, pad_vocab_to=0) if mode.endswith("-unpadded") else cfg
                r = run_torch(tcfg, o["batch"], o["seq"], o["steps"], tm, dtype=o["dtype"],
                              settings=optimizer_settings(xp), warmup=o["warmup"] + (5 if tm == "compile" else 0),
                              device="cuda" if gpu else "cpu", seed=seed, compile_mode=compile_mode,
                              sdpa=sdpa, checkpoint_every=ckpt, fp8=fp8 != "off")
                r["mode"] = mode
        except Exception as e:  # one failing mode (OOM, capture refused, ...) must not hide the others
            release_memory()
            rows.append({"mode": mode, "error": f"{type(e).__name__}: {str(e).strip()[:500]}"})
            print(f"  {mode} failed: {type(e).__name__}: {str(e).strip()[:300]}")
            continue
        release_memory()
        if monitor is not None and monitor.available:
            r["gpu_clocks"] = c = monitor.summary(*r["timed_window"])
            if c:
                print(f"  SM clock {c['sm_mhz']:.0f} MHz (lowest {c['sm_mhz_min']:.0f}), {c['power_w']:.0f} W"
                      + (f" of {c['power_limit_w']:.0f}" if c["power_limit_w"] else "")
                      + f", power cap active in {100 * c['power_cap']:.0f} % of {c['samples']} readings")
        r["flops_per_token"] = f = replace(cfg, pad_vocab_to=0).flops_per_token(o["seq"]) if mode.endswith(
            "-unpadded") else fpt  # the FLOPs of the vocabulary this row trained
        r["mfu"] = mfu(f, r["tokens_per_s"], ceiling) if ceiling else None
        rows.append(r)
        print(f"  {r['ms_per_step']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, final loss {r['final_loss']:.3f}")
    if monitor is not None:
        monitor.stop()
        if not monitor.available:
            print(f"(no clock readings: {monitor.reason})")
    print()
    print(format_results(rows, ceiling_tflops=ceiling))
    ref = next((r for r in rows if r.get("mode") == "torch-compile" and r.get("tokens_per_s")), None)
    ours = max((r for r in rows if r.get("framework") == "llmgpu" and r.get("tokens_per_s") and "fp8_recipe" not in r),
               key=lambda r: r["tokens_per_s"], default=None)  # our best bf16/fp32 mode (FP8: fp8_ratios)
    ratio = ours["tokens_per_s"] / ref["tokens_per_s"] if ours and ref else None
    ratios = {}
    for r in rows:  # our best mode against each torch.compile row, saying which vocabulary each trained
        if ours and r.get("mode", "").startswith("torch-compile") and r.get("tokens_per_s"):
            ratios[r["mode"]] = x = ours["tokens_per_s"] / r["tokens_per_s"]
            print(f"llmgpu ({ours['mode']}, vocab {ours.get('vocab')}) / {r['mode']} (vocab {r.get('vocab')}"
                  f"{', ' + r['compile_mode'] if r.get('compile_mode') else ''}) tokens/s: {x:.3f}"
                  + ("  <- the fair comparison (same vocabulary)" if r.get("vocab") == ours.get("vocab") else ""))
    ratios8 = fp8_ratios(rows)
    out = getattr(args, "json", None) or ("bench.json" if gpu else None)
    if out:
        payload = {"benchmark": "llmgpu bench", "gpu": gpu, "note": note, "arch": arch, "preset": o["preset"],
                   "model": cfg.as_dict(), "batch": o["batch"], "seq": o["seq"], "dtype": o["dtype"],
                   "steps": o["steps"], "warmup": o["warmup"], "gemm_ceiling_tflops": ceiling,
                   "gemm_ceiling": ceiling_src, "flops_per_token": fpt, "mfu_definition": MFU_DEFINITION,
                   "torch": getattr(torch, "__version__", None) if torch else None,
                   "cupy": getattr(backend.cupy_module(), "__version__", None) if gpu else None,
                   "llmgpu_over_torch_compile": ratio, "llmgpu_best_mode": ours["mode"] if ours else None,
                   "llmgpu_over_torch": ratios, "compile_mode": compile_mode, "sdpa": sdpa, "results": rows,
                   "sdpa_pick": sdpa_pick, "checkpoint_every": ckpt, "fp8_recipe": recipe, "llmgpu_fp8_over": ratios8,
                   "lt_split_k": lt_splitk.as_records()}  # the split-K GEMM table in force
        if monitor is not None:  # every reading of the run, t in seconds from the first (timed_window: epoch s)
            payload["clocks"] = {"reason": monitor.reason, "interval_ms": monitor.interval_ms,
                                 "origin": monitor.samples[0].t if monitor.samples else None,
                                 "trace": monitor.trace()}
        timing.save_results(out, payload, xp=xp)
        print(f"wrote {out}")
    if not any(r.get("tokens_per_s") for r in rows):  # the table says why too; the command's one error line
        raise ValueError("no mode ran: " + "; ".join(f"{r['mode']} {'skipped' if 'skipped' in r else 'failed'} ("
                                                     f"{str(r.get('skipped') or r.get('error'))[:160]})" for r in rows))
    return 0


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="llmgpu bench", description=__doc__.split("\n\n")[0]))
    return bench_main(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
