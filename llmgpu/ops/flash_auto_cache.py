"""Where ``flash_attention``'s ``kernel="auto"`` keeps its choices (chapter 2b).

**In a run**: a ``KernelChoices`` record, {(direction, B, H, T, D, dtype, causal[, H_kv]): "ours" | "cudnn"}, owned by
whoever calls (``FastGPT`` keeps one, ``model.kernel_choices``) and passed as ``choices=``. "auto" looks there first
and writes there what it resolved. A training run saves its record in the checkpoint and a resumed run pins it
(loads it before its first step: no timing, the same kernels, so the resumed steps are bit-exact).

**On a machine**: a small JSON file (``auto_cache_path``), keyed by what the timing depends on (GPU name, CUDA
and cuDNN versions, our kernels' source, dtype, B, H, H_kv, T, D, causal, direction), read before timing anything, so
a new run on the same machine takes the choice an earlier one measured. A cache only: a run's choice is its
record's. The file is written atomically; a missing, unreadable or damaged file reads as empty (and is rewritten
on the next choice), never as an error.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

AUTO_RESOLVES_TO = ("ours", "cudnn")  # what "auto" picks between
# "bwd-nondeterministic": a backward allowed cuDNN's faster algorithm (dQ by atomics), a contest of its own;
# "bwd-rope[-nondeterministic]": a backward with RoPE's backward after it (folded into ours, a pass after cuDNN's)
DIRECTIONS = ("fwd", "bwd", "bwd-nondeterministic", "bwd-rope", "bwd-rope-nondeterministic")
_KEY_TEXT = re.compile(r"^(" + "|".join(DIRECTIONS) + r") B=(\d+) H=(\d+)(?: H_kv=(\d+))? T=(\d+) D=(\d+) (\w+) "
                       r"(causal|full)$")


class KernelChoices:
    """What ``kernel="auto"`` resolved to, per call: {(direction, B, H, T, D, dtype name, causal): "ours" |
    "cudnn"}, the key ending in H_kv for grouped K/V heads (H_kv < H; a key with H_kv = H is stored without it, so
    records made before grouped heads ran on our kernels read the same). ``as_dict()`` / ``from_dict()`` give and
    take the JSON form a checkpoint keeps (``"fwd B=16 H=12 T=1024 D=64 bf16 causal": "cudnn"``,
    ``"bwd B=8 H=9 H_kv=3 T=2048 D=64 bf16 causal": "ours"``)."""

    def __init__(self, entries: dict | None = None):
        self._by_key: dict = {}
        for key, choice in (entries or {}).items():
            self.record(key, choice)

    def get(self, key: tuple) -> str | None:
        return self._by_key.get(key)

    def record(self, key: tuple, choice: str):
        direction, B, H, T, D, dtype, causal, *kv = key
        if direction not in DIRECTIONS or choice not in AUTO_RESOLVES_TO:
            raise ValueError(f"a kernel choice is a direction in {DIRECTIONS} and one of {AUTO_RESOLVES_TO}, got "
                             f"{direction!r}: {choice!r}")
        h_kv = int(kv[0]) if len(kv) == 1 and kv[0] is not None else int(H)
        if len(kv) > 1 or h_kv < 1 or int(H) % h_kv:
            raise ValueError(f"a kernel choice's key ends in H_kv, a divisor of H={H}, or nothing; got {key!r}")
        grouped = (h_kv,) if h_kv != int(H) else ()
        self._by_key[(direction, int(B), int(H), int(T), int(D), str(dtype), bool(causal), *grouped)] = choice

    def items(self):
        return self._by_key.items()

    def __len__(self) -> int:
        return len(self._by_key)

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelChoices) and self._by_key == other._by_key

    def __repr__(self) -> str:
        return f"KernelChoices({self.as_dict()})"

    def as_dict(self) -> dict[str, str]:
        """JSON form, sorted: {"fwd B=16 H=12 T=1024 D=64 bf16 causal": "cudnn", ...}."""
        return {f"{d} B={B} H={H}{''.join(f' H_kv={k}' for k in kv)} T={T} D={D} {dt} {'causal' if c else 'full'}":
                choice for (d, B, H, T, D, dt, c, *kv), choice in sorted(self._by_key.items())}

    @classmethod
    def from_dict(cls, d: dict) -> KernelChoices:
        """The record of ``as_dict()``'s form; a key or choice of another form is a ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"kernel choices must be a dict, got {type(d).__name__}")
        out = cls()
        for text, choice in d.items():
            m = _KEY_TEXT.match(str(text))
            if m is None:
                raise ValueError(f"kernel choice key {text!r} is not of the form 'fwd B=16 H=12 T=1024 D=64 bf16 "
                                 "causal'")
            d_, B, H, h_kv, T, D, dt, c = m.groups()
            out.record((d_, B, H, T, D, dt, c == "causal", h_kv), choice)
        return out

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
    return {k: c for k, c in data.items() if isinstance(k, str) and c in AUTO_RESOLVES_TO}


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
