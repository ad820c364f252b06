"""Profiling a training step (chapter 8): per-op times, NVTX ranges, occupancy, roofline, launch cost.

You cannot optimise what you do not measure, and measuring a GPU from Python has traps: kernel
launches are asynchronous, so a host clock around a call measures the launch; a host
synchronisation to fix that changes what is measured (the GPU drains, the next launches are not
queued). The tools here keep the step intact:

* ``OpTimer`` records a pair of CUDA events around each named region on the current stream, never
  waits inside the step, and reads all the events once afterwards: ``timer.table()`` lists op,
  calls, total ms, % of the step, and, given bytes / FLOPs per call, GB/s or TFLOP/s against the
  ceilings measured in the same run (``timing.copy_bandwidth``, ``timing.gemm_ceiling``). On NumPy it
  falls back to ``time.perf_counter``. Disabled, ``region()`` returns a shared no-op context.
  Model code calls the module-level ``region(name, bytes=, flops=)``: a no-op unless a timer was
  activated (``with activate(timer):``) or NVTX ranges were switched on (``set_nvtx(True)``, or the
  environment variable ``LLMGPU_NVTX=1``). ``profile_step(fn)`` runs a whole step under a timer and
  returns the per-op rows per step; ``plot_step_breakdown`` draws them.
* ``nvtx_range(name)`` marks a range for Nsight Systems / Nsight Compute (``cupy.cuda.nvtx``; no-op
  without CuPy), so a timeline reads like the model. Typical commands::

      LLMGPU_NVTX=1 nsys profile -t cuda,nvtx -o step llmgpu train --steps 20 --no-graph ...
      LLMGPU_NVTX=1 ncu --nvtx --nvtx-include "mlp.fc+gelu fwd/" --set full -o mlp llmgpu train --steps 3 --no-graph

* ``occupancy_table(kernels, block)``: registers, static shared memory, max threads per block, and
  blocks per SM / theoretical occupancy for a block size, from the CUDA occupancy API
  (``cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor``) next to the formula it applies
  (``theoretical_occupancy``, usable without a GPU).
* ``roofline_plot(rows, peak_tflops, peak_gbps)``: every kernel as a point (arithmetic intensity,
  achieved TFLOP/s) under the two roofs, log-log, with the ridge point.
* ``launch_overhead(n)``: host µs per RawKernel launch, eager vs replayed from a CUDA graph
  (``llmgpu.graphs``); ``launch_count(fn)``: how many kernels ``fn`` launches (capture it, count nodes).
* ``host_runs_ahead(fn)``: does ``fn`` wait for the GPU? A spin kernel (``gpu_spin``) is queued first;
  if ``fn`` returns while it still runs, nothing inside ``fn`` synchronised.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import backend

# --------------------------------------------------------------------------- NVTX


@functools.cache
def _nvtx():
    """cupy.cuda.nvtx when importable and usable, else None."""
    cp = backend.cupy_module()
    if cp is None:
        return None
    try:
        from cupy.cuda import nvtx
    except Exception:
        return None
    return nvtx if getattr(nvtx, "available", False) else None


class _Null:
    """The shared no-op context manager of disabled regions (no allocation per call)."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


class _NvtxRange:
    __slots__ = ("name", "mod")

    def __init__(self, name, mod):
        self.name, self.mod = name, mod

    def __enter__(self):
        self.mod.RangePush(self.name)
        return self

    def __exit__(self, *exc):
        self.mod.RangePop()
        return False


def nvtx_range(name: str):
    """Context manager: an NVTX range named ``name`` (push on enter, pop on exit); no-op without CuPy/NVTX."""
    mod = _nvtx()
    return _NULL if mod is None else _NvtxRange(str(name), mod)


_NVTX_ON = os.environ.get("LLMGPU_NVTX", "0") not in ("", "0")  # LLMGPU_NVTX=1: NVTX ranges from the start
_ACTIVE = None  # the OpTimer that module-level region() reports to


def set_nvtx(enabled: bool = True) -> bool:
    """Make module-level ``region()`` push NVTX ranges even when no timer is active; returns the old value."""
    global _NVTX_ON
    old, _NVTX_ON = _NVTX_ON, bool(enabled)
    return old


def region(name: str, *, bytes=None, flops=None):  # noqa: A002 - 'bytes' reads best at the call sites
    """The hook model code wraps layers and ops in: ``with profile.region("attn.fwd", flops=f): ...``.

    Reports to the timer made current by ``activate(timer)``; without one, an NVTX range when
    ``set_nvtx(True)`` was called, else a shared no-op (two global reads per call).
    """
    t = _ACTIVE
    if t is not None:
        return t.region(name, bytes=bytes, flops=flops)
    if _NVTX_ON:
        return nvtx_range(name)
    return _NULL


@contextlib.contextmanager
def activate(timer):
    """Make ``timer`` the target of module-level ``region()`` calls inside the block."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, timer
    try:
        yield timer
    finally:
        _ACTIVE = prev


def active_timer():
    return _ACTIVE


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
        self.nvtx = _nvtx() if nvtx else None
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
            return _NULL
        return _Region(self, name, bytes, flops)

    def step(self):
        """Context manager around one whole step (its time is the 100 % of the table)."""
        if not self.enabled:
            return _NULL
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


# --------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources the occupancy calculation divides up. Defaults: sm_90 (H100 / H200)."""

    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_threads_per_sm: int = 2048  # 64 warps
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # bytes of shared memory blocks can use (228 KiB on sm_90)
    reserved_smem_per_block: int = 1024  # the runtime keeps 1 KiB per block (sm_80 and later)
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256
    smem_alloc_unit: int = 128
    sub_partitions: int = 4  # register file split over the 4 schedulers (sm_70 and later)
    warp_size: int = 32
    name: str = "sm_90 defaults"

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @classmethod
    def for_device(cls, xp=None) -> SMLimits:
        """The limits of the current GPU (``cudaGetDeviceProperties``); the sm_90 defaults on NumPy."""
        xp = xp or backend.default_xp()
        if xp is np:
            return cls()
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

        def get(key, default):
            v = props.get(key)
            return int(v) if v else default

        d = cls()
        return cls(regs_per_sm=get("regsPerMultiprocessor", d.regs_per_sm),
                   regs_per_block=get("regsPerBlock", d.regs_per_block),
                   max_threads_per_sm=get("maxThreadsPerMultiProcessor", d.max_threads_per_sm),
                   max_blocks_per_sm=get("maxBlocksPerMultiProcessor", d.max_blocks_per_sm),
                   smem_per_sm=get("sharedMemPerMultiprocessor", d.smem_per_sm),
                   reserved_smem_per_block=get("reservedSharedMemPerBlock", d.reserved_smem_per_block),
                   warp_size=get("warpSize", d.warp_size), name=f"{name} sm_{props['major']}{props['minor']}")


def theoretical_occupancy(*, block: int, regs: int, smem_bytes: int = 0, limits: SMLimits | None = None,
                          max_threads_per_block: int | None = None) -> dict:
    """Resident blocks per SM and theoretical occupancy for one kernel launch configuration.

    The formula of CUDA's occupancy calculator (``cuda_occupancy.h``), four limits, the smallest wins:

    * warps:     ``⌊max_warps_per_sm / warps_per_block⌋`` with ``warps_per_block = ⌈block / 32⌉``
    * registers: each warp holds ``⌈regs · 32 / 256⌉ · 256`` registers; each of the 4 sub-partitions
      (``regs_per_sm / 4`` registers) fits ``⌊(regs_per_sm / 4) / regs_per_warp⌋`` warps; blocks =
      ``⌊4 · that / warps_per_block⌋`` (0 when one block needs more than ``regs_per_block``)
    * shared memory: ``⌊smem_per_sm / (⌈(smem + 1 KiB reserved) / 128⌉ · 128)⌋``
    * blocks:    ``max_blocks_per_sm`` (32 on sm_80 / sm_90)

    occupancy = resident warps / max warps per SM. ``smem_bytes`` = static + dynamic shared memory
    per block. Returns ``{blocks_per_sm, active_warps, occupancy, limiter, limits}``.
    """
    lim = limits or SMLimits()
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if regs < 0 or smem_bytes < 0:
        raise ValueError("regs and smem_bytes must be >= 0")
    wpb = -(-block // lim.warp_size)
    by = {"warps": lim.max_warps_per_sm // wpb, "blocks": lim.max_blocks_per_sm}
    if regs > 0:
        per_warp = -(-regs * lim.warp_size // lim.reg_alloc_unit) * lim.reg_alloc_unit
        warps_per_part = (lim.regs_per_sm // lim.sub_partitions) // per_warp
        by["registers"] = (warps_per_part * lim.sub_partitions) // wpb
        # the per-block limit, checked as if every sub-partition got the same number of warps
        if per_warp * (-(-wpb // lim.sub_partitions) * lim.sub_partitions) > lim.regs_per_block:
            by["registers"] = 0
    smem = smem_bytes + lim.reserved_smem_per_block
    smem = -(-smem // lim.smem_alloc_unit) * lim.smem_alloc_unit
    by["shared memory"] = lim.smem_per_sm // smem
    if max_threads_per_block is not None and block > max_threads_per_block:
        by["max threads per block"] = 0
    blocks = max(0, min(by.values()))
    limiter = min(by, key=lambda k: (by[k], ["warps", "registers", "shared memory", "blocks",
                                                "max threads per block"].index(k)))
    warps = blocks * wpb
    return {"blocks_per_sm": blocks, "active_warps": warps, "occupancy": warps / lim.max_warps_per_sm,
            "limiter": limiter, "limits": by}


def kernel_attributes(kernel) -> dict:
    """Compiled attributes of a ``cupy.RawKernel``: registers per thread, static shared memory, local
    memory (spills), constant memory, max threads per block, PTX / binary version."""
    return {"regs": int(kernel.num_regs), "static_smem": int(kernel.shared_size_bytes),
            "local_bytes": int(kernel.local_size_bytes), "const_bytes": int(kernel.const_size_bytes),
            "max_threads_per_block": int(kernel.max_threads_per_block), "ptx_version": int(kernel.ptx_version),
            "binary_version": int(kernel.binary_version)}


def occupancy(kernel, block: int, *, dynamic_smem: int = 0, limits: SMLimits | None = None) -> dict:
    """Attributes of ``kernel`` plus blocks per SM / occupancy at ``block`` threads: from the CUDA occupancy
    API (``blocks_per_sm_api``) and from ``theoretical_occupancy`` (the formula), side by side."""
    cp = backend.require_gpu()
    attrs = kernel_attributes(kernel)
    lim = limits or SMLimits.for_device(cp)
    calc = theoretical_occupancy(block=block, regs=attrs["regs"], smem_bytes=attrs["static_smem"] + dynamic_smem,
                                 limits=lim, max_threads_per_block=attrs["max_threads_per_block"])
    row = {**attrs, "block": int(block), "dynamic_smem": int(dynamic_smem), "blocks_per_sm": calc["blocks_per_sm"],
           "occupancy": calc["occupancy"], "limiter": calc["limiter"], "blocks_per_sm_api": None,
           "occupancy_api": None}
    try:
        n = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, int(block),
                                                                      int(dynamic_smem))
        row["blocks_per_sm_api"] = int(n)
        row["occupancy_api"] = int(n) * (-(-block // lim.warp_size)) / lim.max_warps_per_sm
    except Exception as e:  # no driver API in this CuPy build: the formula stands alone
        row["api_error"] = f"{type(e).__name__}: {e}"
    return row


def occupancy_table(kernels, block=256, *, dynamic_smem=0) -> list[dict]:
    """``occupancy`` for several kernels. ``kernels``: a mapping name → RawKernel or an iterable of
    RawKernels (named by ``kernel.name``); ``block`` / ``dynamic_smem``: a number or a mapping name → number."""
    items = list(kernels.items()) if hasattr(kernels, "items") else [(k.name, k) for k in kernels]
    rows = []
    for name, k in items:
        b = block[name] if hasattr(block, "items") else block
        s = dynamic_smem[name] if hasattr(dynamic_smem, "items") else dynamic_smem
        rows.append({"kernel": name, **occupancy(k, b, dynamic_smem=s)})
    return rows


def format_occupancy_table(rows, *, max_name: int = 40) -> str:
    head = (f"{'kernel':<{max_name}}{'regs':>5}{'smem B':>8}{'local B':>8}{'block':>6}{'blocks/SM':>10}"
            f"{'occupancy':>10}{'API':>6}  limiter")
    lines = [head, "-" * len(head)]
    for r in rows:
        api = "-" if r.get("blocks_per_sm_api") is None else str(r["blocks_per_sm_api"])
        lines.append(f"{r['kernel'][:max_name]:<{max_name}}{r['regs']:>5}{r['static_smem'] + r['dynamic_smem']:>8}"
                     f"{r['local_bytes']:>8}{r['block']:>6}{r['blocks_per_sm']:>10}{100 * r['occupancy']:>9.0f}%"
                     f"{api:>6}  {r['limiter']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- roofline


def roofline_plot(rows, peak_tflops: float, peak_gbps: float, *, ax=None, path=None, title=None):
    """Log-log roofline: one point per kernel at (FLOP/byte, achieved TFLOP/s) under the roofs.

    ``rows``: dicts with ``name``, ``flops`` and ``bytes`` per call, and ``ms`` per call (or
    ``tflops`` directly); rows without positive flops and bytes are skipped (no place on a log axis).
    The roofs: ``peak_gbps · intensity`` (memory-bound) and ``peak_tflops`` (compute-bound), meeting
    at the ridge point ``peak_tflops / peak_gbps`` FLOP/byte. Returns the axes; saves to ``path``.
    """
    from .plotting import _plt

    if peak_tflops <= 0 or peak_gbps <= 0:
        raise ValueError("peak_tflops and peak_gbps must be positive")
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.6))
    pts = []
    for r in rows:
        fl, by = r.get("flops"), r.get("bytes")
        if not fl or not by or fl <= 0 or by <= 0:
            continue
        tf = r.get("tflops")
        if tf is None:
            tf = fl / (r["ms"] * 1e-3) / 1e12
        pts.append((r.get("name", r.get("op", "?")), fl / by, tf))
    ridge = peak_tflops * 1e3 / peak_gbps  # (TFLOP/s · 1e12) / (GB/s · 1e9) FLOP per byte
    xs = [p[1] for p in pts] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(peak_tflops, grid * peak_gbps / 1e3), color="#c44e52", lw=1.8,
            label=f"roof: {peak_gbps:,.0f} GB/s, {peak_tflops:,.0f} TFLOP/s")
    ax.axvline(ridge, color="#c44e52", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops), textcoords="offset points", xytext=(4, -12),
                fontsize=8, color="#c44e52")
    for name, x, y in pts:
        ax.scatter([x], [y], s=28, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.figure.tight_layout()
    if path is not None:
        ax.figure.savefig(path, dpi=120)
    return ax


def plot_step_breakdown(steps: dict, *, top: int = 16, ax=None, title=None):
    """Grouped horizontal bars of milliseconds per op, one colour per step: ``steps`` maps a label
    (``"book"``, ``"fast"``) to the rows of ``profile_step`` / ``OpTimer.rows``. Shows the ``top`` ops by
    their largest time in any step; the legend gives each step's total."""
    from .plotting import _plt

    plt = _plt()
    labels = list(steps)
    ms = {lab: {r["op"]: r["total_ms"] for r in rows if r.get("depth", 0) == 0} for lab, rows in steps.items()}
    ops = sorted({op for d in ms.values() for op in d}, key=lambda op: -max(d.get(op, 0.0) for d in ms.values()))
    ops = ops[:top]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.32 * len(ops) * max(1, len(labels)) + 1.2))
    yy = np.arange(len(ops))
    h = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        total = sum(ms[lab].values())
        ax.barh(yy + (j - (len(labels) - 1) / 2) * h, [ms[lab].get(op, 0.0) for op in ops], height=h,
                label=f"{lab}: {total:.2f} ms in regions")
    ax.set_yticks(yy, ops, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title or "time per op")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


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
    captured once (``llmgpu.graphs.capture``) and replayed. With kernels this short the GPU finishes
    each one faster than the host can enqueue the next, so wall time per kernel is launch overhead.
    """
    from .graphs import capture
    from .kernels import get_kernel
    from .ops.vector_add import vector_add

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

    ``fn`` must be capturable (see ``llmgpu.graphs``); it runs ``warmup`` times eagerly, then once under
    capture (recorded, not executed).
    """
    from .graphs import capture

    return capture(fn, warmup=warmup).node_counts()


# --------------------------------------------------------------------------- does a step wait for the GPU?


def gpu_spin(ms: float):
    """Queue a kernel on the current stream that keeps the GPU busy for ``ms`` milliseconds (wall clock);
    returns a CUDA event recorded right after it. Nothing waits for it."""
    cp = backend.require_gpu()
    from .kernels import get_kernel

    if not ms >= 0:
        raise ValueError(f"ms must be >= 0, got {ms}")
    get_kernel("spin", "gpu_spin")((1,), (32,), (np.uint64(int(ms * 1e6)),))
    ev = cp.cuda.Event(disable_timing=True)
    ev.record()
    return ev


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
    ``pct_of_step`` is against the measured step. Every ``profile.region`` inside ``fn`` becomes a row."""
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


__all__ = ["LaunchOverhead", "OpTimer", "SMLimits", "activate", "active_timer", "format_occupancy_table",
           "format_table", "gpu_spin", "host_runs_ahead", "kernel_attributes", "launch_count", "launch_overhead",
           "nvtx_range", "occupancy", "occupancy_table", "plot_step_breakdown", "profile_step", "region",
           "roofline_plot", "set_nvtx", "summarize", "theoretical_occupancy"]
