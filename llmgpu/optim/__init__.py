"""Chapter 4: the optimizer step. Flat parameter buffers, fused AdamW, global-norm clipping, LR schedules.

* ``FlatParams``: every weight, gradient and moment in one contiguous buffer each (``params.py``).
* ``adamw_update(param, grad, m, v, *, step, lr, ...)``: one tensor, in place (the package's stable API).
* ``AdamW(flat_params, ...)``: the whole model in one kernel launch (``per_tensor=True``: one per
  tensor, the baseline).
* ``global_grad_norm`` / ``clip_coefficient`` / ``clip_scale`` / ``grad_norm_fused`` / ``GradClipper``: the
  global L2 norm and the clip factor as device scalars, no host sync.
* ``lr_at``: warmup + cosine/linear/constant schedule (host side).
"""

from .adamw import AdamW, adamw_update
from .clip import GradClipper, GradNorm, clip_coefficient, clip_scale, global_grad_norm, grad_norm_fused
from .params import FlatParams
from .schedule import lr_at

__all__ = ["AdamW", "FlatParams", "GradClipper", "GradNorm", "adamw_update", "clip_coefficient", "clip_scale",
           "global_grad_norm", "grad_norm_fused", "lr_at"]
