"""``llmgpu train --nproc N``: start N local ranks of the same command and wait for them (chapter 9).

* **GPUs**: N child processes with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``); NCCL's id travels through the
  rendezvous (``dist/bootstrap.py``). This launcher watches them: when one exits with an error, it names
  that rank and stops the others (SIGTERM, then SIGKILL after ``GRACE_S``), so nothing hangs.
* **CPU ranks**: MPI processes must be started by MPI's own launcher, so this runs
  ``mpiexec -n N python -m llmgpu train ...`` (the ``mpich`` wheel brings ``mpiexec``), which stops every
  rank when one dies and names the dead process by its PID; each rank registers its PID
  (``register_rank``) in a directory this launcher hands out, so the line we add names the rank. A rank that
  stops the run on an error (``MPI_Abort``) also leaves its error line there (``report_rank_error``): mpiexec
  can drop a rank's last output when it tears the run down, and the launcher prints any such line it did not
  pass through, then names the ranks that stopped the run that way; a rank that died silently is named from its
  end as the launcher saw it and from mpiexec's report (both when they disagree: ``name_dead_rank``).

The environment is inherited (``NCCL_*`` settings such as ``NCCL_NVLS_ENABLE`` reach every rank).
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .env import DistError

GRACE_S = 3.0  # seconds the other ranks get after one failed (SIGTERM), before SIGKILL
RANK_DIR_VAR = "LLMGPU_RANK_DIR"  # where the ranks of an --nproc run register their PIDs
ERROR_MARK = "llmgpu: error: "  # how the command's error lines start (cli.main prints them with it)
SAID_ONCE = ("llmgpu: interrupted",)  # besides error lines, what every rank prints alike: passed once
MPICH_ABORT = re.compile(r"Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort")
# MPICH's exit code for a rank killed by SIGKILL or SIGTERM: the signal's number (llmgpu itself exits 1, 2, 130, 143)
SIGNAL_EXIT_CODES = (9, 15)


def register_rank(rank: int):
    """Leave this process's PID where the ``--nproc`` launcher looks (nothing outside such a run)."""
    d = os.environ.get(RANK_DIR_VAR)
    if d and os.path.isdir(d):
        Path(d, str(rank)).write_text(str(os.getpid()))


def stopped_ranks() -> list[tuple[int, int]]:
    """(rank, pid) of the registered ranks of this ``--nproc`` run that are stopped (SIGSTOP or a debugger): what a
    rank that timed out waiting for the others can name before it ends the run (nothing outside such a run)."""
    d = os.environ.get(RANK_DIR_VAR)
    if not d or not os.path.isdir(d):
        return []
    out = []
    for f in Path(d).iterdir():
        if f.name.isdigit():
            try:
                pid = int(f.read_text())
            except (OSError, ValueError):  # being written
                continue
            if pid != os.getpid() and _is_stopped(pid):
                out.append((int(f.name), pid))
    return sorted(out)


def report_rank_error(line: str):
    """Leave this rank's error line (an ``ERROR_MARK`` line, as printed) where the ``--nproc`` launcher looks,
    before the rank aborts the run (nothing outside such a run)."""
    d = os.environ.get(RANK_DIR_VAR)
    if d and os.path.isdir(d):
        Path(d, f"error.{os.getpid()}").write_text(line)


def rank_errors(directory) -> list[tuple[str, str]]:
    """(pid, error line) of every rank that left one in ``directory`` (``report_rank_error``), by file name."""
    out = []
    for f in sorted(Path(directory).glob("error.*")):
        line = f.read_text().strip()
        if line:
            out.append((f.name.split(".", 1)[1], line))
    return out


def unglued(lines):
    """``lines`` (a rank output stream as mpiexec merges it) with the lines of several ranks that it glued together
    split apart again: an error line or MPICH's abort line that starts in the middle of another line begins its own,
    and the newline each glued line lost, which comes through later as an empty line, is dropped."""
    starts = re.compile(f"(?<=.)(?={re.escape(ERROR_MARK)}|{MPICH_ABORT.pattern})")
    lost = 0
    for line in lines:
        if lost and not line.strip():
            lost -= 1
            continue
        parts = starts.split(line)
        lost += len(parts) - 1
        yield from (part.rstrip() + "\n" for part in parts[:-1])
        yield parts[-1]


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the children must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_mpiexec() -> str:
    """The ``mpiexec`` of the MPI that mpi4py loads (MPICH's Hydra or Open MPI's), looked for beside this
    Python, in ``bin/`` next to the import path (a ``pip install --target`` of the mpich wheel) and on PATH;
    a one-line error otherwise. Another MPI's mpiexec would start N singletons that never meet."""
    import mpi4py

    mpi4py.rc.initialize = False  # only ask which library; the launcher itself is not an MPI process
    from mpi4py import MPI

    family = "Open MPI" if "Open MPI" in MPI.Get_library_version() else "HYDRA"
    cands = [Path(sys.executable).parent / "mpiexec"] + [Path(p) / "bin" / "mpiexec" for p in sys.path if p]
    cands += [Path(p) / "mpiexec" for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for c in dict.fromkeys(cands):
        if c.is_file() and os.access(c, os.X_OK):
            try:
                v = subprocess.run([str(c), "--version"], capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            if family in v or (family == "Open MPI" and "OpenRTE" in v):
                return str(c)
    raise DistError(f"--nproc on CPU ranks needs the mpiexec of mpi4py's MPI ({family}): pip install "
                    "'llmgpu[dist]' (mpi4py and the mpich wheel)")


def launch(nproc: int, args: list[str], *, gpu: bool, say=print) -> int:
    """Run ``python -m llmgpu <args>`` as ``nproc`` ranks; returns the exit code for the whole run.

    The ranks run in a session of their own, so a signal reaches them once, through the launcher: SIGINT (Ctrl-C)
    or SIGTERM to the launcher is passed to every rank, which stop together after the same step, save one
    checkpoint and exit 130 / 143 (``train/stop.py``); a second signal stops them at once. A rank that refuses
    the run (an error line) ends every rank with that line alone."""
    if nproc < 2:
        raise DistError(f"--nproc must be at least 2 to launch ranks, got {nproc}")
    cmd = [sys.executable, "-m", "llmgpu", *args]
    if not gpu:
        try:
            import mpi4py  # noqa: F401  (fail here, once, rather than in every rank)
        except ImportError:
            raise DistError("--nproc on CPU ranks needs mpi4py: pip install 'llmgpu[dist]'") from None
    cores = os.cpu_count() or 1
    if not gpu and nproc > cores:
        say(f"llmgpu: note: {nproc} ranks on {cores} CPU cores share them: a check of correctness, not of speed",
            file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="llmgpu-ranks-") as d:
        env = dict(os.environ, **{RANK_DIR_VAR: d})
        if gpu:
            return _launch_gpu(nproc, cmd, env, d, say)
        return _launch_mpi(nproc, cmd, env, d, say)


def _launch_mpi(nproc, cmd, env, d, say) -> int:
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without both
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    watch = _FirstDeath(d)
    # a signal to the launcher goes to the ranks themselves, not to mpiexec (which would kill them unsaved)
    relay = _Relay(lambda: [int(pid) for pid in watch.rank_pids()])
    with relay:
        rc, reports, passed = _wait_mpiexec([find_mpiexec(), "-n", str(nproc), *cmd], env, relay)
    rc = 128 - rc if rc < 0 else rc  # mpiexec killed by a signal: the shell's code
    first = watch.first()
    errors = rank_errors(d)
    for _, line in errors:
        if line not in passed:  # mpiexec dropped it when it stopped the run
            say(line, file=sys.stderr)
    if relay.killed:  # no rank died of itself: the user's second signal killed them all
        say(f"llmgpu: a second {signal.Signals(relay.signum).name} killed the ranks at once: the run keeps the last "
            "checkpoint it saved", file=sys.stderr)
        return 128 + relay.signum
    if rc not in (0, 130, 143) and not errors:  # a rank that stopped the run on an error said so (above)
        what = name_dead_rank(first, reports, watch.rank_of, rc)
        say(f"llmgpu: {what}; mpiexec stopped the other ranks of the {nproc}-rank run", file=sys.stderr)
        if rc in SIGNAL_EXIT_CODES:  # MPICH exits with the signal's number: the shell's code for it is 128 + that
            return 128 + rc
    return rc


def _launch_gpu(nproc, cmd, env, d, say) -> int:
    port = free_port()
    procs = []
    for r in range(nproc):
        env_r = dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env_r, start_new_session=True, preexec_fn=_parent_death_signal()))
    relay = _Relay(lambda: [p.pid for p in procs if p.poll() is None])
    with relay:
        return _watch(procs, say, d, relay)


def name_dead_rank(first: list, reports: list, rank_of: dict, rc: int) -> str:
    """Who died, from two witnesses that can each be wrong under load: ``first`` (the ranks the watcher saw end
    first, [(rank, pid), ...]) and mpiexec's ``reports`` (see ``_wait_mpiexec``; it may name a process it was
    already stopping, and a rank that sees its peer vanish may exit before the dead one's end is visible).
    One rank when they agree, else every rank either names."""
    codes = {str(r[2]): r[3] for r in reports if r[0] == "rank"} | {r[0]: int(r[1]) for r in reports
                                                                   if r[0] != "rank"}
    cands = dict(first)  # rank -> pid
    if reports:  # the process mpiexec reported first
        r = reports[0]
        rank, pid = (r[1], r[2]) if r[0] == "rank" else (rank_of.get(r[0]), r[0])
        if rank is not None:
            cands[rank] = pid
    if len(cands) == 1:
        rank, pid = next(iter(cands.items()))
        return f"rank {rank} (pid {pid}) {_how(codes[pid]) if pid in codes else 'died'}"
    if cands:
        return (f"one of ranks {', '.join(sorted(cands, key=_rank_order))} died (they ended too close together to "
                f"tell which first; mpiexec exit code {rc})")
    return f"a rank exited with code {rc}"


def _rank_order(rank: str):
    """Ranks (strings) in numeric order, anything else ("?": a PID no rank registered) after them."""
    return (0, int(rank)) if rank.isdigit() else (1, 0)


def _how(code: int) -> str:
    return f"was killed by signal {code - 128 if code > 128 else code}" if code in SIGNAL_EXIT_CODES or code > 128 \
        else f"exited with code {code}"


class _FirstDeath:
    """Which rank of an mpiexec run ended first. Each rank leaves its PID in ``directory`` (``register_rank``);
    a thread watches those processes (a pidfd each on Linux, else polling) and keeps the order they end in.
    mpiexec's own report names a process it saw die, which under load may be one it was already stopping."""

    def __init__(self, directory):
        self.dir, self.order, self.rank_of = directory, [], {}  # rank_of: pid → rank, every rank registered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        live, seen = {}, set()  # handle (a pidfd, or -pid when polling) → (rank, pid)
        while not self._stop.is_set():
            for f in os.listdir(self.dir):
                if f in seen or not f.isdigit():  # a rank's PID file is named by its rank
                    continue
                try:
                    pid = int(Path(self.dir, f).read_text())
                    handle = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -pid
                except (OSError, ValueError):  # not written yet, or already gone
                    continue
                seen.add(f)
                live[handle] = (f, str(pid))
                self.rank_of[str(pid)] = f
            fds = [h for h in live if h >= 0]
            ended = select.select(fds, [], [], 0.02)[0] if fds else []
            if not fds:
                time.sleep(0.02)
            ended += [h for h in live if h < 0 and not _alive(-h)]
            if ended:  # one batch: processes seen ended in the same wake-up, in no particular order
                self.order.append([live.pop(h) for h in ended])
                for h in ended:
                    if h >= 0:
                        os.close(h)

    def rank_pids(self) -> list[str]:
        """The PIDs the ranks registered so far."""
        return list(self.rank_of)

    def first(self) -> list:
        """[(rank, pid), ...] of the first processes seen ending: one, or several that ended too close together
        to order (mpiexec stops the others within milliseconds; a loaded machine may wake this thread later)."""
        time.sleep(0.1)  # the last exits reach the thread
        self._stop.set()
        self._thread.join(2)
        return sorted(self.order[0], key=lambda t: int(t[0])) if self.order else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _wait_mpiexec(cmd, env, relay) -> tuple[int, list, str]:
    """Run mpiexec (in a session of its own: signals reach the ranks through ``relay``), passing its output through
    and reading it for a dead process (Hydra, on stdout: 'PID n RUNNING AT ...' then 'EXIT CODE: c'; Open MPI, on
    stderr: 'process rank r with PID n ... exited on signal s'). Returns mpiexec's exit code, the deaths it reported
    (('rank', r, pid, code) or (pid, code) each) and the ``ERROR_MARK`` and ``SAID_ONCE`` lines it passed through
    (only those: a long run prints a line per step)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                         start_new_session=True, preexec_fn=_parent_death_signal())
    relay.fallback = lambda sig: os.killpg(p.pid, sig)  # before any rank registered: nothing to save yet
    found: list = []
    passed: list = []

    def pump(src, dst):
        pid, in_banner, dashes = None, False, None
        for line in unglued(src):
            if ERROR_MARK in line or line.startswith(SAID_ONCE):
                if line in passed:  # every rank hit the same error (a bad setting), or Ctrl-C: say it once
                    continue
                passed.append(line)
            # MPI's own words for MPI_Abort (MPICH: one line; Open MPI: a banner between dashed lines, so a dashed
            # line waits for the next): the rank that aborted printed its error line first, which says why
            if not in_banner and line.startswith("-----") and dashes is None:
                dashes = line
                continue
            in_banner = in_banner or line.startswith("MPI_ABORT was invoked")
            if dashes is not None:
                if not in_banner:
                    dst.write(dashes)
                dashes = None
            if in_banner or MPICH_ABORT.match(line):
                in_banner = in_banner and not line.startswith("-----")
                continue
            dst.write(line)
            dst.flush()
            m = re.search(r"process rank (\d+) with PID (\d+) on node \S+ exited on signal (\d+)", line)
            if m:
                found.append(("rank", m.group(1), m.group(2), 128 + int(m.group(3))))
            m = re.search(r"PID (\d+) RUNNING AT", line)
            pid = m.group(1) if m else pid
            m = re.search(r"EXIT CODE: (\d+)", line)
            if m and pid:
                found.append((pid, m.group(1)))
        if dashes is not None:  # the stream ended on a dashed line: it was no banner's
            dst.write(dashes)
            dst.flush()

    threads = [threading.Thread(target=pump, args=(p.stdout, sys.stdout), daemon=True),
               threading.Thread(target=pump, args=(p.stderr, sys.stderr), daemon=True)]
    for t in threads:
        t.start()
    rc = relay.wait(p)
    for t in threads:
        t.join(5)
    return rc, found, "".join(passed)


def _watch(procs, say, rank_dir, relay) -> int:
    """Wait for the GPU ranks; when one fails, stop the others (and name it, unless it left its error line)."""
    while True:
        codes = [p.poll() for p in procs]
        if relay.signum is not None:  # the ranks were asked to stop: let them save, then report their exit
            codes = [relay.wait(p) for p in procs]
            codes = [128 - c if c < 0 else c for c in codes]  # killed by a signal: the shell's code
            return max(codes)
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            break
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)
    r, c = bad[0]
    stopped = [(q, p.pid) for q, p in enumerate(procs) if p.poll() is None and _is_stopped(p.pid)]
    if stopped:  # a rank that waited for a stopped one timed out: the stopped one is the cause
        say("llmgpu: " + ", ".join(f"rank {q} (pid {pid})" for q, pid in stopped)
            + f" {'is' if len(stopped) == 1 else 'are'} stopped (SIGSTOP or a debugger), so rank {r} could not "
            "finish its collectives; stopping every rank", file=sys.stderr)
    elif not rank_errors(rank_dir):  # a rank that refused the run printed its one line; else say who ended it
        how = f"was killed by signal {-c}" if c < 0 else _how(c)
        say(f"llmgpu: rank {r} {how}; stopping the other ranks", file=sys.stderr)
    _stop(procs)
    return c if c > 0 else 128 - c  # killed by a signal: the shell's code


class _Relay:
    """The launcher's SIGINT/SIGTERM handlers: the first signal is passed to every rank (``targets()``: their
    PIDs; ``fallback(sig)`` before there are any), a second one kills them. ``wait(p)`` waits for a process,
    however many signals arrive meanwhile."""

    def __init__(self, targets):
        self.targets, self.fallback, self.signum, self._old = targets, None, None, {}
        self.killed = False  # a second signal killed the ranks

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            pids = self.targets()
            for pid in pids:
                _signal(pid, signum)
            if not pids and self.fallback is not None:
                _try(self.fallback, signum)
        else:  # the second time: now
            self.killed = True
            for pid in self.targets():
                _signal(pid, signal.SIGKILL)
            if self.fallback is not None:
                _try(self.fallback, signal.SIGKILL)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        return False

    @staticmethod
    def wait(p) -> int:
        while True:
            try:
                return p.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for other Pythons
                continue


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped (Linux: state T, or t under a tracer, in /proc/PID/stat); False elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _try(f, sig):
    try:
        f(sig)
    except (ProcessLookupError, PermissionError):
        pass


def _parent_death_signal():
    """A ``preexec_fn`` that makes a rank get SIGTERM (stop and save) when the launcher dies, so that none trains on
    unseen (Linux's PR_SET_PDEATHSIG); None elsewhere. libc is loaded here, in the launcher: the child, forked from
    a process with threads, must not import or load anything before exec."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _stop(procs):
    """After a rank failed: the others cannot finish a step or save without it, so SIGKILL after a short grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


__all__ = ["ERROR_MARK", "RANK_DIR_VAR", "find_mpiexec", "free_port", "launch", "name_dead_rank", "register_rank",
           "rank_errors", "report_rank_error", "strip_nproc"]
