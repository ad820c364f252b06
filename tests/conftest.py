"""Shared fixtures and the `gpu` marker.

Tests marked ``gpu`` run only where CuPy sees a CUDA device; elsewhere they are *skipped with the
reason* (never passed silently), so a CPU run's summary shows how many GPU checks did not run.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from llmgpu import backend


def pytest_collection_modifyitems(config, items):
    reason = backend.gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("LLMGPU_REQUIRE_GPU"):
        # tools/gpu_check.sh sets this: on the GPU machine a skipped GPU test is a failure.
        pytest.exit(f"LLMGPU_REQUIRE_GPU is set but {reason}", returncode=3)
    skip = pytest.mark.skip(reason=f"GPU test not run: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    reason = backend.gpu_unavailable_reason()
    if reason is None:
        return f"llmgpu: GPU {backend.device_info(backend.cupy_module()).summary()}"
    return f"llmgpu: no GPU ({reason}); tests marked 'gpu' will be SKIPPED"


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, different per test).
    crc32, not hash(): Python salts str hashes per process, which made the inputs change run to run."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def cp():
    """The CuPy module (only requested by tests marked gpu)."""
    return backend.require_gpu()


@pytest.fixture(autouse=True)
def _hopper_backward_variant(request):
    """A GPU test parametrized with our flash backward's ``variant="wgmma"`` skips, saying why, on a GPU where that
    kernel cannot run (it is built for sm_90a only); every other variant runs everywhere."""
    spec = getattr(request.node, "callspec", None)
    if spec is None or spec.params.get("variant") != "wgmma" or "cp" not in request.fixturenames:
        return
    from llmgpu.ops.flash_launch import wgmma_unsupported

    if why := wgmma_unsupported(request.getfixturevalue("cp").empty(1, np.float16)):
        pytest.skip(f"the Hopper flash backward cannot run here: {why}")


@pytest.fixture
def one_error_line(capsys):
    """Check a CLI call: ``one_error_line(exit_code, *needles)`` asserts exit code 2 and exactly one
    ``llmgpu: error: ...`` line on stderr (no traceback) holding every needle."""
    def check(code, *needles):
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2, err
        assert len(lines) == 1 and lines[0].startswith("llmgpu: error: "), err
        for n in needles:
            assert n in lines[0], lines[0]
        assert "Traceback" not in err

    return check
