"""When a run must stop (chapter 7): a loss that is no longer a number, or too many skipped steps in a row.

The trainer reads each step's ``[loss, grad_norm, found_inf]`` at its log syncs and hands them here, one
step at a time. With loss scaling (fp16) an inf/nan gradient is expected now and then: the scaler skips the
step and lowers the scale; only a long streak of skips means the run is lost. Without it, a non-finite loss
means the weights that produced it are already broken.
"""

from __future__ import annotations

import math


def check_step(state: dict, step: int, loss: float, skipped: bool, *, loss_scaled: bool, max_skipped: int):
    """Count a skipped step in ``state`` (``skipped``, ``streak``); record the first failure in
    ``state["failure"]`` as ``(reason, message)``: 'diverged' (a non-finite loss without loss scaling) or
    'skipped' (``max_skipped`` skipped steps in a row; 0 = never)."""
    state["skipped"] += skipped
    state["streak"] = state["streak"] + 1 if skipped else 0
    if state["failure"]:
        return
    if not math.isfinite(loss) and not loss_scaled:
        state["failure"] = ("diverged", f"the loss is {loss} at step {step}: the run diverged")
    elif max_skipped and state["streak"] >= max_skipped:
        state["failure"] = ("skipped", f"{state['streak']} steps in a row (up to step {step}) were skipped for "
                            f"inf/nan gradients (--max-skipped-steps {max_skipped}): the run diverged")


__all__ = ["check_step"]
