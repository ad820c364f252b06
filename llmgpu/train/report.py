"""What a run shows and keeps: the progress line, and the JSON-lines log read back (chapter 7).

The loss-curve plot of a log is ``llmgpu.plotting.plot_losses(read_log(run_dir))``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class Progress:
    """One status line (redrawn in place on a terminal, printed per log interval otherwise)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._len = 0

    def update(self, step: int, *, loss=None, val=None, lr=None, tok_s=None, mfu=None, elapsed=None, eta=None,
               skipped=0):
        if not self.enabled:
            return
        frac = min(step / self.total, 1.0) if self.total else 0.0
        width = 20
        fill = int(round(frac * width))
        parts = [f"[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total or '?'}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if val is not None:
            parts.append(f"val {val:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if tok_s is not None:
            parts.append(f"{_si(tok_s)} tok/s")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        if skipped:
            parts.append(f"skipped {skipped}")  # steps whose inf/nan gradients were not applied
        if elapsed is not None:
            parts.append(f"{_hms(elapsed)}" + (f"<{_hms(eta)}" if eta is not None else ""))
        line = " | ".join(parts)
        if self.tty:
            pad = max(0, self._len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str):
        if not self.enabled:
            return
        if self.tty and self._len:
            self.stream.write("\n")
            self._len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def warn(self, text: str):
        """A line printed even when progress output is off (what the user must not miss)."""
        enabled, self.enabled = self.enabled, True
        try:
            self.message(text)
        finally:
            self.enabled = enabled

    def close(self):
        if self.enabled and self.tty and self._len:
            self.stream.write("\n")
            self.stream.flush()
            self._len = 0


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def read_log(path) -> list[dict]:
    """The records of a JSON-lines training log."""
    p = Path(path)
    if p.is_dir():
        p = p / "log.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


__all__ = ["Progress", "read_log"]
