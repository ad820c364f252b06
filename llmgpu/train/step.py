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

**The seam of data-parallel training** is ``grad_sync``, a ``llmgpu.dist.GradSync`` (``dist/seam.py`` lists its
members; ``LocalGradSync`` here, chapter 9's ``DataParallelSync`` and ``ZeroSync`` fill it in). The step builds its
optimizer through the seam (``bind_optimizer``: ZeRO builds it over its shard), hands ``grads_ready`` to the
model's backward pass (on the last micro-batch, or on every one when the seam asks), calls ``finish()`` after the
backward pass and ``apply_update(lr, scaler, clipper)`` after that, and reports ``mean_loss``. The seam also gives
the whole state a checkpoint needs (``master_weights``, ``optimizer_state``, ``load_optimizer_state``,
``weights_finite``).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .. import backend
from ..amp import Policy
from ..dist.seam import LocalGradSync, apply_update, check_seam
from ..optim import AdamW, GradClipper
from ..perf.graphs import capture
from .config import TrainConfig

# Eager steps before the capture. With one, the H200 graph step of GPT-2 124M at B=64 held 1.8 GiB more:
# memory still referenced after a first call is only released by the second.
EAGER_WARMUP = 2


def make_adamw(cfg: TrainConfig):
    """The optimizer a step builds (through its seam) over the parameters it updates: AdamW with ``cfg``'s
    hyperparameters."""
    return partial(AdamW, lr=cfg.lr or 0.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


class TrainStep:
    """Forward + backward over the micro-batches, clip, AdamW (+ cast), scaler update: eager or one CUDA graph.

    ``model``: a ``GPT`` or ``FastGPT``. ``cfg``: the optimizer settings (``lr``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay``, ``grad_clip``) and ``graph`` of a ``TrainConfig`` (defaults: ``TrainConfig()``'s).
    ``grad_sync``: the data-parallel seam, a ``GradSync`` over ``model.params`` (default ``LocalGradSync``); the
    step builds its optimizer through it. ``step(batches, lr)`` takes a list of ``(x, y)`` device arrays (one per
    micro-batch) and the learning rate (a float), and returns the device array ``[mean loss, gradient norm
    (unscaled, before clipping), found_inf]`` without waiting. The optimizer (``.opt``, the seam's), loss scaler
    (``.scaler``) and clipper (``.clipper``) serve this step alone.
    """

    def __init__(self, model, cfg: TrainConfig | None = None, *, graph: bool | None = None, grad_sync=None):
        cfg = cfg or TrainConfig()
        self.model, self.xp = model, model.xp
        self.params = model.params
        self.grad_sync = grad_sync if grad_sync is not None else LocalGradSync(self.params)
        check_seam(self.grad_sync, self.params)
        self.opt = self.grad_sync.bind_optimizer(make_adamw(cfg))
        compute = "fp32" if model.dtype == backend.float64 else backend.dtype_name(model.dtype)  # fp64: the reference
        self.scaler = Policy(compute).make_scaler(self.xp)
        self.clipper = GradClipper(cfg.grad_clip, xp=self.xp)
        self.graph_mode = bool(cfg.graph if graph is None else graph)
        if self.graph_mode and self.xp is np:
            raise ValueError("graph=True needs the GPU (CuPy) backend: CUDA graphs are a GPU feature")
        if self.graph_mode:
            model.check_capturable()  # a ValueError saying why (e.g. FastGPT in fp32), not a failed capture
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
        xp, model, sync = self.xp, self.model, self.grad_sync
        n = len(batches)
        inv = 1.0 / (n * sync.grad_divisor)
        dloss = self.scaler.scale * np.float32(inv) if self.scaler.enabled else inv  # 0-d device array
        loss_sum = None
        for j, (x, y) in enumerate(batches):
            announce = j == n - 1 or sync.every_micro_batch  # ZeRO-2 reduces every micro-batch's block gradients
            sync.start_micro_batch(j, n)
            loss = model.forward_backward(x, y, dloss=dloss, grads_ready=sync.grads_ready if announce else None)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        sync.finish()
        res = sync.apply_update(lr, self.scaler, self.clipper)
        mean = loss_sum if n == 1 else loss_sum * np.float32(1.0 / n)
        mean = sync.mean_loss(mean.astype(np.float32).reshape(()))
        return xp.stack([mean, res.norm, res.found_inf])

    # the state a checkpoint needs, whole, also when the seam shards it (ZeRO)
    def master_weights(self) -> dict:
        """name → NumPy fp32 master weight."""
        return self.grad_sync.master_weights()

    def optimizer_state(self) -> dict:
        """AdamW's ``state_dict`` (m and v per name, step count, hyperparameters)."""
        return self.grad_sync.optimizer_state()

    def load_optimizer_state(self, state: dict):
        """Restore what ``optimizer_state`` gave (on any world size and ZeRO stage)."""
        self.grad_sync.load_optimizer_state(state)

    def weights_finite(self) -> bool:
        """Whether every master weight is finite (one reduction, one host sync)."""
        return self.grad_sync.weights_finite()

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


__all__ = ["EAGER_WARMUP", "LocalGradSync", "TrainStep", "apply_update", "make_adamw"]
