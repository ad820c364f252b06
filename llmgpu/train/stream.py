"""Batches on their way to the GPU (chapter 7): pinned host buffers, a side stream, events.

``GPUPrefetcher`` copies batch i+1 while step i runs; ``DataStream`` is what the trainer reads from (the
prefetcher on CuPy, plain host arrays on NumPy), with a checkpointable position. Both take a
``BatchLoader`` (``train/data.py``).
"""

from __future__ import annotations

import numpy as np

from .. import backend


class GPUPrefetcher:
    """Host → device copies of the next batch from pinned memory, on a side stream.

    ``next()`` makes the compute (current) stream wait for batch i's copy event, then starts copying
    batch i+1 while the caller enqueues step i. A ring of three slots keeps a slot from being
    overwritten while a step that reads it may still be running: before slot s is refilled, the side
    stream waits for the event recorded on the compute stream after slot s's batch was consumed.
    The only host wait is on a *copy* that finished long ago (pinned-buffer reuse), never on compute.
    """

    SLOTS = 3

    def __init__(self, loader, cp=None):
        self.cp = cp or backend.require_gpu()
        cp = self.cp
        import cupyx

        self.loader = loader
        shape = (2, loader.batch, loader.seq)
        self.stream = cp.cuda.Stream(non_blocking=True)  # does not serialize with the legacy null stream
        self.host = [cupyx.empty_pinned(shape, dtype=np.int32) for _ in range(self.SLOTS)]
        self.dev = [cp.empty(shape, dtype=np.int32) for _ in range(self.SLOTS)]
        self.copied = [None] * self.SLOTS
        self.released = [None] * self.SLOTS
        self._next_slot = 0
        self._pending = None  # (slot, loader state *before* that batch)
        self._current = None

    def _stage(self):
        s = self._next_slot
        self._next_slot = (s + 1) % self.SLOTS
        if self.copied[s] is not None:
            self.copied[s].synchronize()  # the pinned buffer's previous copy (finished long ago)
        state_before = self.loader.state_dict()
        self.loader.next_host(out=self.host[s])
        if self.released[s] is not None:
            self.stream.wait_event(self.released[s])
        self.dev[s].set(self.host[s], stream=self.stream)
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        self.copied[s] = ev
        self._pending = (s, state_before)

    def next(self):
        """(x, y) on the device, ready to use on the current stream; batch i+1 starts copying."""
        cp = self.cp
        compute = cp.cuda.get_current_stream()
        if self._current is not None:
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(compute)
            self.released[self._current] = ev
        if self._pending is None:
            self._stage()
        s, _ = self._pending
        compute.wait_event(self.copied[s])
        self._current = s
        self._stage()  # the next batch, overlapping the step the caller is about to enqueue
        return self.dev[s][0], self.dev[s][1]

    def position(self) -> dict:
        """The loader position after the batches handed out so far (prefetched ones not counted)."""
        if self._pending is None:
            return self.loader.state_dict()
        return self._pending[1]

    def load_position(self, state: dict):
        self.loader.load_state_dict(state)
        self._pending = None


class DataStream:
    """What the trainer uses: ``next()`` → ``(x, y)`` on the model's backend, and a checkpointable position.

    On NumPy it returns host arrays. On CuPy it uses ``GPUPrefetcher`` (``async_copy=True``) or a
    plain synchronous copy (``async_copy=False``, for comparison).
    """

    def __init__(self, loader, xp=np, *, async_copy: bool = True):
        self.loader, self.xp = loader, xp
        self._pf = GPUPrefetcher(loader, xp) if (xp is not np and async_copy) else None

    def next(self):
        if self._pf is not None:
            return self._pf.next()
        b = self.loader.next_host()
        if self.xp is np:
            return b[0], b[1]
        d = self.xp.asarray(b)
        return d[0], d[1]

    def state_dict(self) -> dict:
        return self._pf.position() if self._pf is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict):
        if self._pf is not None:
            self._pf.load_position(state)
        else:
            self.loader.load_state_dict(state)
