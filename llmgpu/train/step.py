"""THE training step (chapter 7): one object used by the trainer, ``llmgpu bench`` and the chapters.

One optimizer step, in the order the GPU sees it::

    for each micro-batch (gradient accumulation):
        forward: embeddings, n_layer blocks, ln_f, LM head, fused cross-entropy
        backward with the loss gradient seeded by  loss_scale / micro_batches
                 (weight gradients accumulate in fp32 into the flat gradient buffer)
    grad_sync.finish()                                      (one process: nothing; chapter 9: the reduction)
    one launch:  ‖g‖ of the unscaled gradient, clip factor, inf/nan flag       (optim.clip)
    one launch:  AdamW with grad_scale = clip / loss_scale, skipped on inf,
                 writes the bf16/fp16 working copy ("cast back"), zeroes the gradient  (optim.adamw)
    one launch:  loss-scaler update (fp16 only)                                 (amp)

Nothing in the step reads a value on the host: it returns a device array ``[mean loss, gradient norm,
found_inf]`` that the caller fetches when it wants to (``llmgpu train`` every ``log_every`` steps).

``graph=True`` (the chapter 8 model): the first two calls run eagerly (the first compiles kernels, builds
cuBLASLt plans and cuDNN graphs; state some libraries create on a first call and replace on the next is
settled by the second), the third is captured into a CUDA graph, and every call from then on copies its
batches and learning rate into the graph's static inputs and replays it: one launch per step.

**The seam of data-parallel training** is ``grad_sync`` (``LocalGradSync`` here, chapter 9 fills it in):
``grads_ready(names)`` is handed to the model's backward pass on the last micro-batch, so a bucket's
reduction can start as soon as its gradients are final; ``finish(params)`` runs after the backward
pass and before clipping (every reduction issued and ordered before the norm kernel reads the
gradient); ``mean_loss(loss)`` turns the local mean loss into the global one.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..amp import Policy
from ..instrument import region
from ..optim import AdamW, GradClipper
from ..perf.graphs import capture
from .config import TrainConfig

# Eager steps before the capture. With one, the H200 graph step of GPT-2 124M at B=64 held 1.8 GiB more:
# memory still referenced after a first call is only released by the second.
EAGER_WARMUP = 2


class LocalGradSync:
    """The gradient seam of a step on one process: nothing to reduce (see the module docstring).

    ``grad_divisor``: the step seeds the backward pass with 1/(micro-batches × grad_divisor) (data
    parallelism sums the ranks' gradients, so it divides by the world size). A seam with an
    ``apply_update(lr)`` method (ZeRO, ``dist/zero.py``) performs the update itself.
    """

    grad_divisor = 1
    world_size = 1

    def grads_ready(self, names: list[str]):
        """The gradients of ``names`` are final for this step (called during the last backward pass)."""

    def finish(self, params):
        """After the backward pass, before clipping: the gradient in ``params.grad`` is the one to apply."""

    def mean_loss(self, loss):
        """The loss to report: here the local mean."""
        return loss


def apply_update(P, opt, scaler, clipper, grad_clip: float, lr):
    """After the backward pass: unscale + global-norm clip (one fused launch), AdamW with the working-copy
    cast and the gradient zeroed (one launch), loss-scaler update. Returns the ``GradNorm`` result."""
    with region("clip (grad norm)", bytes=P.grad.nbytes, flops=2.0 * P.numel):
        if scaler.enabled:
            res = scaler.check_and_clip(P.grad, grad_clip, out=clipper.result)
        else:
            res = clipper(P.grad)
    with region("adamw", bytes=P.numel * (4 * 4 + 4 * 4 + P.working.dtype.itemsize), flops=15.0 * P.numel):
        opt.step(lr=lr, grad_scale=res.scale, found_inf=res.found_inf, zero_grad=True)
    scaler.update(res.found_inf)
    return res


class TrainStep:
    """Forward + backward over the micro-batches, clip, AdamW (+ cast), scaler update: eager or one CUDA graph.

    ``model``: a ``GPT`` or ``FastGPT``. ``cfg``: the optimizer settings (``beta1``, ``beta2``, ``eps``,
    ``weight_decay``, ``grad_clip``) and ``graph`` of a ``TrainConfig`` (defaults: ``TrainConfig()``'s).
    ``grad_sync``: the data-parallel seam (default ``LocalGradSync()``). ``step(batches, lr)`` takes a list
    of ``(x, y)`` device arrays (one per micro-batch) and the learning rate (a float), and returns the
    device array ``[mean loss, gradient norm (unscaled, before clipping), found_inf]`` without waiting.
    The optimizer (``.opt``), loss scaler (``.scaler``) and clipper (``.clipper``) are its own.
    """

    def __init__(self, model, cfg: TrainConfig | None = None, *, graph: bool | None = None, grad_sync=None):
        cfg = cfg or TrainConfig()
        self.model, self.xp = model, model.xp
        self.params = model.params
        self.opt = AdamW(self.params, lr=cfg.lr or 0.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                         weight_decay=cfg.weight_decay)
        compute = "fp32" if model.dtype == backend.float64 else backend.dtype_name(model.dtype)  # fp64: the reference
        self.scaler = Policy(compute).make_scaler(self.xp)
        self.clipper = GradClipper(cfg.grad_clip, xp=self.xp)
        self.grad_clip = cfg.grad_clip
        self.graph_mode = bool(cfg.graph if graph is None else graph)
        if self.graph_mode and self.xp is np:
            raise ValueError("graph=True needs the GPU (CuPy) backend: CUDA graphs are a GPU feature")
        if self.graph_mode:
            model.check_capturable()  # a ValueError saying why (e.g. FastGPT in fp32), not a failed capture
        self.grad_sync = grad_sync or LocalGradSync()
        self.graph = None  # the captured step (graph mode), after the second call
        self._inputs = self._lr = None
        self._eager_calls = 0

    def __call__(self, batches, lr):
        if not batches:
            raise ValueError("a step needs at least one micro-batch")
        if not self.graph_mode:
            return self._body(batches, lr)
        return self._graph_step(batches, lr)

    def _body(self, batches, lr):
        xp, model, P, sync = self.xp, self.model, self.params, self.grad_sync
        n = len(batches)
        inv = 1.0 / (n * sync.grad_divisor)
        dloss = self.scaler.scale * np.float32(inv) if self.scaler.enabled else inv  # 0-d device array
        loss_sum = None
        every = getattr(sync, "every_micro_batch", False)  # ZeRO-2 reduces every micro-batch's block gradients
        for j, (x, y) in enumerate(batches):
            last = j == n - 1
            if every:
                sync.start_micro_batch(j, n)
            loss = model.forward_backward(x, y, dloss=dloss, grads_ready=sync.grads_ready if last or every else None)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        sync.finish(P)
        if hasattr(sync, "apply_update"):
            res = sync.apply_update(lr)
        else:
            res = apply_update(P, self.opt, self.scaler, self.clipper, self.grad_clip, lr)
        mean = loss_sum if n == 1 else loss_sum * np.float32(1.0 / n)
        mean = sync.mean_loss(mean.astype(np.float32).reshape(()))
        return xp.stack([mean, res.norm, res.found_inf])

    # the state a checkpoint needs, whole, also when the seam shards it (ZeRO)
    def master_weights(self) -> dict:
        """name → NumPy fp32 master weight."""
        f = getattr(self.grad_sync, "master_weights", None)
        return f() if f else self.params.to_dict()

    def optimizer_state(self) -> dict:
        """AdamW's ``state_dict`` (m and v per name, step count, hyperparameters)."""
        f = getattr(self.grad_sync, "optimizer_state", None)
        return f() if f else self.opt.state_dict()

    def weights_finite(self) -> bool:
        """Whether every master weight is finite (one reduction, one host sync)."""
        f = getattr(self.grad_sync, "weights_finite", None)
        return f() if f else bool(self.xp.isfinite(self.params.data).all())

    def _graph_step(self, batches, lr):
        xp = self.xp
        if self._inputs is None:  # static buffers the graph reads: the batches and the learning rate
            self._inputs = xp.empty((len(batches), 2) + tuple(batches[0][0].shape), dtype=np.int32)
            self._lr = xp.empty((), dtype=np.float32)
        gin, glr = self._inputs, self._lr
        if gin.shape[0] != len(batches) or gin.shape[2:] != tuple(batches[0][0].shape):
            raise ValueError(f"a captured step replays fixed shapes: {gin.shape[0]} micro-batches of "
                             f"{tuple(gin.shape[2:])}, got {len(batches)} of {tuple(batches[0][0].shape)}")
        for j, (x, y) in enumerate(batches):
            gin[j, 0] = x
            gin[j, 1] = y
        glr.fill(lr)
        static = [(gin[j, 0], gin[j, 1]) for j in range(len(batches))]
        if self._eager_calls < EAGER_WARMUP:
            self._eager_calls += 1
            return self._body(static, glr)
        if self.graph is None:
            xp.cuda.get_current_stream().synchronize()  # once, before the capture: the eager step's blocks are idle
            xp.get_default_memory_pool().free_all_blocks()  # and go back: the graph allocates from its own pool
            self.graph = capture(lambda: self._body(static, glr), warmup=0)
            self.graph.upload()
        self.graph.replay()
        return self.graph.outputs.copy()  # the graph rewrites its output buffer at every replay


__all__ = ["LocalGradSync", "TrainStep", "apply_update"]
