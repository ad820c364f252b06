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
