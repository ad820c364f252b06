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
