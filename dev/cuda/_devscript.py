"""What the dev/cuda scripts share: the package on the path, and the one line they print without a GPU.

Each script runs as ``python dev/cuda/<script>.py`` (this folder is then first on ``sys.path``) from a checkout
with or without ``pip install -e .``, so importing this module first makes ``import llmgpu`` work either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import llmgpu  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmgpu import backend  # noqa: E402


def cupy_or_say_why(note: str = ""):
    """CuPy when a GPU is usable; otherwise None, after printing the one line tests/test_dev_cuda.py expects
    of a script without a GPU: ``no GPU: <why>`` (and ``note``, what the script would have done)."""
    reason = backend.gpu_unavailable_reason()
    if reason is not None:
        print(f"no GPU: {reason}{note}")
        return None
    return backend.require_gpu()


def hopper_or_say_why(note: str = ""):
    """CuPy when the GPU is an sm_90 (Hopper, where the wgmma experiments run); otherwise None, after one line
    saying why (``no GPU: ...`` as ``cupy_or_say_why``, or ``no sm_90 GPU: ...``)."""
    cp = cupy_or_say_why(note)
    if cp is None:
        return None
    cc = cp.cuda.Device().compute_capability
    if cc != "90":
        print(f"no sm_90 GPU: this is sm_{cc}, and wgmma exists on Hopper (sm_90a) only{note}")
        return None
    return cp
