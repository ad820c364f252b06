"""One call of ``Trainer.run`` (chapter 7): where it writes, its JSON-lines log and progress line, and what the
loop has seen so far. The trainer's loop reads and updates it; nothing here runs the model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .divergence import RunHealth
from .report import Progress
from .stop import StopRequests


@dataclass
class Session:
    """One call of ``Trainer.run``: where it writes, its log and progress line, and what the loop has seen."""

    out: Path
    log: Log
    bar: Progress
    health: RunHealth
    refit: bool  # a time-bounded run fits its schedule to the clock; a resumed one keeps the saved schedule
    kept: list = field(default_factory=list)  # the log records from before this session (a resumed run's)
    pending: list = field(default_factory=list)  # (step, lr, device record) since the last sync
    stop_reason: str = "steps"
    stop: StopRequests | None = None  # the signals received (stop.py)
    signal: int | None = None  # the signal that stopped the run
    first_val: float | None = None
    last_val: float | None = None
    last_val_step: int | None = None  # the step last_val was measured after
    last_loss: float | None = None
    ceiling: float | None = None
    t0: float = 0.0
    t_last: float = 0.0
    probe_start: float = 0.0
    steps_last: int = 0


def strict_json(obj):
    """``obj`` with every inf/nan float as None: NaN is not JSON (Python writes it, JavaScript and Go refuse it, jq
    turns it into null), and a diverged run's loss is NaN. ``report.read_log`` reads the numbers back as NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


class Log:
    """The JSON-lines log (rank 0's; the other ranks write nothing), strict JSON (``strict_json``)."""

    def __init__(self, path: Path | None):
        self.f = open(path, "a") if path is not None else None

    def __call__(self, rec: dict):
        if self.f is not None:
            self.f.write(json.dumps(strict_json(rec), allow_nan=False) + "\n")
            self.f.flush()

    def close(self):
        if self.f is not None:
            self.f.close()


__all__ = ["Log", "Session", "strict_json"]
