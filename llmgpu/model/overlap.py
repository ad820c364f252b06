"""Work off the critical path on a second stream (chapter 8): the backward's weight and bias gradients.

In a block's backward only the input gradients form a chain (``dx → df → dh₂ → dx' → dy → dqkv → dh₁ →
dx''``); a layer's weight gradient ``dW += dyᵀ x`` and bias gradient ``db += Σ dy`` are read by nobody until
the optimizer. ``SideStream.run(fn, *reads)`` enqueues ``fn`` on a second CUDA stream after everything the
main stream has queued so far (an event: no host wait), so the GPU may run it beside the chain's next
kernels, filling what the chain leaves idle (a GEMM's last partial wave, a memory-bound kernel's spare
compute, a launch gap). Both streams are captured into one CUDA graph as a fork and a join.

What the second stream demands:

* **The buffers it reads outlive its reads.** ``reads`` are kept alive until the main stream has waited
  for the task: the memory pool cannot hand them to a later kernel while the side stream still reads them.
* **No buffer it reads is overwritten early.** The residual gradient ``dx`` is one ``[N, C]`` buffer
  updated in place by each LayerNorm backward; the side stream still reads the old ``dx`` then. With a
  side stream the updates alternate between two buffers (``spare``), and before a buffer is written
  again the main stream waits for the side tasks that read it.
* **Its own cuBLASLt workspace** (``gemm.cublaslt.reserve_workspace``), or two GEMMs would share scratch.
* **A join before anyone reads the gradients** (``join``: the optimizer, a gradient all-reduce).

Each task's kernels and their inputs are the same as in the serial order, so the gradients are the same
bits. On NumPy ``run`` calls ``fn`` at once, and ``spare`` still alternates the buffers (so the CPU tests
walk the same buffer logic).
"""

from __future__ import annotations

import numpy as np


class SideStream:
    """A second stream for work whose results the main stream does not wait for (module docstring)."""

    def __init__(self, xp):
        self.xp = xp
        self.stream = None
        if xp is not np:
            from ..gemm.cublaslt import available, reserve_workspace

            self.stream = xp.cuda.Stream(non_blocking=True)
            if available():
                reserve_workspace(self.stream)
        self._tasks: list = []  # [(event after the task, its reads)], oldest first, not yet waited for
        self._done = 0  # tasks enqueued before _tasks[0]
        self._last_read: dict = {}  # buffer pointer -> index of the last task reading it
        self._spare = None

    def run(self, fn, *reads):
        """``fn()`` on the side stream after the main stream's queued work; ``reads``: arrays ``fn`` reads
        that the main stream allocated (kept alive until waited for)."""
        if self.stream is None:
            fn()
            return
        main = self.xp.cuda.get_current_stream()
        fork = self.xp.cuda.Event(block=False, disable_timing=True)
        fork.record(main)
        self.stream.wait_event(fork)
        with self.stream:
            fn()
        done = self.xp.cuda.Event(block=False, disable_timing=True)
        done.record(self.stream)
        i = self._done + len(self._tasks)
        self._tasks.append((done, reads))
        for a in reads:
            self._last_read[_ptr(a)] = i

    def _wait_through(self, i: int):
        """The main stream waits until task ``i`` (and so every earlier one) has finished."""
        if i < self._done:
            return
        k = i - self._done
        self.xp.cuda.get_current_stream().wait_event(self._tasks[k][0])
        del self._tasks[:k + 1]
        self._done = i + 1
        self._last_read = {p: j for p, j in self._last_read.items() if j > i}

    def before_write(self, a):
        """Make the main stream wait for the side tasks that read ``a`` before it writes ``a``."""
        i = self._last_read.get(_ptr(a))
        if i is not None:
            self._wait_through(i)

    def spare(self, a):
        """A buffer like ``a`` to write ``a``'s update into (``a`` itself becomes the next spare): the two
        alternate, and the returned one is no longer read by the side stream."""
        s = self._spare
        if s is None or s.shape != a.shape or s.dtype != a.dtype:
            s = self.xp.empty_like(a)
        self.before_write(s)
        self._spare = a
        return s

    def wait_until(self, pending: int = 0):
        """Make the main stream wait until at most ``pending`` of the tasks enqueued so far are unfinished
        (the oldest finish first: the side stream runs its tasks in order)."""
        if len(self._tasks) > pending:
            self._wait_through(self._done + len(self._tasks) - pending - 1)

    def join(self):
        """The main stream waits for every task; forget the kept buffers and the spare."""
        self.wait_until(0)
        self._last_read.clear()
        self._spare = None


def _ptr(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else int(a.data.ptr)


__all__ = ["SideStream"]
