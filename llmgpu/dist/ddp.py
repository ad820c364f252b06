"""Data parallelism (chapter 9): every rank holds the whole model, the ranks average their gradients.

The gradient lives in one flat fp32 buffer (chapter 4). It is cut into **buckets**, contiguous ranges of
that buffer (``BUCKET_BYTES`` each, cut at multiples of ``FlatParams``' ``multiple``). The backward pass
announces through ``grads_ready(names)`` (``model/base.py``) which gradients are final; a bucket whose
tensors are all final is reduced at once, on a communication stream, while the backward pass goes on with
the layers below. With the buffer's layout (embeddings, then blocks 0..L-1, then the 1-D tensors), the
buckets of the last blocks are ready first, the embeddings' last.

Two streams, ordered by events::

    compute:  ... block L-1 bwd | rec e₁ | block L-2 bwd | rec e₂ | ... | embeddings bwd | rec eₖ | wait f | clip, AdamW
    comm:                         wait e₁ | all-reduce b₁ | wait e₂ | all-reduce b₂ | ...  | all-reduce bₖ | rec f

Each rank scales its loss gradient by 1/(micro-batches × world) (``grad_divisor``) and the buckets are
summed, so the reduced gradient is the gradient of the global batch's mean loss, and the same on every
rank: clipping, the loss scaler's inf check and AdamW then run unchanged, identically everywhere. The
collectives are enqueued from Python in a fixed order (the same on every rank, as NCCL requires) and
never wait on the host, so the whole step, reductions included, still captures as one CUDA graph.

On CPU ranks (MPI) the same bucket becomes a non-blocking ``Iallreduce`` and ``finish`` waits for them.
"""

from __future__ import annotations

import numpy as np

from ..optim.params import ALIGN, FlatParams
from .seam import GradSync

BUCKET_BYTES = 25 * 2**20  # fp32 gradient bytes per bucket (PyTorch DDP's default size)


def plan_buckets(params: FlatParams, bucket_bytes: int = BUCKET_BYTES, multiple: int = ALIGN):
    """The buckets ``[(lo, hi), ...]``: contiguous ranges covering ``[0, params.numel)`` in buffer order, about
    ``bucket_bytes`` of fp32 gradient each, cut after a tensor (its end rounded up to ``multiple``, so a
    cut may fall a few elements into the next tensor) and always at ``decay_end`` (ZeRO keeps the decay
    split a single point); and ``tensors``: for each bucket, the names of the tensors overlapping it.
    ``params.numel`` and ``params.decay_end`` must be multiples of ``multiple`` (FlatParams(multiple=...)).
    """
    n, dend = params.numel, params.decay_end
    if n % multiple or dend % multiple:
        raise ValueError(f"the flat buffer ({n} elements, decay split at {dend}) does not end on multiples of "
                         f"{multiple}: build the model with param_multiple={multiple}")
    target = max(multiple, (bucket_bytes // 4) // multiple * multiple)
    segments = params.segments()
    cuts = {0, n, dend}
    for lo, hi in ((0, dend), (dend, n)):
        pos = lo
        for _, off, size, _ in segments:
            end = -(-(off + size) // multiple) * multiple  # the tensor's end, rounded up to the multiple
            if lo <= off < hi and end - pos >= target and end < hi:
                cuts.add(end)
                pos = end
    edges = sorted(cuts)
    buckets = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    return buckets, tensors_of(params, buckets)


def tensors_of(params: FlatParams, buckets) -> list[list[str]]:
    """For each ``(lo, hi)`` range of the flat buffer, the names of the tensors overlapping it."""
    segments = params.segments()
    return [[name for name, off, size, _ in segments if off < b and off + size > a] for a, b in buckets]


class BucketedReduction(GradSync):
    """The bookkeeping both data-parallel flavours share: which bucket is complete, and launching it.

    ``launch(k, lo, hi)`` (the subclass) issues bucket k's collective on the communication stream (GPU) or
    starts it (MPI). ``grads_ready`` counts the tensors each bucket still waits for; ``finish`` launches
    what is left (in bucket order) and joins the streams.
    """

    def __init__(self, comm, params: FlatParams, bucket_bytes: int = BUCKET_BYTES, multiple: int = ALIGN,
                 buckets=None):
        super().__init__(params)
        self.comm = comm
        self.world_size = comm.world_size
        self.grad_divisor = comm.world_size  # the step scales dloss by 1/(micro-batches × grad_divisor)
        if buckets is None:
            self.buckets, self.tensors = plan_buckets(params, bucket_bytes, multiple)
        else:  # given ranges (ZeRO-2 cuts at the blocks)
            self.buckets = list(buckets)
            self.tensors = tensors_of(params, self.buckets)
        self._of: dict[str, list[int]] = {}
        for k, names in enumerate(self.tensors):
            for nm in names:
                self._of.setdefault(nm, []).append(k)
        self._gpu = self.xp is not np
        if self._gpu:
            cp = self.xp
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._ready_ev = [cp.cuda.Event(block=False, disable_timing=True) for _ in self.buckets]
            self._done_ev = cp.cuda.Event(block=False, disable_timing=True)
        self._works: list = []
        self._reset()

    def _reset(self):
        self._waiting = [len(t) for t in self.tensors]
        self._launched = [False] * len(self.buckets)
        self.launch_order: list[int] = []  # of the last step: the order the collectives were issued in

    def grads_ready(self, names):
        for nm in names:
            for k in self._of.get(nm, ()):
                self._waiting[k] -= 1
                if self._waiting[k] == 0:
                    self._start(k)

    def _start(self, k: int):
        if self._launched[k]:
            return
        self._launched[k] = True
        self.launch_order.append(k)
        lo, hi = self.buckets[k]
        if self._gpu:
            cp = self.xp
            self._ready_ev[k].record(cp.cuda.get_current_stream())
            self.stream.wait_event(self._ready_ev[k])
        self.launch(k, lo, hi)

    def finish(self):
        """Launch the buckets not yet launched (a model that announced nothing: all of them), then make the
        compute stream wait for every collective (GPU) or wait for them (MPI)."""
        for k in range(len(self.buckets)):
            self._start(k)
        if self._gpu:
            cp = self.xp
            self._done_ev.record(self.stream)
            cp.cuda.get_current_stream().wait_event(self._done_ev)
        for w in self._works:
            w.wait()
        self._works.clear()
        order = self.launch_order
        self._reset()
        self.launch_order = order

    def mean_loss(self, loss):
        """The global mean of the ranks' mean losses (every rank's micro-batches count the same)."""
        if self.world_size == 1:
            return loss
        buf = loss.reshape(1).astype(np.float32, copy=True)
        self.comm.all_reduce(buf)  # on the compute stream, after finish joined the comm stream
        return (buf * np.float32(1.0 / self.world_size)).reshape(())

    def launch(self, k, lo, hi):  # pragma: no cover - the subclasses say what a bucket's collective is
        raise NotImplementedError


class DataParallelSync(BucketedReduction):
    """ZeRO stage 0: each bucket is all-reduced in place; every rank then updates the whole model."""

    zero_stage = 0

    def launch(self, k, lo, hi):
        g = self.params.grad[lo:hi]
        if self._gpu:
            self.comm.all_reduce(g, stream=self.stream)
        else:
            self._works.append(self.comm.start_all_reduce(g))


__all__ = ["BUCKET_BYTES", "BucketedReduction", "DataParallelSync", "plan_buckets", "tensors_of"]
