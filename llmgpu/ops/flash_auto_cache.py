"""Where ``flash_attention``'s ``kernel="auto"`` keeps its choices between processes (chapter 2b).

A training run resumed in a new process must pick the same attention kernel as the run it continues, or the
resumed steps are not bit-exact. So "auto" writes each measured choice to a small JSON file, keyed by what the
timing depends on (GPU name, CUDA and cuDNN versions, our kernels' source, dtype, B, H, T, D, causal, direction),
and reads it before timing anything. The file is written atomically; a missing, unreadable or damaged file reads
as empty (and is rewritten on the next choice), never as an error.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# "auto" picks ours only when it is at least 3 % faster than cuDNN: closer than that, three timed calls cannot tell
# them apart, and a fixed preference keeps the choice the same on machines and runs that time them a little
# differently (cuDNN, NVIDIA's, is the one to prefer on a tie).
AUTO_MARGIN = 0.03


def auto_cache_path() -> Path:
    """The JSON file where "auto" keeps its choices: ``$LLMGPU_CACHE_DIR/flash_auto.json``, else
    ``~/.cache/llmgpu/flash_auto.json``."""
    root = os.environ.get("LLMGPU_CACHE_DIR") or Path.home() / ".cache" / "llmgpu"
    return Path(root) / "flash_auto.json"


def read_auto_cache(path: Path | None = None) -> dict:
    """The cached choices ({key: "ours" | "cudnn"}); {} when the file is missing, unreadable or damaged."""
    try:
        data = json.loads((path or auto_cache_path()).read_text())
    except Exception:
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: c for k, c in data.items() if isinstance(k, str) and c in ("ours", "cudnn")}


def write_auto_choice(key: str, choice: str, path: Path | None = None) -> bool:
    """Add one choice to the cache file, atomically (a temporary file in the same folder, then os.replace, so a
    reader never sees half a file); a damaged file is replaced. False when it cannot be written (read-only)."""
    path = path or auto_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_auto_cache(path)
        data[key] = choice
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except Exception:
        return False
    return True


def pick_faster(times: dict) -> str:
    """The choice from {name: ms}: cuDNN unless ours is at least AUTO_MARGIN faster."""
    if "ours" in times and "cudnn" in times:
        return "ours" if times["ours"] * (1.0 + AUTO_MARGIN) <= times["cudnn"] else "cudnn"
    return min(times, key=times.get)
