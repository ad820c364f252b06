"""The gradient seam of the training step: where one process's step ends and data parallelism begins.

``TrainStep`` (``train/step.py``, chapter 7) runs forward and backward over its micro-batches and then hands the
flat gradient to a ``GradSync``, which reduces it over the ranks (or not) and applies the update. Every member of
the seam, with what a run of one process does:

==========================  ==================================================================================
member                      one process (``LocalGradSync``); data parallelism and ZeRO override what differs
==========================  ==================================================================================
``world_size``              1
``grad_divisor``            1: the step seeds the backward pass with 1/(micro-batches × grad_divisor)
``zero_stage``              0
``every_micro_batch``       False: the step announces gradients (``grads_ready``) on the last micro-batch only
``bind_optimizer(make)``    builds the optimizer over the parameters this rank updates (ZeRO: its shard)
``start_micro_batch(j, n)`` nothing
``grads_ready(names)``      nothing (a bucket whose gradients are final starts its reduction)
``finish()``                nothing (after the backward pass: every reduction issued and ordered)
``apply_update(lr, s, c)``  clip by the global norm, AdamW (+ the working-copy cast), loss-scaler update
``mean_loss(loss)``         the local mean loss (the ranks' mean)
``master_weights()``        name → fp32 master weight, whole (a checkpoint's)
``optimizer_state()``       AdamW's ``state_dict``, whole
``load_optimizer_state(s)`` AdamW's ``load_state_dict`` (ZeRO keeps its pieces of the whole state)
``weights_finite()``        whether every master weight is finite
==========================  ==================================================================================

The seam owns the optimizer: it is built through the seam (``bind_optimizer``), so ZeRO builds AdamW over its
shard only and no rank ever allocates the whole optimizer state (``FlatParams`` allocates the moments only when an
optimizer asks for them).
"""

from __future__ import annotations

from ..instrument import region


def apply_update(P, opt, scaler, clipper, lr):
    """After the backward pass: unscale + global-norm clip (one fused launch), AdamW with the working-copy
    cast and the gradient zeroed (one launch), loss-scaler update. Returns the ``GradNorm`` result."""
    with region("clip (grad norm)", bytes=P.grad.nbytes, flops=2.0 * P.numel):
        if scaler.enabled:
            res = scaler.check_and_clip(P.grad, clipper.max_norm, out=clipper.result)
        else:
            res = clipper(P.grad)
    with region("adamw", bytes=P.numel * (4 * 4 + 4 * 4 + P.working.dtype.itemsize), flops=15.0 * P.numel):
        opt.step(lr=lr, grad_scale=res.scale, found_inf=res.found_inf, zero_grad=True)
    scaler.update(res.found_inf)
    return res


class GradSync:
    """The seam's interface, every member with its one-process default (see the module docstring).

    ``params``: the model's ``FlatParams``. ``opt`` is None until ``bind_optimizer`` (``TrainStep`` calls it once).
    """

    world_size = 1
    grad_divisor = 1
    zero_stage = 0
    every_micro_batch = False

    def __init__(self, params):
        self.params, self.xp = params, params.xp
        self.opt = None

    def __repr__(self):
        return f"{type(self).__name__}(world size {self.world_size}, ZeRO stage {self.zero_stage})"

    # ------------------------------------------------------------------ set-up

    def bind_optimizer(self, make_optimizer):
        """Build the optimizer (``make_optimizer(flat_params)``, e.g. a partial ``AdamW``) over the parameters
        this rank updates; once per seam (a seam serves one step)."""
        if self.opt is not None:
            raise ValueError(f"{self!r} already has an optimizer: a seam serves one TrainStep")
        self.opt = make_optimizer(self.params)
        return self.opt

    # ------------------------------------------------------------------ during the step

    def start_micro_batch(self, j: int, n: int):
        """Micro-batch j of n begins (heard only when ``every_micro_batch``)."""

    def grads_ready(self, names):
        """The gradients of ``names`` are final for this step (the model's backward pass calls it)."""

    def finish(self):
        """After the backward pass, before clipping: the gradient the update reads is complete."""

    def apply_update(self, lr, scaler, clipper):
        """Clip, AdamW, loss-scaler update (``apply_update``); returns the ``GradNorm`` (norm, scale, found_inf)."""
        return apply_update(self.params, self.opt, scaler, clipper, lr)

    def mean_loss(self, loss):
        """The loss to report: the mean over every rank's micro-batches."""
        return loss

    # ------------------------------------------------------------------ the whole state (checkpoints)

    def master_weights(self) -> dict:
        """name → NumPy fp32 master weight."""
        return self.params.to_dict()

    def optimizer_state(self) -> dict:
        """AdamW's ``state_dict`` (m and v per name, step count, hyperparameters)."""
        return self.opt.state_dict()

    def load_optimizer_state(self, state: dict):
        """Restore a ``state_dict`` written by ``optimizer_state`` (on any world size)."""
        self.opt.load_state_dict(state)

    def weights_finite(self) -> bool:
        """Whether every master weight is finite (one reduction, one host sync)."""
        return bool(self.xp.isfinite(self.params.data).all())


class LocalGradSync(GradSync):
    """The seam of a step on one process: nothing to reduce; every member is ``GradSync``'s default."""


def check_seam(sync, params) -> None:
    """A ``TrainStep``'s seam must be a ``GradSync`` over the model's own parameters."""
    if not isinstance(sync, GradSync):
        raise TypeError(f"grad_sync must be a llmgpu.dist.GradSync (LocalGradSync, DataParallelSync, ZeroSync), "
                        f"got {type(sync).__name__}")
    if sync.params is not params:
        raise ValueError("grad_sync was built over other parameters than the model's (build it over model.params)")


__all__ = ["GradSync", "LocalGradSync", "apply_update", "check_seam"]
