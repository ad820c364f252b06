"""dev/cuda keeps kernel experiments outside the package; these checks keep them from rotting.

The experiments are compiled exactly as the package's kernels are in CI (``llmgpu.kernels.compile_check``:
NVRTC, no GPU needed, errors and spills fail), and their scripts must at least start: on a machine
without a GPU they say so and exit 0, on a GPU they check the kernel against the package.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def test_wgmma_probe_compiles_for_sm90a_with_wgmma():
    """The probe's wgmma exists on sm_90a only; for sm_80 / sm_90 (the test above) its body is a trap."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    path = DEV_CUDA / "wgmma_probe.cu"
    r = subprocess.run([sys.executable, "-m", "llmgpu.kernels.compile_check", "-a", "sm_90a", "-v", str(path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   wgmma_probe.cu [sm_90a]: 4 kernels" in r.stdout, r.stdout
    regs = [int(m) for m in re.findall(r"wgmma_probe<\d, \d>\s+(\d+) regs", r.stdout)]
    assert len(regs) == 4 and min(regs) >= 32, r.stdout  # 32 accumulators live: the wgmma body is compiled in


def _probe():
    sys.path.insert(0, str(DEV_CUDA))
    try:
        import wgmma_probe
    finally:
        sys.path.remove(str(DEV_CUDA))
    return wgmma_probe


@pytest.mark.parametrize("nk", [1, 4])
def test_wgmma_probe_bookkeeping_on_the_cpu(nk):
    """Each hypothesis's image decodes back to its operand under the addressing model, so on emulated hardware
    that follows the model every hypothesis expected to pass passes and every counter-hypothesis fails: the
    probe can tell them apart (what the GPU does is what dev/cuda/wgmma_probe.py finds out)."""
    w = _probe()
    rng = np.random.default_rng(nk)
    a = w.from_bits(w.bits(rng.standard_normal((w.M, 16 * nk))))
    b = w.from_bits(w.bits(rng.standard_normal((16 * nk, w.N))))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    hyps = w.hypotheses(nk)
    assert sum(h[4] for h in hyps) >= 3 and sum(not h[4] for h in hyps) >= 2
    for h in hyps:
        res = w.judge(w.emulate(a, b, h), ref)
        assert res["passed"] == h[4], (h[0], res)
        assert res["values_found"] == 1.0 or not h[4]


def test_wgmma_probe_layouts_and_descriptor_bits():
    w = _probe()
    off = w.sw128_layout(16)
    assert sorted(off.ravel() // 2) == list(range(16 * 64))  # a permutation of the 2 KB
    assert off[0, 8] == 16 and off[1, 0] == 128 + 16 and off[1, 8] == 128 and off[9, 0] == 1024 + 128 + 16
    assert w.descriptor(2048, 16, 1024, w.SW128) == (128 | 1 << 16 | 64 << 32 | 1 << 62)
    with pytest.raises(AssertionError):
        w.descriptor(8, 16, 1024, 0)  # not a multiple of 16 bytes
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    assert np.array_equal(w.from_bits(w.bits(x)), x)  # exact in bf16
    frags = w.a_fragments(np.arange(64 * 16, dtype=np.float32).reshape(64, 16) % 7)
    assert frags.shape == (1, 128, 4)


def test_wgmma_probe_script_runs():
    """Without a GPU: one line saying so, exit 0 (on a Hopper GPU it runs the probe)."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    r = subprocess.run([sys.executable, str(DEV_CUDA / "wgmma_probe.py")], capture_output=True, text=True, timeout=600)
    if backend.gpu_unavailable_reason() is not None:
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "no GPU" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode in (0, 1) and "as expected" in r.stdout or "nothing to probe" in r.stdout, r.stdout


def test_flash_fwd_wgmma_compiles_for_sm90a_without_spills_or_serialized_wgmma():
    """D = 64: two blocks of 256 threads per SM (128 registers); D = 128: one. And ptxas keeps the wgmma asynchronous:
    it serializes them (its C7514/C7515 notes) when it cannot follow the commit groups, undoing PIPE's overlap."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    from llmgpu.kernels import compile_check

    r = compile_check.compile_path(DEV_CUDA / "flash_fwd_wgmma.cu", "sm_90a")
    assert r.ok, r.log
    assert len(r.kernels) == 8 and not any(k.spills for k in r.kernels), r.kernels
    assert all(k.registers <= 128 for k in r.kernels if ", 64, " in k.expression), r.kernels
    assert "serialized" not in r.log, r.log


def test_flash_fwd_wgmma_script_runs():
    """Without a GPU: one line saying so, exit 0 (on a Hopper GPU it checks and times the kernel)."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    r = subprocess.run([sys.executable, str(DEV_CUDA / "flash_fwd_wgmma.py"), "--no-time"], capture_output=True,
                       text=True, timeout=600)
    if backend.gpu_unavailable_reason() is not None:
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "no GPU" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 0 and "FAIL" not in r.stdout or "nothing to run" in r.stdout, r.stdout
