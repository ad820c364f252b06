"""A run's output directory: where it is, what may be replaced, and the log a resumed run continues.

A run directory holds ``log.jsonl``, ``config.json`` (the effective configuration and what was adjusted),
``checkpoint/``, ``summary.json``, ``loss.png`` and ``samples.txt``. A new run never writes over another
one silently (``--overwrite`` replaces it); ``--resume DIR`` continues in DIR, with the log cut back to
the checkpoint's step so steps done after the last save (a killed run) are not counted twice.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .checkpoint import find_checkpoint, json_default
from .config import ConfigError

RUN_FILES = ("log.jsonl", "config.json", "summary.json", "loss.png", "samples.txt", "checkpoint", "checkpoint.tmp",
             "checkpoint.old")
CHECKPOINT_NAMES = ("checkpoint", "checkpoint.old")


def default_out_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def run_dir_of(resume) -> Path | None:
    """The run directory a ``--resume`` path belongs to (the directory holding its ``checkpoint/``), or None
    for a checkpoint directory not named ``checkpoint``, outside any run."""
    ckpt = find_checkpoint(resume)
    return ckpt.parent if ckpt.name in CHECKPOINT_NAMES else None


def resume_target(resume, out) -> tuple[Path, bool, Path | None]:
    """(where a resumed run writes, whether that is a new directory, the run directory it comes from).

    By default the run continues where its checkpoint is; ``--out`` elsewhere starts a new run directory
    with the log up to the checkpoint (a checkpoint outside any run directory needs one)."""
    src = run_dir_of(resume)
    if out is None and src is None:
        raise ConfigError(f"{find_checkpoint(resume)} is a checkpoint outside a run directory: give --out DIR for "
                          "the continued run")
    out = Path(out) if out else src
    forked = src is None or out.resolve() != src.resolve()
    return out, forked, src if forked else None


def holds_run(out: Path) -> bool:
    return out.is_dir() and any((out / f).exists() for f in RUN_FILES)


def check_out(out: Path, overwrite: bool):
    """A ConfigError unless a new run may write to ``out``: not a file, not another run (without --overwrite)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if holds_run(out) and not overwrite:
        raise ConfigError(f"--out {out} already holds a run: continue it with --resume {out}, or give --overwrite "
                          "to replace it")


def clear_run(out: Path):
    """Remove a previous run's files from ``out`` (--overwrite); other files stay."""
    for name in RUN_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def open_run_dir(out: Path, overwrite: bool, resumed: bool, forked: bool, fork_from: Path | None, step: int) -> list:
    """Make ``out`` ready for this session: a new run's directory checked (again: it may have filled since the
    set-up) and cleared with ``overwrite``; a resumed run's log cut back to its checkpoint's ``step`` (from the
    run it forked from, resumed elsewhere). Returns the log records kept from before this session."""
    log_path = out / "log.jsonl"
    if not resumed or forked:
        check_out(out, overwrite)
        if out.is_dir() and overwrite:
            clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if resumed:  # the log up to the checkpoint: steps done after it are done again now
        src = (fork_from / "log.jsonl") if forked and fork_from else log_path
        return continue_log(src, log_path, step)
    if log_path.exists():
        log_path.unlink()
    return []


def continue_log(src: Path, dst: Path, step: int) -> list[dict]:
    """Write to ``dst`` the records of the log ``src`` up to ``step`` (the checkpoint's), and return them: what
    a resumed run appends to. Records after it are of steps the run does again; a torn last line is dropped."""
    keep = []
    if src.is_file():
        for line in src.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("step", rec.get("steps", 0)) <= step:
                keep.append((line, rec))
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line, _ in keep))
    os.replace(tmp, dst)
    return [rec for _, rec in keep]


def write_config(out: Path, record: dict):
    """``config.json``: the effective configuration of the run (after defaults and adjustments)."""
    (out / "config.json").write_text(json.dumps(record, indent=1, default=json_default) + "\n")


__all__ = ["RUN_FILES", "check_out", "clear_run", "continue_log", "default_out_dir", "holds_run", "resume_target",
           "run_dir_of", "write_config"]
