"""dev/cuda keeps kernel experiments outside the package; these checks keep them from rotting.

The experiments are compiled exactly as the package's kernels are in CI (``llmgpu.kernels.compile_check``:
NVRTC, no GPU needed, errors and spills fail), and their scripts must at least start: on a machine
without a GPU they say so and exit 0, on a GPU they check the kernel against the package.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from llmgpu import backend
from llmgpu.kernels import loader

DEV_CUDA = Path(__file__).resolve().parents[1] / "dev" / "cuda"
EXPERIMENTS = sorted(DEV_CUDA.glob("*.cu"))


def test_experiments_exist():
    assert DEV_CUDA / "layernorm_forward_fast.cu" in EXPERIMENTS
    assert (DEV_CUDA / "README.md").is_file()


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_compiles_for_sm90_without_spills(path):
    """A fresh process, as CI runs the compile check (see tests/test_kernels_loader.py for why)."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    n_declared = len(loader.expressions_in(path.read_text()))
    assert n_declared > 0, f"{path.name} declares no kernels (// llmgpu:kernel lines)"
    r = subprocess.run([sys.executable, "-m", "llmgpu.kernels.compile_check", "-a", "sm_90", str(path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ok   {path.stem}.cu [sm_90]: {n_declared} kernels" in r.stdout.splitlines(), r.stdout


def test_layernorm_forward_fast_script_runs():
    """Without a GPU: one line saying so, exit 0. With one: small rows, checked against the package."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    script = DEV_CUDA / "layernorm_forward_fast.py"
    r = subprocess.run([sys.executable, str(script), "--rows", "1000", "--reps", "3", "--no-copy",
                        "--dtype", "fp32", "--dtype", "bf16", "--dtype", "fp16"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    if backend.gpu_unavailable_reason() is not None:
        assert len(r.stdout.splitlines()) == 1 and "no GPU" in r.stdout, r.stdout
    else:
        assert "FAIL" not in r.stdout, r.stdout
