"""Stopping a run on a signal (chapter 7, and chapter 9's ranks): Ctrl-C (SIGINT) and SIGTERM save, then stop.

The first signal only records its number, and the run stops at the next step boundary: a step stopped halfway would
leave a state no checkpoint may hold (the data cursor advanced past its batches, AdamW's moments updated for some
parameters and not others). One process checks the record after every step; it then saves a checkpoint of that
whole step and returns (exit code 130 for SIGINT, 143 for SIGTERM). Several ranks must also stop after the same step
(a rank that saves, a collective under ZeRO, while another is still in a step's reductions would pair the wrong
collectives and hang), so they compare their records at the next log sync (``ranks.agree``, every ``--log-every``
steps) and, if any rank was asked to stop, all stop after that same step, save one checkpoint together and exit
with the signal's code.

A second signal raises ``KeyboardInterrupt`` at once (a step that hangs, or a rank stuck in a collective, can still
be stopped by hand). Raised in the middle of a step, it leaves that step half done: the trainer then saves nothing
and keeps the last checkpoint on disk. On one of several ranks it ends the whole run at once (the command line's
MPI_Abort): the other ranks wait in that step's collectives, and the last checkpoint stays.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's exit code of a process stopped by ``signum`` (128 + its number: 130, 143)."""
    return 128 + int(signum)


class StoppedAtOnce(KeyboardInterrupt):
    """A second signal on one of several ranks: that rank ends the whole run at once (the command line's MPI_Abort),
    and the run keeps the last checkpoint it saved. Its text is the line the command prints."""

    def __init__(self, signum: int, rank: int, step: int, in_step: bool):
        where = f"in step {step + 1}" if in_step else f"after step {step}"
        super().__init__(f"a second {signal.Signals(signum).name} stopped rank {rank} at once {where}, and the run "
                         "with it: it keeps the last checkpoint it saved")


class StopRequests:
    """SIGINT/SIGTERM handlers for the span of a ``with`` block (main thread only; elsewhere nothing is installed).

    ``defer``: record the first signal (``signum``) instead of raising ``KeyboardInterrupt``; the loop reads
    ``requested`` at its step boundaries. ``signum`` is the first signal received (None: none), also when it was
    raised at once. Later signals always raise.
    """

    def __init__(self, defer: bool = True):
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


__all__ = ["SIGNALS", "StopRequests", "StoppedAtOnce", "exit_code"]
