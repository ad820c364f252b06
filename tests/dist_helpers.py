"""What the multi-rank tests (test_dist.py on CPUs with MPI, test_dist_multirank_gpu.py on one GPU) share: a run's
logged losses, a rank's PID found through /proc, waiting for a run to log its first steps."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# the variables a rank's environment names its rank in: MPICH's Hydra, Open MPI, llmgpu's GPU launcher
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK")


def losses(run) -> list[float]:
    """The training losses a run logged (log.jsonl), in order."""
    return [json.loads(line)["loss"] for line in open(Path(run) / "log.jsonl") if '"train"' in line]


def rank_pid(marker: str, rank: int, deadline_s: float = 60) -> int:
    """The PID of rank ``rank`` of the run whose command line holds ``marker`` (its --out), not mpiexec's."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in cmd and b"mpiexec" not in cmd and b"--nproc" not in cmd and any(
                    f"{v}={rank}".encode() in env for v in RANK_VARS):
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} of {marker} never started")


def wait_for_steps(out, n: int = 2, deadline_s: float = 90, proc=None):
    """Return once the run in ``out`` has logged ``n`` training steps (an AssertionError after ``deadline_s``, or
    at once with its stderr when ``proc``, the run's ``Popen`` with piped stderr, has ended before)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        log = Path(out) / "log.jsonl"
        if log.exists() and log.read_text().count('"train"') >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {n} steps: "
                                 f"{proc.stderr.read()[-1500:] if proc.stderr else ''}")
        time.sleep(0.2)
    raise AssertionError("the run never got going")
