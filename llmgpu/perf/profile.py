"""Profiling a training step (chapter 8): per-op times, launch cost, and whether a step waits for the GPU.

You cannot optimise what you do not measure, and measuring a GPU from Python has traps: kernel
launches are asynchronous, so a host clock around a call measures the launch; a host
synchronisation to fix that changes what is measured (the GPU drains, the next launches are not
queued). The tools here keep the step intact:

* ``OpTimer`` records a pair of CUDA events around each named region on the current stream, never
  waits inside the step, and reads all the events once afterwards: ``timer.table()`` lists op,
  calls, total ms, % of the step, and, given bytes / FLOPs per call, GB/s or TFLOP/s against the
  ceilings measured in the same run (``timing.copy_bandwidth``, ``timing.gemm_ceiling``). On NumPy it
  falls back to ``time.perf_counter``. Model code calls ``llmgpu.instrument.region(name, bytes=, flops=)``,
  a no-op unless a timer was activated (``with activate(timer):``) or NVTX ranges were switched on
  (``set_nvtx(True)``, or ``LLMGPU_NVTX=1``). ``profile_step(fn)`` runs a whole step under a timer and
  returns the per-op rows per step; ``llmgpu.plotting.plot_step_breakdown`` draws them. Typical
  Nsight commands::

      LLMGPU_NVTX=1 nsys profile -t cuda,nvtx -o step llmgpu train --steps 20 --no-graph ...
      LLMGPU_NVTX=1 ncu --nvtx --nvtx-include "mlp.fc+gelu fwd/" --set full -o mlp llmgpu train --steps 3 --no-graph

* ``launch_overhead(n)``: host µs per RawKernel launch, eager vs replayed from a CUDA graph
  (``llmgpu.perf.graphs``); ``launch_count(fn)``: how many kernels ``fn`` launches (capture it, count nodes).
* ``host_runs_ahead(fn)``: does ``fn`` wait for the GPU? A spin kernel (``timing.gpu_spin``) is queued
  first; if ``fn`` returns while it still runs, nothing inside ``fn`` synchronised.

Occupancy lives in ``llmgpu.perf.occupancy``, the roofline and step-breakdown plots in ``llmgpu.plotting``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from .. import backend
from ..instrument import NULL_REGION, activate, nvtx_module
from ..kernels import get_kernel
from ..ops.vector_add import vector_add
from .graphs import capture
from .timing import gpu_spin

# --------------------------------------------------------------------------- per-op timing


class _Region:
    __slots__ = ("timer", "name", "nbytes", "flops", "start")

    def __init__(self, timer, name, nbytes, flops):
        self.timer, self.name, self.nbytes, self.flops = timer, name, nbytes, flops

    def __enter__(self):
        t = self.timer
        if t.nvtx is not None:
            t.nvtx.RangePush(self.name)
        self.start = t._mark()
        t._depth += 1
        return self

    def __exit__(self, *exc):
        t = self.timer
        t._depth -= 1
        t._records.append((self.name, self.start, t._mark(), self.nbytes, self.flops, t._depth))
        if t.nvtx is not None:
            t.nvtx.RangePop()
        return False


class _Step:
    __slots__ = ("timer", "start")

    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.start = self.timer._mark()
        return self

    def __exit__(self, *exc):
        self.timer._steps.append((self.start, self.timer._mark()))
        return False


class OpTimer:
    """Per-region GPU times from CUDA events, read after the step (no host sync inside it).

    ``with timer.region("mlp.fc.fwd", bytes=..., flops=...):`` around each op (``bytes``/``flops``: per
    call, optional); ``with timer.step():`` around a whole step (optional: without it the step time is
    the sum of the outermost regions). After the step(s): ``timer.rows(...)`` / ``timer.table(...)``.
    ``timer.reset()`` before the next measured step. ``enabled=False``: every region is a shared no-op.
    ``nvtx=True`` also pushes an NVTX range per region. The events are recorded on CuPy's current
    stream at region entry and exit; keep a timed region's work on that stream.
    Event records are not timing points inside a CUDA graph capture: profile the eager step.
    """

    def __init__(self, enabled: bool = True, *, xp=None, nvtx: bool = False):
        self.enabled = bool(enabled)
        self.xp = xp or backend.default_xp()
        self.gpu = self.xp is not np
        self.nvtx = nvtx_module() if nvtx else None
        self._records: list = []  # (name, start, end, bytes, flops, depth)
        self._steps: list = []  # (start, end)
        self._free: list = []  # recycled CUDA events
        self._depth = 0

    # ---- recording
    def _mark(self):
        if not self.gpu:
            return time.perf_counter()
        ev = self._free.pop() if self._free else self.xp.cuda.Event()
        ev.record()
        return ev

    def region(self, name: str, *, bytes=None, flops=None):  # noqa: A002
        if not self.enabled:
            return NULL_REGION
        return _Region(self, name, bytes, flops)

    def step(self):
        """Context manager around one whole step (its time is the 100 % of the table)."""
        if not self.enabled:
            return NULL_REGION
        return _Step(self)

    def reset(self):
        """Forget the recorded regions (their events are reused). Call after reading the results."""
        if self.gpu:
            for rec in self._records:
                self._free += [rec[1], rec[2]]
            for s, e in self._steps:
                self._free += [s, e]
        self._records.clear()
        self._steps.clear()
        self._depth = 0

    # ---- reading (after the step)
    def _ms(self, start, end) -> float:
        if not self.gpu:
            return (end - start) * 1e3
        return float(self.xp.cuda.get_elapsed_time(start, end))

    def records(self) -> list[dict]:
        """Every region occurrence: ``{name, ms, bytes, flops, depth}``. Synchronises once (call after the step)."""
        if self.gpu and (self._records or self._steps):
            self.xp.cuda.Device().synchronize()
        return [{"name": n, "ms": self._ms(s, e), "bytes": b, "flops": f, "depth": d}
                for n, s, e, b, f, d in self._records]

    def step_ms(self) -> list[float]:
        """Times of the ``step()`` blocks recorded so far (ms)."""
        if self.gpu and self._steps:
            self.xp.cuda.Device().synchronize()
        return [self._ms(s, e) for s, e in self._steps]

    def rows(self, *, gbps_ceiling=None, tflops_ceiling=None, sort=True) -> list[dict]:
        """Aggregated rows (see ``summarize``); the step time is the total of the ``step()`` blocks if
        any were recorded, else the sum of the outermost regions."""
        recs = self.records()
        steps = self.step_ms()
        return summarize(recs, step_ms=sum(steps) if steps else None, gbps_ceiling=gbps_ceiling,
                         tflops_ceiling=tflops_ceiling, sort=sort)

    def table(self, *, gbps_ceiling=None, tflops_ceiling=None, sort=True) -> str:
        return format_table(self.rows(gbps_ceiling=gbps_ceiling, tflops_ceiling=tflops_ceiling, sort=sort))


def summarize(records, *, step_ms=None, gbps_ceiling=None, tflops_ceiling=None, sort=True) -> list[dict]:
    """Aggregate region records by name.

    ``records``: dicts ``{name, ms, bytes (per call or None), flops (per call or None), depth}``.
    Per name: ``calls``, ``total_ms``, ``ms_per_call``, ``pct_of_step`` (100 · total / step; the step
    time is ``step_ms``, default the sum over depth-0 records), ``bytes`` and ``flops`` (totals),
    ``gbps`` = bytes / time and ``tflops`` = flops / time, and ``pct_of_copy`` / ``pct_of_gemm``
    against the ceilings when given. Nested regions keep their ``depth``; their times are also part
    of their parents', so percentages of different depths do not add up.
    """
    agg: dict = {}
    for r in records:
        a = agg.get(r["name"])
        if a is None:
            a = agg[r["name"]] = {"op": r["name"], "calls": 0, "total_ms": 0.0, "bytes": None, "flops": None,
                                  "depth": r.get("depth", 0)}
        a["calls"] += 1
        a["total_ms"] += float(r["ms"])
        a["depth"] = min(a["depth"], r.get("depth", 0))
        for key in ("bytes", "flops"):
            if r.get(key) is not None:
                a[key] = (a[key] or 0.0) + float(r[key])
    if step_ms is None:
        step_ms = sum(float(r["ms"]) for r in records if r.get("depth", 0) == 0)
    rows = []
    for a in agg.values():
        t = a["total_ms"]
        a["ms_per_call"] = t / a["calls"]
        a["pct_of_step"] = 100.0 * t / step_ms if step_ms else None
        a["gbps"] = a["bytes"] / (t * 1e-3) / 1e9 if a["bytes"] and t > 0 else None
        a["tflops"] = a["flops"] / (t * 1e-3) / 1e12 if a["flops"] and t > 0 else None
        a["pct_of_copy"] = 100.0 * a["gbps"] / gbps_ceiling if a["gbps"] is not None and gbps_ceiling else None
        a["pct_of_gemm"] = (100.0 * a["tflops"] / tflops_ceiling if a["tflops"] is not None and tflops_ceiling
                            else None)
        a["step_ms"] = step_ms
        rows.append(a)
    if sort:
        rows.sort(key=lambda r: -r["total_ms"])
    return rows


def _f(v, fmt, width):
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def format_table(rows, *, max_name: int = 28) -> str:
    """A fixed-width text table of ``summarize`` rows, with the step time in a footer."""
    head = (f"{'op':<{max_name}}{'calls':>6}{'total ms':>10}{'% step':>8}{'ms/call':>9}{'GB/s':>8}"
            f"{'% copy':>8}{'TFLOP/s':>9}{'% gemm':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = ("  " * int(r.get("depth", 0)) + r["op"])[:max_name]
        lines.append(f"{name:<{max_name}}{r['calls']:>6d}{r['total_ms']:>10.3f}{_f(r['pct_of_step'], '.1f', 8)}"
                     f"{r['ms_per_call']:>9.3f}{_f(r['gbps'], '.0f', 8)}{_f(r['pct_of_copy'], '.1f', 8)}"
                     f"{_f(r['tflops'], '.1f', 9)}{_f(r['pct_of_gemm'], '.1f', 8)}")
    if rows:
        lines.append("-" * len(head))
        lines.append(f"step: {rows[0]['step_ms']:.3f} ms")
    return "\n".join(lines)


def step_floor(rows, copy_gbps: float, *, gemm_tflops=None, copy_share: float = 0.9, as_measured=("attn.core",),
               gemm_above: float = 50.0) -> dict:
    """How fast the step of a ``profile_step`` table could be with every op at the best rate of its kind.

    A depth-0 row is a GEMM when its rate is above ``gemm_above`` TFLOP/s (the memory-bound ops are far below):
    it gets ``gemm_tflops`` (default: the best rate any GEMM row of the table reaches); a row whose name starts
    with one of ``as_measured`` keeps its time (an op not ours to tune: cuDNN's attention); every other row moves
    its bytes at ``copy_share`` of the copy bandwidth ``copy_gbps``. Time outside any region stays. Returns
    ``{"floor_ms", "gemm_tflops", "gemm_ops", "gaps"}``, ``gaps`` the (ms above its floor, op) pairs, largest first.
    """
    top = [r for r in rows if r.get("depth", 0) == 0]
    kept = lambda r: r["op"].startswith(tuple(as_measured))  # noqa: E731
    is_gemm = lambda r: not kept(r) and (r.get("tflops") or 0) > gemm_above  # noqa: E731
    gemms = [r["op"] for r in top if is_gemm(r)]
    rate = gemm_tflops or max((r["tflops"] for r in top if is_gemm(r)), default=None)

    def floor_ms(r):
        if kept(r):
            return r["total_ms"]
        if is_gemm(r):
            return r["flops"] / (rate * 1e9)
        return (r.get("bytes") or 0.0) / (copy_share * copy_gbps * 1e6)

    gaps = sorted(((r["total_ms"] - floor_ms(r), r["op"]) for r in top), reverse=True)
    step_ms = top[0]["step_ms"] if top else 0.0
    return {"floor_ms": step_ms - sum(g for g, _ in gaps), "gemm_tflops": rate, "gemm_ops": gemms, "gaps": gaps}


# --------------------------------------------------------------------------- launch overhead


@dataclass(frozen=True)
class LaunchOverhead:
    """Microseconds per kernel launch (see ``launch_overhead``)."""

    n: int
    eager_host_us: float  # host time to enqueue one RawKernel launch
    eager_wall_us: float  # wall time per kernel for n eager launches including the final wait
    op_host_us: float  # host time of one llmgpu.ops.vector_add call (validation + launch)
    graph_wall_us: float  # wall time per kernel for one replay of n captured launches, including the wait
    graph_launch_us: float  # host time of one graph.launch() call (the whole n-kernel replay)
    kernels_in_graph: int

    def as_dict(self) -> dict:
        return asdict(self)


def launch_overhead(n: int = 1000, *, reps: int = 5) -> LaunchOverhead:
    """Host cost of launching a tiny kernel (``vector_add`` on 256 elements), eager vs CUDA-graph replay.

    Eager: ``n`` launches back to back (median of ``reps`` batches). Graph: the same ``n`` launches
    captured once (``llmgpu.perf.graphs.capture``) and replayed. With kernels this short the GPU finishes
    each one faster than the host can enqueue the next, so wall time per kernel is launch overhead.
    """

    cp = backend.require_gpu()
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    size = 256
    a = cp.ones(size, dtype=np.float32)
    b = cp.ones(size, dtype=np.float32)
    c = cp.empty(size, dtype=np.float32)
    k = get_kernel("vector_add", "vector_add", np.float32)
    args = (a, b, c, np.int64(size))
    stream = cp.cuda.get_current_stream()

    def burst():
        for _ in range(n):
            k((1,), (size,), args)

    burst()
    vector_add(a, b, out=c)
    stream.synchronize()
    host, wall, op = [], [], []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        burst()
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n)
        wall.append((t2 - t0) / n)
        t0 = time.perf_counter()
        for _ in range(n):
            vector_add(a, b, out=c)
        op.append((time.perf_counter() - t0) / n)
        stream.synchronize()
    g = capture(burst, warmup=0)
    g.upload(stream)
    g.replay(stream)
    stream.synchronize()
    gwall, glaunch = [], []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        g.replay(stream)
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        gwall.append((t2 - t0) / n)
        glaunch.append(t1 - t0)
    med = statistics.median
    return LaunchOverhead(n=n, eager_host_us=med(host) * 1e6, eager_wall_us=med(wall) * 1e6,
                          op_host_us=med(op) * 1e6, graph_wall_us=med(gwall) * 1e6,
                          graph_launch_us=med(glaunch) * 1e6, kernels_in_graph=g.kernel_count())


def launch_count(fn, *, warmup: int = 1) -> dict:
    """How many kernels (and other nodes) ``fn()`` launches: capture it into a graph and count the nodes.

    ``fn`` must be capturable (see ``llmgpu.perf.graphs``); it runs ``warmup`` times eagerly, then once under
    capture (recorded, not executed).
    """

    return capture(fn, warmup=warmup).node_counts()



# --------------------------------------------------------------------------- does a step wait for the GPU?


def host_runs_ahead(fn, *, spin_ms: float = 300.0) -> dict:
    """Does ``fn()`` (e.g. one training step) synchronise with the GPU? Queue a ``spin_ms`` spin kernel,
    call ``fn``, and look at the clock and the spin kernel when ``fn`` returns.

    If anything inside ``fn`` waited for the GPU (``.item()``, a copy to the host, a synchronising
    library call), it waited for the spin kernel first, so ``fn`` took at least ``spin_ms`` and the spin
    has finished. Returns ``{host_ms, spin_ms, spin_still_running, gpu_ms}`` where ``host_ms`` is how long
    ``fn`` held the host, ``spin_still_running`` whether the spin kernel was still running when ``fn``
    returned (True: no synchronisation inside ``fn``), and ``gpu_ms`` the GPU time of ``fn``'s work
    (CUDA events, read after everything finished). Warm ``fn`` up first: compilation is not the point.
    """
    cp = backend.require_gpu()
    cp.cuda.Device().synchronize()
    spun = gpu_spin(spin_ms)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    still = not spun.done
    end.synchronize()
    return {"host_ms": host_ms, "spin_ms": float(spin_ms), "spin_still_running": bool(still),
            "gpu_ms": float(cp.cuda.get_elapsed_time(start, end))}


def profile_step(fn, *, reps: int = 3, warmup: int = 1, gbps_ceiling=None, tflops_ceiling=None, nvtx=False,
                 xp=None) -> list[dict]:
    """The per-op table of a training step: ``fn()`` (one step) run ``warmup`` times unmeasured, then
    ``reps`` times under an ``OpTimer``. Times and totals in the rows are per step (divided by ``reps``);
    ``pct_of_step`` is against the measured step. Every ``instrument.region`` inside ``fn`` becomes a row."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    timer = OpTimer(xp=xp, nvtx=nvtx)
    with activate(timer):
        for _ in range(reps):
            with timer.step():
                fn()
    rows = timer.rows(gbps_ceiling=gbps_ceiling, tflops_ceiling=tflops_ceiling)
    for r in rows:
        r["calls"] = round(r["calls"] / reps)  # the same regions every step
        for key in ("total_ms", "bytes", "flops", "step_ms"):
            if r.get(key) is not None:
                r[key] = r[key] / reps
    return rows


__all__ = ["LaunchOverhead", "OpTimer", "activate", "format_table", "host_runs_ahead", "launch_count",
           "launch_overhead", "profile_step", "step_floor", "summarize"]
