"""tools/checks/sanitize_kernels.py, the program tools/gpu_check.sh runs under compute-sanitizer (issue 13).

On the CPU: its calls run on NumPy (``--cpu-dry``: every op, method and dtype it will launch on the GPU
takes these arguments), it names every kernel our .cu files declare, its compute-sanitizer filter
options name each of them, and gpu_check.sh runs it under memcheck and racecheck by default.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_tools import load_tool

from llmgpu import backend
from llmgpu.kernels import loader

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    return load_tool("checks/sanitize_kernels")


def test_driver_calls_run_on_numpy(capsys):
    assert _driver().main(["--cpu-dry"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "all " in out


def test_driver_names_every_kernel_and_filters_on_them():
    drv = _driver()
    names = drv.kernel_names()
    for cu in sorted((ROOT / "llmgpu" / "kernels").glob("*.cu")):
        for expr in loader.expressions_in(cu.read_text()):
            assert expr.split("<")[0].strip() in names
    args = drv.filter_args("memcheck")
    assert [args[i + 1] for i in range(len(args)) if args[i] == "--kernel-name"] == [f"kns={n}" for n in names]
    assert "--report-api-errors" in args and "--report-api-errors" not in drv.filter_args("racecheck")
    assert not any("cudnn" in n or "gemm" in n for n in names)


@pytest.mark.skipif(backend.gpu_available(), reason="checks the no-GPU message")
def test_driver_without_gpu_says_so(capsys):
    assert _driver().main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_check_runs_memcheck_and_racecheck_by_default():
    sh = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert "sanitize" in re.search(r'STEPS=\$\{STEPS:-"([^"]*)"\}', sh).group(1).split()
    assert "--find-sanitizer" in sh and "for tool in memcheck racecheck" in sh
    assert '--error-exitcode 1' in sh and "tools/checks/sanitize_kernels.py" in sh
