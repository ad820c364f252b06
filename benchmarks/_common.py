"""What the benchmark scripts share: options, the device line, the copy ceiling, PyTorch, the JSON file.

Each ``benchmarks/bench_*.py`` runs as a script (``python benchmarks/bench_x.py``), so this directory
is on ``sys.path`` and the scripts ``import _common``. Every script runs on a GPU (GPT-2 sizes, results
written to ``benchmarks/results/``) and on a CPU (NumPy, small sizes, a smoke test that writes nothing
unless ``--out`` is given: CPU numbers do not belong next to the GPU results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# Run from a checkout without installing llmgpu: the repository root goes on the path first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgpu import backend  # noqa: E402
from llmgpu.perf import timing  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parser(doc: str, *, reps: int | None = 20, no_torch: bool = True) -> argparse.ArgumentParser:
    """The options every chapter benchmark takes; a script adds its own to the parser returned.

    The description is the first paragraph of the script's docstring (``doc``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes or fewer cases (the default without a GPU)")
    ap.add_argument("--out", type=Path, help="write the JSON here (default: benchmarks/results/... on a GPU only)")
    ap.add_argument("--reps", type=int, default=reps, help="timed repetitions per case (median reported)")
    if no_torch:
        ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    return ap


def setup(args) -> tuple:
    """(xp, on_gpu, quick) for this machine, after printing the device line every result starts from.

    Without a GPU the run is always quick: NumPy at GPT-2 sizes would take hours and mean nothing."""
    xp = backend.default_xp()
    on_gpu = xp is not np
    print(f"device: {backend.device_info(xp).summary()}")
    return xp, on_gpu, args.quick or not on_gpu


def step_case(on_gpu: bool, quick: bool) -> tuple:
    """(preset, batch, seq, dtype, steps) of a benchmark of the captured fast step: GPT-2 124M at B = 64, T = 1024,
    bf16, 20 timed steps on a GPU (the graph step needs bf16/fp16; a tiny model with ``--quick``); a tiny fp32
    model on NumPy (the smoke test)."""
    if not on_gpu:
        return "tiny", 4, 64, "fp32", 1
    return ("tiny", 4, 64, "bf16", 2) if quick else ("gpt2", 64, 1024, "bf16", 20)


def copy_ceiling(xp, nbytes: int) -> float:
    """The device-to-device copy bandwidth (GB/s, read + write), measured in this run and printed.

    Memory-bound kernels are judged against it rather than against the datasheet's figure."""
    ceiling = timing.copy_bandwidth(nbytes, xp=xp)
    print(f"copy ceiling (read + write): {ceiling:.0f} GB/s")
    return ceiling


def torch_or_none(args, on_gpu: bool):
    """The ``torch`` module to time PyTorch's equivalents in the same run, or None.

    None without a GPU, with ``--no-torch``, or when PyTorch with CUDA is not importable (said so)."""
    if args.no_torch or not on_gpu:
        return None
    torch = timing.torch_cuda()
    if torch is None:
        print("PyTorch with CUDA not importable: no PyTorch comparison")
    return torch


def gbps(nbytes: float, ms: float) -> float:
    """GB/s for ``nbytes`` moved in ``ms`` milliseconds (PyTorch timings come as plain ms)."""
    return nbytes / (ms * 1e-3) / 1e9


def names(option: str) -> list[str]:
    """The entries of a comma-separated option such as ``--dtypes bf16,fp32``."""
    return [s.strip() for s in option.split(",") if s.strip()]


def save(path, payload: dict, xp) -> bool:
    """Write ``payload`` (with the run's device and date header) to ``path`` if there is one, else say so.

    Scripts pass ``args.out or (RESULTS if <a full GPU run> else None)``: a CPU or ``--quick`` run keeps nothing
    unless asked. Returns whether it wrote."""
    if not path:
        print("(results not written: pass --out PATH to keep them)")
        return False
    timing.save_results(path, payload, xp=xp)
    print(f"wrote {path}")
    return True


def alternating_step_times(settings: dict, xp, rounds: int, steps: int) -> dict:
    """ms per step of several settings of one training step, timed in alternating rounds.

    ``settings`` maps a label to a function that builds that setting's step (``llmgpu.bench.make_train_step`` with
    its options: ``(run, ...)``). Each setting's step runs three times first (two eager steps, then the capture of
    its CUDA graph); then rounds of ``steps`` timed steps per setting alternate, so drift (clocks, heat) falls on
    all alike. Each round is ``timing.time_fn`` with launch cost included (``host_ahead=False``).
    Returns {label: [ms, ...]}."""
    runs = {}
    for label, make_step in settings.items():
        run = make_step()[0]
        for _ in range(3):
            run()
        runs[label] = run
    times = {label: [] for label in settings}
    for _ in range(rounds):
        for label, run in runs.items():
            times[label] += timing.time_fn(run, xp=xp, warmup=0, reps=steps, host_ahead=False).samples_ms
    return times
