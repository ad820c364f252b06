import fcntl
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from llmgpu.kernels import compile_check, loader


def test_every_kernel_file_declares_kernels():
    names = loader.available()
    assert "vector_add" in names and "matmul" in names
    for name in names:
        assert loader.name_expressions(name), name


def test_brace_expansion():
    assert loader._expand("f<{float,__half}, {1,2}>") == ["f<float, 1>", "f<float, 2>", "f<__half, 1>", "f<__half, 2>"]
    assert loader._expand("plain") == ["plain"]


def test_template_args_spelling():
    assert loader.template_args(np.float32, 32) == "float, 32"
    assert loader.template_args("bf16") == "__nv_bfloat16"
    assert loader.template_args(np.int64(16)) == "16"


def test_kernel_source_extracts_one_function():
    src = loader.kernel_source("matmul", "matmul_tiled")
    assert src.lstrip().startswith("template <int TILE>")
    assert "matmul_naive" not in src and src.rstrip().endswith("}")
    with pytest.raises(KeyError):
        loader.kernel_source("matmul", "no_such_kernel")


def test_missing_source_file_error():
    with pytest.raises(FileNotFoundError, match="available"):
        loader.source("nope")


def test_show_source_returns_highlightable_code():
    obj = loader.show_source("vector_add", "vector_add")
    html = obj._repr_html_() if hasattr(obj, "_repr_html_") else str(obj)
    assert "vector_add" in html


@pytest.fixture(scope="module")
def sm90_report(tmp_path_factory):
    """The CI compile check for sm_90, in a fresh process as CI runs it.

    A fresh process matters: in a process that has already loaded another NVRTC (PyTorch brings its
    own), NVRTC's ptxas report came back empty on the H200, and the report is what shows spills.
    Under pytest-xdist it runs once for all workers, under a file lock: several compile checks at
    once on the H200 returned empty ptxas reports for some files (0 kernels found).
    """
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, all workers
    saved = shared / "sm90_report.json"
    with open(shared / "sm90_report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            return SimpleNamespace(**json.loads(saved.read_text()))
        r = subprocess.run([sys.executable, "-m", "llmgpu.kernels.compile_check", "-a", "sm_90"],
                           capture_output=True, text=True, timeout=600)
        saved.write_text(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "returncode": r.returncode}))
        return r


@pytest.mark.parametrize("name", loader.available())
def test_compiles_for_sm90_without_spills(sm90_report, name):
    """Every file for sm_90, or for its own arch-specific target (``// llmgpu:arch``, Hopper's sm_90a)."""
    arch = loader.required_arch(name) or "sm_90"
    lines = [ln for ln in sm90_report.stdout.splitlines() if ln[5:].startswith(f"{name}.cu [{arch}]")]
    assert lines, sm90_report.stdout + sm90_report.stderr
    n_declared = len(loader.name_expressions(name))
    assert lines[0] == f"ok   {name}.cu [{arch}]: {n_declared} kernels", sm90_report.stdout


def test_arch_specific_files():
    """The arch directive is read from the source; files without one run on any GPU."""
    assert loader.required_arch("flash_attention_wgmma") == "sm_90a"
    assert loader.required_arch("flash_attention") is None
    assert loader.arch_in("// llmgpu:arch sm_100a\n") == "sm_100a" and loader.arch_in("// llmgpu:kernel f\n") is None


def test_compile_check_reports_errors(monkeypatch, tmp_path):
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed")
    bad = tmp_path / "broken.cu"
    bad.write_text("// llmgpu:kernel broken\n__global__ void broken(float* x) { x[0] = undefined_name; }\n")
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    assert compile_check.main(["broken", "-a", "sm_90"]) == 1
