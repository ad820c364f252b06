"""A run's output directory: where it is, what may be replaced, and the log a resumed run continues.

A run directory holds ``log.jsonl``, ``config.json`` (the effective configuration and what was adjusted),
``checkpoint/``, ``summary.json``, ``loss.png`` and ``samples.txt``. A new run never writes over another
one silently (``--overwrite`` replaces it); ``--resume DIR`` continues in DIR, with the log cut back to
the checkpoint's step so steps done after the last save (a killed run) are not counted twice.

One process writes a run directory at a time: ``run_lock`` holds ``run.lock`` in it (the owner's pid, host
and command) and refuses a second writer; a lock left by a process that died is taken over with a note.
A resumed run with no step left to do leaves its ``summary.json`` as it is (``finished_summary``), and a
resumed run's summary takes what its own session did not measure from the log (``with_log_figures``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the lock is not taken there (see run_lock)
    fcntl = None

from .checkpoint import CheckpointError, find_checkpoint, json_default
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


def check_parents(out: Path, flag: str):
    """A ConfigError when the nearest folder above ``out`` that exists is a file (the folders below it are made)."""
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"{flag} {out}: {above} is a file, not a directory; give another path")


def check_out(out: Path, overwrite: bool):
    """A ConfigError unless a new run may write to ``out``: not a file, not another run (without --overwrite)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    check_parents(out, "--out")
    if holds_run(out) and not overwrite:
        try:
            find_checkpoint(out)
        except CheckpointError:  # --resume would find nothing to continue
            raise ConfigError(f"--out {out} already holds a run that saved no checkpoint: give --overwrite to "
                              "replace it, or another --out") from None
        raise ConfigError(f"--out {out} already holds a run: continue it with --resume {out}, or give --overwrite "
                          "to replace it")


def check_target(out: Path, overwrite: bool, new: bool):
    """What the set-up of a run checks of the directory it will write (rank 0 only): no other process writes it
    (``refuse_if_in_use``), and a ``new`` one (a new run's, or a resumed run's elsewhere) is no other run
    (``check_out``)."""
    refuse_if_in_use(out)
    if new:
        check_out(out, overwrite)


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


# --------------------------------------------------------------------------- one writer at a time

LOCK_FILE = "run.lock"  # in a run directory while a process writes it; not a run file (holds_run ignores it)


@contextmanager
def run_lock(out: Path, notes: list | None = None, *, enabled: bool = True):
    """Hold the lock of the run directory ``out`` (created if need be) while the block runs.

    The lock is an advisory ``flock`` on ``out/run.lock``, a file that names its owner (pid, host, start,
    command): a second process is refused with a ConfigError naming the owner. The kernel releases a lock when
    its process ends, however it ends, so a ``run.lock`` found unlocked was left by a process that died (a
    SIGKILL): it is taken over with a note, appended to ``notes`` and printed. ``enabled=False`` (the ranks
    other than 0, which never write the directory): nothing. Without ``fcntl`` (Windows) nothing is locked."""
    if not enabled or fcntl is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = _lock_file(path)
    try:
        left = _owner(fd)
        if left:
            text = f"took over {path}: the process that held it ({_describe(left)}) ended without releasing it"
            print(f"llmgpu: note: {text}", file=sys.stderr)
            if notes is not None:
                notes.append(text)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        yield
    finally:
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)  # before the lock goes: a waiting process then makes a fresh file
        except FileNotFoundError:
            pass
        os.close(fd)


def _lock_file(path: Path) -> int:
    """A descriptor of ``path`` holding its flock; a ConfigError when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise _in_use(path, _describe(owner)) from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # its owner removed the file between our open and our lock: take the new one


def refuse_if_in_use(out: Path):
    """A ConfigError when another process holds ``out``'s lock: what the set-up of a run checks, so that the
    refusal comes before its notes and its work (``run_lock`` takes the lock itself when the run starts)."""
    who = writer(out)
    if who:
        raise _in_use(out / LOCK_FILE, who)


def writer(out: Path) -> str | None:
    """The other process that writes the run directory ``out`` (pid, host, start, command, as its lock file says),
    or None: no process holds the lock, or this one does (its own run: ``run_lock`` decides)."""
    path = out / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # only probing: closing the descriptor drops it
        return None
    except BlockingIOError:
        owner = _owner(fd)
        return None if (owner or {}).get("pid") == os.getpid() else _describe(owner)
    finally:
        os.close(fd)


def _in_use(path: Path, who: str) -> ConfigError:
    return ConfigError(f"{path.parent} is being written by another llmgpu process ({who}): two "
                       "processes cannot write one run directory; wait for it to end, or stop it")


def _owner(fd: int) -> dict | None:
    """What a lock file says of its owner ({} for an unreadable one), None for an empty file."""
    raw = os.pread(fd, 65536, 0)
    if not raw.strip():
        return None
    try:
        owner = json.loads(raw)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict | None) -> str:
    if not owner:
        return "unknown process"
    return (f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} since {owner.get('since', '?')}"
            + (f": {owner['command']}" if owner.get("command") else ""))


# --------------------------------------------------------------------------- the summary of a resumed run

FINAL_STOPS = ("steps", "max_time")  # a summary.json of a run that ended (not interrupted, not stopped early)


def finished_summary(out: Path, step: int, total_steps: int | None, resume) -> dict | None:
    """The summary of a resumed run (``resume``: its ``--resume``, None for a new run) with no step left to do
    (``step >= total_steps``): its ``summary.json``, left as it is, with a note (printed) saying so. None when
    there are steps to do, or when ``summary.json`` is not that of the run ended at ``step`` (the run was stopped
    between its last checkpoint and its summary: it finishes now, without training, ``with_log_figures``
    filling its summary)."""
    if not resume or total_steps is None or step < total_steps:
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != step or summary.get("stop_reason") not in FINAL_STOPS:
        return None
    how = f"has done its {step} steps" if step == total_steps else f"is at step {step}, past --steps {total_steps}"
    text = (f"the run in {out} {how}: nothing to train; its summary.json stays as it is (--steps N with N > {step} "
            "trains it further)")
    print(f"llmgpu: note: {text}", file=sys.stderr)
    notes = summary.get("notes") if isinstance(summary.get("notes"), list) else []
    return {**{k: v for k, v in summary.items() if k != "sample"}, "notes": [*notes, text]}


def with_log_figures(kept: list[dict], summary: dict) -> dict:
    """``summary`` with the figures its session did not measure taken from the log records of the sessions
    before it (``kept``, a resumed run's log up to its checkpoint): the first validation loss (at step 0), and,
    for a session that trained no step, the training loss and the validation loss at the run's last step."""
    step = summary.get("steps")
    found = {"first_val_loss": [r.get("val_loss") for r in kept if r.get("type") == "val" and r.get("step") == 0],
             "val_loss": [r.get("val_loss") for r in kept if r.get("type") == "val" and r.get("step") == step],
             "train_loss": [r.get("loss") for r in kept if r.get("type") == "train" and r.get("step") == step]}
    for key, values in found.items():
        if summary.get(key) is None and values and values[-1] is not None:
            summary[key] = values[-1]
    return summary


__all__ = ["FINAL_STOPS", "LOCK_FILE", "RUN_FILES", "check_out", "check_target", "clear_run", "continue_log",
           "default_out_dir", "finished_summary", "holds_run", "refuse_if_in_use", "resume_target", "run_dir_of",
           "run_lock", "with_log_figures", "write_config", "writer"]
