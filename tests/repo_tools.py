"""The repository's ``tools/`` scripts, imported as modules by the tests that check them (they are not part of the
installed package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(path: str):
    """``tools/<path>.py`` as a fresh module, e.g. ``load_tool("probes/probe_gemm_k")``."""
    spec = importlib.util.spec_from_file_location(Path(path).name, TOOLS / f"{path}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
