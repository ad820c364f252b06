"""Learning-rate schedules, evaluated on the host (a float per step, passed to ``AdamW.step(lr=)``).

``lr_at(step, ...)`` with 0-based ``step``: a linear warmup from ``max_lr/warmup_steps`` to
``max_lr`` over the first ``warmup_steps`` steps, then

* ``"cosine"``: half a cosine from ``max_lr`` down to ``min_lr`` at ``total_steps`` (nanoGPT's),
* ``"linear"``: a straight line from ``max_lr`` down to ``min_lr`` at ``total_steps``,
* ``"constant"``: ``max_lr``,

and ``min_lr`` after ``total_steps`` (cosine and linear).
"""

from __future__ import annotations

import math

KINDS = ("cosine", "linear", "constant")


def lr_at(step: int, *, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
          kind: str = "cosine") -> float:
    """The learning rate of (0-based) step ``step``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or total_steps < 0 or (kind != "constant" and total_steps < warmup_steps):
        raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps}, {total_steps}")
    if max_lr < 0 or min_lr < 0:
        raise ValueError(f"learning rates must be >= 0, got max_lr={max_lr}, min_lr={min_lr}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return max_lr
    if step >= total_steps:
        return min_lr
    span = total_steps - warmup_steps
    frac = (step - warmup_steps) / span if span > 0 else 1.0
    if kind == "linear":
        return max_lr + (min_lr - max_lr) * frac
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (max_lr - min_lr)
