"""The GPU's clock and power draw while something runs (chapter 8: the step runs at the power cap).

A GPU under a power limit lowers its clock when the work draws more than the limit allows: the same kernels
then take longer in a long run than in a short burst. The H200 (700 W) does this during a training step: a
benchmark that does not say at what clock it ran hides part of the story. ``ClockMonitor`` samples the SM clock,
the power draw and the driver's "power cap" flag with ``nvidia-smi`` every ``interval_ms`` in a background
process, and ``summary(t0, t1)`` gives the medians over a window of wall-clock time (``time.time()``)::

    with ClockMonitor() as mon:
        t0 = time.time(); run_steps(); t1 = time.time()
    print(mon.summary(t0, t1))   # {'sm_mhz': 1620.0, 'power_w': 686.0, 'power_cap': 0.88, 'samples': 16}

Without ``nvidia-smi`` (no NVIDIA driver, a CPU machine) the monitor does nothing: ``available`` is False,
``reason`` says why, and ``summary`` returns None. nvidia-smi only reads the card's state; nothing here changes
a clock or a limit.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import statistics
import subprocess
import tempfile
import weakref
from dataclasses import asdict, dataclass

QUERY = ("timestamp", "clocks.sm", "power.draw", "clocks_event_reasons.sw_power_cap", "enforced.power.limit")
# Drivers before 535 spell the flag "clocks_throttle_reasons"; both mean the power limit is lowering the clock.
QUERY_OLD = ("timestamp", "clocks.sm", "power.draw", "clocks_throttle_reasons.sw_power_cap", "enforced.power.limit")


@dataclass(frozen=True)
class Sample:
    """One reading: wall-clock seconds (``time.time()`` scale), SM clock, power draw, power limit, and whether the
    power limit was lowering the clock."""

    t: float
    sm_mhz: float
    power_w: float
    power_cap: bool
    limit_w: float | None = None


def parse_line(line: str) -> Sample | None:
    """A sample from one line of ``nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits``; None for a
    line that is not one (a header, an error message, a value the driver reports as "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(QUERY):
        return None
    try:
        # nvidia-smi prints local time; datetime.timestamp() of a naive datetime takes it as local time too
        t = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        limit = float(parts[4]) if parts[4].replace(".", "", 1).isdigit() else None
        return Sample(t, float(parts[1]), float(parts[2]), parts[3] == "Active", limit)
    except ValueError:
        return None


def _read_samples(path: str) -> list[Sample]:
    with open(path) as f:
        return [s for s in map(parse_line, f) if s is not None]


def _end_sampler(proc: subprocess.Popen, path: str | None) -> None:
    """Stop the nvidia-smi child, and remove its file unless ``path`` is None (``stop``, or at exit when a run
    ended without ``stop``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if path is not None and os.path.exists(path):
        os.unlink(path)


def summarize(samples, t0: float | None = None, t1: float | None = None) -> dict | None:
    """Medians of the SM clock and the power draw, and the fraction of samples with the power cap active, over
    the samples in [t0, t1] (all when not given); None when there are none."""
    sel = [s for s in samples if (t0 is None or s.t >= t0) and (t1 is None or s.t <= t1)]
    if not sel:
        return None
    limits = [s.limit_w for s in sel if s.limit_w is not None]
    return {"sm_mhz": statistics.median(s.sm_mhz for s in sel),
            "sm_mhz_min": min(s.sm_mhz for s in sel),
            "power_w": statistics.median(s.power_w for s in sel),
            "power_limit_w": max(limits) if limits else None,
            "power_cap": sum(s.power_cap for s in sel) / len(sel),
            "samples": len(sel)}


class ClockMonitor:
    """Sample the SM clock and power of GPU ``device`` (what ``nvidia-smi -i`` takes: an index, a PCI bus id such
    as ``DeviceInfo.pci_bus_id``, a UUID) every ``interval_ms`` until ``stop``
    (or the end of a ``with`` block). ``samples`` holds the readings after ``stop``."""

    def __init__(self, device: int | str = 0, interval_ms: int = 100, nvidia_smi: str | None = None):
        if interval_ms < 10:
            raise ValueError(f"interval_ms must be >= 10 (nvidia-smi's loop), got {interval_ms}")
        self.device, self.interval_ms = str(device), int(interval_ms)  # an index, a PCI bus id or a UUID
        self.exe = nvidia_smi or shutil.which("nvidia-smi")
        self.reason = None if self.exe else "nvidia-smi not found (no NVIDIA driver here): no clock readings"
        self.samples: list[Sample] = []
        self._proc = self._file = None

    @property
    def available(self) -> bool:
        return self.reason is None

    def _argv(self, fields) -> list[str]:
        """nvidia-smi's command line reading ``fields`` of this GPU once (the sampler adds its loop)."""
        return [self.exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", self.device]

    def _query(self) -> tuple[str, ...] | None:
        """The field list this driver knows (the new spelling, else the old), or None (``reason`` says why)."""
        for q in (QUERY, QUERY_OLD):
            try:
                r = subprocess.run(self._argv(q), capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:  # a measurement aid must not stop what it measures
                self.reason = f"nvidia-smi could not be run: {type(e).__name__}: {e}"
                return None
            if r.returncode == 0 and parse_line(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""):
                return q
            err = (r.stdout + r.stderr).strip().splitlines()
        self.reason = f"nvidia-smi cannot read the clocks of GPU {self.device}: {err[-1] if err else 'no output'}"
        return None

    def start(self) -> ClockMonitor:
        if not self.available or self._proc is not None:
            return self
        q = self._query()
        if q is None:
            return self
        fd, self._file = tempfile.mkstemp(prefix="llmgpu-clocks-", suffix=".csv")
        with os.fdopen(fd, "w") as out:  # the child keeps its own handle
            try:
                self._proc = subprocess.Popen([*self._argv(q), "-lms", str(self.interval_ms)], stdout=out,
                                              stderr=subprocess.DEVNULL)
            except OSError as e:
                self.reason = f"nvidia-smi could not be started: {e}"
                os.unlink(self._file)
                self._file = None
                return self
        # an exception or Ctrl-C between start and stop must not leave nvidia-smi running after the process
        self._finalizer = weakref.finalize(self, _end_sampler, self._proc, self._file)
        return self

    def stop(self) -> list[Sample]:
        if self._proc is None:
            return self.samples
        _end_sampler(self._proc, None)  # the child ends first, so its last readings are in the file
        self.samples = _read_samples(self._file)
        self._finalizer()  # removes the file
        self._proc = self._file = None
        return self.samples

    def summary(self, t0: float | None = None, t1: float | None = None) -> dict | None:
        """``summarize`` over the samples so far (read from the running sampler's file without stopping it)."""
        return summarize(_read_samples(self._file) if self._proc is not None else self.samples, t0, t1)

    def trace(self, t_origin: float | None = None) -> list[dict]:
        """The samples as dictionaries, ``t`` in seconds from ``t_origin`` (default: the first sample)."""
        if not self.samples:
            return []
        origin = self.samples[0].t if t_origin is None else t_origin
        return [{**asdict(s), "t": round(s.t - origin, 3)} for s in self.samples]

    def __enter__(self) -> ClockMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["QUERY", "ClockMonitor", "Sample", "parse_line", "summarize"]
