"""Publishing a set of new files at once: made in a stage directory, then moved into place.

``prepare`` (shards and ``prepare.json``) and ``export`` (a Hugging Face directory: weights, ``llmgpu.json``,
``config.json``) make files that are worth something only together, and one of them, the marker, says that the
others are there. Both write into a stage on the same file system as the output, so publishing is renaming: the
files that go away move aside first, the new ones move in with the marker last, and if a move fails (or Ctrl-C
comes) every file moved goes back. A directory with the marker therefore holds the files that came with it.
"""

from __future__ import annotations

import os
from pathlib import Path


def move_in(new: list[Path], out: Path, marker: str, aside: Path, replaced=()):
    """Move the files ``new`` into the directory ``out`` (the one named ``marker`` last), once the files of ``out``
    that go away are moved into ``aside``, a directory that does not exist yet: those named like a new one, and
    ``replaced``. On any failure the files moved in are removed, those moved aside come back, and the error is
    raised; on success the old files are in ``aside``, for the caller to delete."""
    new = sorted(new, key=lambda p: p.name == marker)
    same_name = [out / p.name for p in new if (out / p.name).exists()]
    replaced = list(dict.fromkeys([*same_name, *replaced]))
    aside.mkdir()
    moved, placed = [], []
    try:
        for p in replaced:
            os.replace(p, aside / p.name)
            moved.append(p)
        for p in new:
            os.replace(p, out / p.name)
            placed.append(out / p.name)
    except BaseException:
        for p in placed:
            p.unlink(missing_ok=True)
        for p in moved:
            os.replace(aside / p.name, p)
        raise


__all__ = ["move_in"]
