"""What the multi-rank tests (test_dist.py and test_train_llama.py on CPUs with MPI, test_dist_multirank_gpu.py on one
GPU) share: the MPI launcher and the environment of CPU ranks, the step worker under mpiexec, ``llmgpu train`` on CPU
ranks, a run's logged losses, a rank's PID found through /proc, waiting for a run to log its first steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgpu.dist import DistError

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "dist_step.py"
try:  # the mpiexec of the MPI mpi4py loads (another MPI's would start singletons)
    from llmgpu.dist.launch import find_mpiexec

    MPIEXEC = find_mpiexec()
except (ImportError, DistError, RuntimeError):  # RuntimeError: mpi4py without its MPI library
    MPIEXEC = None
HAVE_MPI = MPIEXEC is not None
# CI installs the test extra, which brings mpi4py and mpich: there these tests must run, not skip
needs_mpi = pytest.mark.skipif(not HAVE_MPI and not os.environ.get("CI"),
                               reason="MPI tests need mpi4py and mpiexec: pip install 'llmgpu[dist]'")
# Open MPI (the GPU image's MPI) refuses to start ranks as root without both switches
ENV = dict(os.environ, LLMGPU_DEVICE="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run_worker(n, *args, timeout=120):
    """``tests/workers/dist_step.py`` on ``n`` MPI ranks (N ranks against one rank at the same global batch)."""
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(WORKER), *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def train_cli(*args, timeout=180):
    """``llmgpu train`` on the CPU with small batches, a constant learning rate and a loss logged every step."""
    return subprocess.run([sys.executable, "-m", "llmgpu", "train", "--device", "cpu", "--batch", "4", "--seq", "32",
                           "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--no-plot",
                           "--no-progress", "--warmup", "0", "--schedule", "constant", *map(str, args)],
                          env=ENV, capture_output=True, text=True, timeout=timeout)

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
