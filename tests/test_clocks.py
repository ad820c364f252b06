"""llmgpu.perf.clocks: reading the GPU's clock and power through nvidia-smi (a stand-in script on the CPU)."""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import sys
import time

import numpy as np
import pytest
from repo_tools import load_tool

from llmgpu import backend
from llmgpu.perf import clocks

# A stand-in for nvidia-smi: one reading a call, or one every -lms milliseconds until killed. The clock steps down
# from 1980 to 1500 MHz after the first five readings and the power-cap flag turns on with it, so a window over
# the later readings has other medians than one over the first. FAKE_OLD=1: a driver that knows only the old
# spelling of the flag (clocks_throttle_reasons).
FAKE = '''#!{python}
import datetime, os, sys, time
args = " ".join(sys.argv[1:])
if os.environ.get("FAKE_OLD") and "clocks_event_reasons" in args:
    print('Field "clocks_event_reasons.sw_power_cap" is not a valid field to query.'); sys.exit(2)
if os.environ.get("FAKE_BROKEN"):
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."); sys.exit(9)
loop = sys.argv[sys.argv.index("-lms") + 1] if "-lms" in sys.argv else None
n = 0
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    mhz, cap = (1980, "Not Active") if n < 5 else (1500, "Active")
    print(f"{{now}}, {{mhz}}, {{350.0 + n:.2f}}, {{cap}}, 700.00", flush=True)
    n += 1
    if loop is None:
        break
    time.sleep(int(loop) / 1000)
'''


@pytest.fixture
def fake_smi(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_parse_line():
    s = clocks.parse_line("2026/12/03 20:29:30.331, 1650, 693.03, Active, 700.00")
    assert s.sm_mhz == 1650 and s.power_w == 693.03 and s.power_cap and s.limit_w == 700.0
    assert s.t == dt.datetime(2026, 12, 3, 20, 29, 30, 331000).timestamp()
    assert not clocks.parse_line("2026/12/03 20:29:30.331, 1980, 123.5, Not Active, [N/A]").power_cap
    assert clocks.parse_line("2026/12/03 20:29:30.331, 1980, 123.5, Not Active, [N/A]").limit_w is None
    for bad in ("timestamp, clocks.sm [MHz], power.draw [W], x, y", "", "No devices were found",
                "2026/12/03 20:29:30.331, [N/A], 123.5, Not Active, 700.00"):
        assert clocks.parse_line(bad) is None, bad


def test_summarize_windows():
    samples = [clocks.Sample(t, mhz, w, cap, 700.0) for t, mhz, w, cap in
               [(0.0, 1980, 120, False), (1.0, 1600, 690, True), (2.0, 1620, 686, True), (3.0, 1980, 130, False)]]
    whole = clocks.summarize(samples)
    assert whole["samples"] == 4 and whole["power_cap"] == 0.5 and whole["sm_mhz_min"] == 1600
    mid = clocks.summarize(samples, 0.5, 2.5)
    assert mid == {"sm_mhz": 1610.0, "sm_mhz_min": 1600, "power_w": 688.0, "power_limit_w": 700.0,
                   "power_cap": 1.0, "samples": 2}
    assert clocks.summarize(samples, 5.0, 6.0) is None and clocks.summarize([]) is None


def test_monitor_samples_a_window(fake_smi):
    with clocks.ClockMonitor(device="0000:19:00.0", interval_ms=20, nvidia_smi=fake_smi) as mon:
        assert mon.available and mon.device == "0000:19:00.0"
        time.sleep(0.4)
        t_mid = time.time()
        time.sleep(0.4)
        live = mon.summary()  # read while the sampler runs
    assert live is not None and live["samples"] >= 3
    assert len(mon.samples) >= 10, mon.samples
    assert mon.samples[0].sm_mhz == 1980 and mon.samples[-1].sm_mhz == 1500 and mon.samples[-1].power_cap
    late = mon.summary(t_mid, time.time())
    assert late["sm_mhz"] == 1500 and late["power_cap"] == 1.0 and late["power_limit_w"] == 700.0
    trace = mon.trace()
    assert trace[0]["t"] == 0.0 and trace[-1]["t"] > 0.5 and set(trace[0]) == {"t", "sm_mhz", "power_w",
                                                                                "power_cap", "limit_w"}
    assert mon.stop() == mon.samples  # stopping twice is harmless


def test_monitor_left_running_is_ended(fake_smi):
    """A run that ends without stop (an exception, Ctrl-C) leaves no nvidia-smi behind: the finalizer ends it."""
    mon = clocks.ClockMonitor(interval_ms=20, nvidia_smi=fake_smi).start()
    proc, path = mon._proc, mon._file
    assert proc.poll() is None
    del mon
    gc.collect()
    assert proc.wait(timeout=10) is not None and not os.path.exists(path)


def test_monitor_falls_back_to_the_old_field_name(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_OLD", "1")
    with clocks.ClockMonitor(interval_ms=20, nvidia_smi=fake_smi) as mon:
        time.sleep(0.3)
    assert mon.available and len(mon.samples) >= 3


def test_monitor_without_nvidia_smi_says_why(fake_smi, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    mon = clocks.ClockMonitor().start()
    assert not mon.available and "nvidia-smi not found" in mon.reason
    assert mon.stop() == [] and mon.summary() is None and mon.trace() == []
    monkeypatch.setenv("FAKE_BROKEN", "1")
    mon = clocks.ClockMonitor(nvidia_smi=fake_smi).start()
    assert not mon.available and "couldn't communicate" in mon.reason and mon.summary() is None
    not_a_program = tmp_path / "not-a-program"
    not_a_program.write_text("plain text")  # not executable: running it raises PermissionError
    mon = clocks.ClockMonitor(nvidia_smi=str(not_a_program)).start()
    assert not mon.available and "could not be run" in mon.reason and mon.stop() == []
    with pytest.raises(ValueError, match="interval_ms"):
        clocks.ClockMonitor(interval_ms=1)


@pytest.mark.gpu
def test_gpu_monitor_reads_this_gpu(cp):
    """On the GPU machine: nvidia-smi, addressed by the PCI bus id CuPy reports, gives readings of this GPU; under
    a few hundred ms of matrix products its SM clock is above idle."""
    bus = backend.device_info(cp).pci_bus_id
    assert bus and bus.count(":") == 2, bus
    a = cp.ones((4096, 4096), cp.float32)
    with clocks.ClockMonitor(device=bus, interval_ms=50) as mon:
        assert mon.available, mon.reason
        t0 = time.time()
        while time.time() - t0 < 0.6:
            a = a @ a / 4096
            cp.cuda.Device().synchronize()
        t1 = time.time()
    busy = mon.summary(t0, t1)
    assert busy is not None and busy["samples"] >= 3, (busy, mon.samples[:3])
    assert busy["sm_mhz"] > 500 and busy["power_w"] > 0 and busy["power_limit_w"] and busy["power_limit_w"] > 100


def _sustained_probe():
    return load_tool("probes/probe_sustained_gemm")


def test_sustained_probe_groups_and_windows():
    """tools/probes/probe_sustained_gemm.py on NumPy with a stand-in clock (each reading 0.25 s later): groups until the
    requested seconds have passed; the burst is the first group, the sustained rate the groups of the last second;
    the clock windows are the first 0.2 s and that last second."""
    probe = _sustained_probe()
    now = iter(np.arange(0.0, 100.0, 0.25))
    calls = []
    rows = probe.sustained(lambda: calls.append(1), np, seconds=2.0, group=3, flops=1e9, clock=lambda: next(now))
    # readings: 0 (the stop at 2.0), then per group a start and an end (and a check of the stop before each later
    # group): groups 0.25-0.5, 1.0-1.25, 1.75-2.0
    assert [(r["t0"], r["t"]) for r in rows] == [(0.25, 0.5), (1.0, 1.25), (1.75, 2.0)] and len(calls) == 3 * 3
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    for r, v in zip(rows, (4.0, 1.0, 1.0)):
        r["tflops"] = v
    samples = [clocks.Sample(t, 1980 if t < 0.5 else 1600, 600.0, t >= 0.5, 700.0) for t in np.arange(0, 3, 0.05)]

    class Mon:
        def summary(self, t0, t1):
            return clocks.summarize(samples, t0, t1)

    s = probe.summarize(rows, Mon())
    assert s["burst_tflops"] == 4.0 and s["sustained_tflops"] == 1.0 and s["sustained_groups"] == 2
    assert s["burst_clocks"]["sm_mhz"] == 1980 and s["sustained_clocks"]["sm_mhz"] == 1600
    assert probe.summarize(rows, None)["burst_clocks"] is None


def test_sustained_probe_runs(capsys, tmp_path):
    """Without a GPU: one line saying so. With one: a short run of both products, each with a burst and a
    sustained rate and clock readings, written to JSON."""
    probe = _sustained_probe()
    if not backend.gpu_available():
        assert probe.main([]) == 0 and capsys.readouterr().out.startswith("no GPU")
        return
    out = tmp_path / "sustained.json"
    assert probe.main(["--seconds", "0.5", "--idle", "0.1", "--group", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [p["product"] for p in res["products"]] == ["cuBLAS bf16 8192³", "fc GEMM B=64 (cuBLASLt, bias)"]
    for p in res["products"]:
        assert p["burst_tflops"] > 50 and p["sustained_tflops"] > 50 and p["groups"] >= 2, p
        assert p["sustained_clocks"] and p["sustained_clocks"]["sm_mhz"] > 300, p
    assert res["clock_trace"] and "sustained" in capsys.readouterr().out
