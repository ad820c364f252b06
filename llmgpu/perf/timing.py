"""Timing GPU work honestly, and the two ceilings every measurement is compared with.

GPU launches are asynchronous: a host clock read right after a launch measures the launch, not the
kernel. ``time_fn`` records CUDA events around each call on the current stream, warms up first
(compiles, cuBLAS handles, caches) and returns the median of many repetitions. On NumPy it falls
back to ``time.perf_counter``.

The ceilings are measured in the same run as the kernels they judge: the bandwidth of a large
device-to-device copy (bytes read + written per second) for memory-bound kernels, and the rate of a
large cuBLAS GEMM for matrix products.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..kernels import get_kernel
from ..version import __version__


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    samples_ms: tuple = ()  # every timed call, in order (to pool several runs' calls before taking a median)

    def gbps(self, nbytes: float) -> float:
        """Achieved bandwidth in GB/s (1e9 bytes/s) for ``nbytes`` moved per call."""
        return nbytes / (self.median_ms * 1e-3) / 1e9

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


def _spin_ms(host_ms: float, calls: int) -> float:
    """How long the spin kernel of ``host_ahead`` runs: enough for the host to enqueue ``calls`` calls of
    ``host_ms`` each, with margin; at most half a second."""
    return min(500.0, 1.5 * host_ms * calls + 1.0)


def time_fn(fn, *, xp=None, warmup=3, reps=20, min_time_s=0.0, host_ahead=True) -> Timing:
    """Median time of ``fn()`` over ``reps`` calls after ``warmup`` calls.

    On CuPy each call is bracketed by CUDA events on the current stream (no host clock). With
    ``min_time_s``, repetitions are added until their total reaches that much time.

    ``host_ahead`` (GPU): a kernel of tens of microseconds can take less GPU time than the Python call
    that launches it (argument checks, launch). Timed back to back, the GPU would then wait for the
    host between calls and the events would measure the host. So a spin kernel
    (``gpu_spin``) is queued first, long enough for the host to enqueue the whole batch
    behind it: the events then measure the GPU's time alone, what a bandwidth figure is about. Pass
    ``host_ahead=False`` to measure what a caller launching one call after another sees (e.g. a whole
    training step, launch overhead included).
    """
    xp = xp or backend.default_xp()
    for _ in range(warmup):
        fn()
    times = []
    if xp is np:
        total = 0.0
        while len(times) < reps or total < min_time_s:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            total += times[-1] / 1e3
    else:
        cp = xp
        stream = cp.cuda.get_current_stream()
        stream.synchronize()
        host_ms = 0.0
        if host_ahead:
            t0 = time.perf_counter()
            fn()  # one more warm-up call, timed on the host: how long the spin must last
            host_ms = (time.perf_counter() - t0) * 1e3
            stream.synchronize()
        total = 0.0
        while len(times) < reps or total < min_time_s:
            batch = max(reps - len(times), 1)
            events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(batch)]
            if host_ahead:
                gpu_spin(_spin_ms(host_ms, batch))
            for start, end in events:
                start.record(stream)
                fn()
                end.record(stream)
            events[-1][1].synchronize()
            for start, end in events:
                times.append(cp.cuda.get_elapsed_time(start, end))
            total = sum(times) / 1e3
    return Timing(statistics.median(times), min(times), max(times), len(times), tuple(times))


def gpu_spin(ms: float):
    """Queue a kernel on the current stream that keeps the GPU busy for ``ms`` milliseconds (wall clock);
    returns a CUDA event recorded right after it. Nothing waits for it."""
    cp = backend.require_gpu()
    if not ms >= 0:
        raise ValueError(f"ms must be >= 0, got {ms}")
    get_kernel("spin", "gpu_spin")((1,), (32,), (np.uint64(int(ms * 1e6)),))
    ev = cp.cuda.Event(disable_timing=True)
    ev.record()
    return ev


def copy_bandwidth(nbytes: int = 2**31, *, xp=None, reps=20) -> float:
    """Device-to-device copy ceiling in GB/s, counting bytes read + written (2 × nbytes per copy)."""
    xp = xp or backend.default_xp()
    n = nbytes // 4
    src = xp.ones(n, dtype=np.float32)  # content does not matter for a copy
    dst = xp.empty_like(src)
    if xp is np:
        t = time_fn(lambda: np.copyto(dst, src), xp=xp, warmup=1, reps=min(reps, 5))
    else:
        t = time_fn(lambda: dst.__setitem__(Ellipsis, src), xp=xp, reps=reps)
    return t.gbps(2 * nbytes)


def gemm_ceiling(n: int = 8192, dtype="bf16", *, xp=None, reps=10, seed=0) -> float:
    """TFLOP/s of an n × n × n matrix product through the vendor library (cuBLAS; NumPy's BLAS on CPU).

    Inputs are random (zeros run faster on some GPUs and would flatter the ceiling).
    """
    xp = xp or backend.default_xp()
    dt = backend.resolve_dtype(dtype)
    if xp is np and dt in (backend.bfloat16, backend.float16):
        dt = backend.float32  # NumPy has no fast 16-bit GEMM; the CPU ceiling is fp32
    # made where they live: a host generator takes seconds at 8192²
    gen = np.random.default_rng(seed) if xp is np else xp.random.RandomState(seed)
    a = gen.standard_normal((n, n), dtype=np.float32).astype(dt)
    b = gen.standard_normal((n, n), dtype=np.float32).astype(dt)
    t = time_fn(lambda: a @ b, xp=xp, warmup=2, reps=reps)
    return t.tflops(2.0 * n**3)


# --------------------------------------------------------------------------- MFU

# Dense peak TFLOP/s per GPU from the vendors' datasheets: (16-bit tensor cores, fp32 without TF32).
# Shown next to MFU, labelled, never used as its denominator.
DATASHEET_PEAK_TFLOPS = (
    ("H200", 989.4, 66.9), ("H100 PCIe", 756.0, 51.2), ("H100", 989.4, 66.9), ("GH200", 989.4, 66.9),
    ("A100", 312.0, 19.5), ("L40S", 362.0, 91.6), ("L4", 121.0, 30.3), ("A10G", 125.0, 31.2), ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6), ("RTX 3090", 71.0, 35.6), ("V100", 125.0, 15.7),
)

MFU_DEFINITION = ("MFU = (6·N + 12·L·C·T) FLOPs/token × tokens/s ÷ the GEMM ceiling measured in the same run "
                  "(N = parameters without the position embedding, tied LM head once)")


def mfu(flops_per_token: float, tokens_per_s: float, ceiling_tflops: float) -> float:
    """Model FLOPs utilisation (Chowdhery et al., PaLM, appendix B): the FLOPs the model needs per second
    (``GPTConfig.flops_per_token``; recomputation does not count) over the measured GEMM ceiling."""
    if not ceiling_tflops or ceiling_tflops <= 0:
        return float("nan")
    return flops_per_token * tokens_per_s / (ceiling_tflops * 1e12)


def mfu_ceiling(xp=None, dtype="bf16", *, reps: int | None = None) -> tuple[float, str]:
    """(TFLOP/s, what was measured): the denominator of MFU for training in ``dtype`` on ``xp``.

    On a GPU a cuBLAS 8192³ product in the compute dtype (bf16 for bf16/fp16, fp32 for fp32); on the
    CPU NumPy's fp32 BLAS at 384³ (the tiny model's GEMMs are that small)."""
    xp = xp or backend.default_xp()
    dt = backend.resolve_dtype(dtype)
    if xp is np:
        return gemm_ceiling(384, "fp32", xp=np, reps=reps or 3), "NumPy fp32 GEMM 384³"
    name = "fp32" if dt == backend.float32 else "bf16"
    return gemm_ceiling(8192, name, xp=xp, reps=reps or 10), f"cuBLAS {name} GEMM 8192³"


def datasheet_peak_tflops(xp=None, dtype="bf16") -> tuple[float | None, str | None]:
    """(dense peak TFLOP/s, GPU model) from ``DATASHEET_PEAK_TFLOPS`` for this GPU, or (None, None)."""
    xp = xp or backend.default_xp()
    if xp is np:
        return None, None
    name = backend.device_info(xp).name
    for key, tc, f32 in DATASHEET_PEAK_TFLOPS:
        if key in name:
            return (f32 if backend.resolve_dtype(dtype) == backend.float32 else tc), key
    return None, None


def results_header(xp=None) -> dict:
    """Who/where/when of a benchmark run, stored next to its numbers."""
    import datetime
    import platform

    xp = xp or backend.default_xp()
    head = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": backend.device_info(xp).as_dict(),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    head["llmgpu"] = __version__
    return head


def save_results(path, payload: dict, xp=None) -> dict:
    """Write ``payload`` plus results_header() as indented JSON; returns what was written."""
    import json
    from pathlib import Path

    data = {**results_header(xp), **payload}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return data


def torch_cuda():
    """The ``torch`` module when PyTorch is importable and sees a CUDA device, else None.

    Benchmarks time PyTorch's equivalent of each kernel in the same run when it is there.
    """
    try:
        import torch
    except Exception:  # not installed, or a broken install: no comparison, not a crash
        return None
    return torch if torch.cuda.is_available() else None


def _spin_on_torch_stream(torch, ms: float):
    """``gpu_spin`` on PyTorch's current stream (CuPy's, when they are the same stream)."""
    cp = backend.require_gpu()
    current = getattr(getattr(torch, "cuda", None), "current_stream", None)
    ptr = int(current().cuda_stream) if current is not None else cp.cuda.get_current_stream().ptr
    if ptr == cp.cuda.get_current_stream().ptr:
        gpu_spin(ms)
        return
    with cp.cuda.ExternalStream(ptr):
        gpu_spin(ms)


def time_torch(torch, fn, reps: int, warmup: int = 3, host_ahead: bool = True) -> float:
    """Median ms of ``fn()`` over ``reps`` calls, each bracketed by PyTorch CUDA events.

    ``host_ahead``: as in ``time_fn``, a spin kernel queued first (on PyTorch's current stream) lets the
    host enqueue every call before the GPU starts, so the events measure GPU time, not Python's."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    if host_ahead and backend.gpu_available():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        _spin_on_torch_stream(torch, _spin_ms(host_ms, reps))
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in events]))
