"""Stopping a run on a signal (chapter 7, and chapter 9's ranks): Ctrl-C (SIGINT) and SIGTERM save, then stop.

One process stops at once: the first signal raises ``KeyboardInterrupt`` wherever the loop is, and the trainer
writes a checkpoint of the last whole step and returns (exit code 130 for SIGINT, 143 for SIGTERM).

Several ranks cannot stop "wherever they are": a rank that saves (a collective, under ZeRO) while another is
still in a step's reductions would pair the wrong collectives and hang. So in a run of several ranks the first
signal only records its number; the ranks compare their records at the next log sync (``ranks.agree``, every
``--log-every`` steps) and, if any rank was asked to stop, all stop after that same step, save one checkpoint
together and exit with the signal's code. A second signal raises ``KeyboardInterrupt`` at once (a rank stuck in a
collective can still be stopped by hand).
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's exit code of a process stopped by ``signum`` (128 + its number: 130, 143)."""
    return 128 + int(signum)


class StopRequests:
    """SIGINT/SIGTERM handlers for the span of a ``with`` block (main thread only; elsewhere nothing is installed).

    ``defer``: record the first signal (``signum``) instead of raising ``KeyboardInterrupt`` (several ranks).
    ``signum`` is the first signal received (None: none), also when it was raised at once.
    """

    def __init__(self, defer: bool = False):
        self.defer, self.signum, self._old = defer, None, {}

    def _handle(self, signum, frame):
        first = self.signum is None
        if first:
            self.signum = signum
        if not (self.defer and first):
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        return False

    @property
    def requested(self) -> bool:
        return self.signum is not None


__all__ = ["SIGNALS", "StopRequests", "exit_code"]
