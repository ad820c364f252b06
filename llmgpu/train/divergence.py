"""When a run must stop (chapter 7): a loss that is no longer a number, or too many skipped steps in a row.

The trainer reads each step's ``[loss, grad_norm, found_inf]`` at its log syncs and hands them here, one
step at a time. With loss scaling (fp16) an inf/nan gradient is expected now and then: the scaler skips the
step and lowers the scale; only a long streak of skips means the run is lost. Without it, a non-finite loss
means the weights that produced it are already broken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RunHealth:
    """The run's record of skipped steps (``skipped`` in all, ``streak`` in a row) and its first ``failure``,
    ``(reason, message)``: 'diverged' (a non-finite loss without loss scaling) or 'skipped' (``max_skipped``
    skipped steps in a row; 0 = never)."""

    skipped: int = 0
    streak: int = 0
    failure: tuple[str, str] | None = None

    def check(self, step: int, loss: float, skipped: bool, *, loss_scaled: bool, max_skipped: int, synced: int):
        """Count one step; record the first failure. ``synced``: the step whose log sync reads this one's record
        (the run stops there, so its summary's ``steps`` is that one; the message says why they differ)."""
        self.skipped += skipped
        self.streak = self.streak + 1 if skipped else 0
        if self.failure:
            return
        stopped = (f" (seen at the log sync of step {synced}, where the run stopped; --log-every sets how often it "
                   "looks)") if synced > step else ""
        if not math.isfinite(loss) and not loss_scaled:
            self.failure = ("diverged", f"the loss is {loss} at step {step}: the run diverged{stopped}")
        elif max_skipped and self.streak >= max_skipped:
            self.failure = ("skipped", f"{self.streak} steps in a row (up to step {step}) were skipped for inf/nan "
                            f"gradients (--max-skipped-steps {max_skipped}): the run diverged{stopped}")


__all__ = ["RunHealth"]
