"""What a run shows and keeps: the progress line, and the JSON-lines log read back (chapter 7).

The loss-curve plot of a log is ``llmgpu.plotting.plot_losses(read_log(run_dir))``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from .config import FP8

# "[#####...............] 75/1378, loss 2.4970, val 2.6003, lr 6.00e-04, 277.4K tok/s, MFU 21.8%, 0:04<1:22"
# tqdm draws the bar and the counts; the run's own numbers (elapsed<eta from the trainer's schedule fit,
# which knows about evaluations and the time budget) are the postfix.
BAR_FORMAT = "[{bar:20}] {n_fmt}/{total_fmt}{postfix}"
BAR_CHARS = ".#"  # tqdm's ascii charset: empty, full


class Progress:
    """The status line of a run, kept readable wherever it goes.

    * On a terminal, a tqdm bar redrawn in place (trimmed to the terminal's width); ``message`` prints
      above it with ``tqdm.write``.
    * In a Jupyter kernel, one output updated in place (an IPython display with a ``display_id``): live
      while the cell runs, and a saved notebook keeps only the final line.
    * Anywhere else (a pipe, a log file, CI), a line each time the run passes another tenth of its steps,
      and the last line at ``close``: about a dozen lines, however long the run.

    Why not tqdm alone: off a terminal tqdm still writes every redraw, ``\r``-separated, so a log file or
    a notebook cell gets all of them (``disable=None`` instead writes nothing, not even the final line),
    and ``tqdm.notebook`` needs ipywidgets, whose widgets a rendered book cannot show. All three forms
    format their line with ``tqdm.format_meter``.

    ``enabled=False`` (``--quiet``) prints nothing but ``warn`` lines. ``total`` (0: not known yet) may be
    set while the run goes, as the trainer does when it fits the schedule to a time budget.
    """

    lines = 10  # off a terminal and outside a notebook: a line per tenth of the run

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._display = None if self.tty else _jupyter_display(self.stream)
        self._total = total
        self._bar = None  # the tqdm bar (terminal), created at the first update
        self._handle = None  # the IPython display handle (notebook), created at the first update
        self._last = None  # (step, text) of the last update
        self._printed = None  # the last step written as a line (pipe or file)

    @property
    def total(self) -> int:
        return self._total

    @total.setter
    def total(self, value):
        self._total = value
        if self._bar is not None:
            self._bar.total = value or None

    def update(self, step: int, *, loss=None, val=None, lr=None, tok_s=None, mfu=None, elapsed=None, eta=None,
               skipped=0):
        if not self.enabled:
            return
        stats = []
        if loss is not None:
            stats.append(f"loss {loss:.4f}")
        if val is not None:
            stats.append(f"val {val:.4f}")
        if lr is not None:
            stats.append(f"lr {lr:.2e}")
        if tok_s is not None:
            stats.append(f"{_si(tok_s)} tok/s")
        if mfu is not None:
            stats.append(f"MFU {100 * mfu:.1f}%")
        if skipped:
            stats.append(f"skipped {skipped}")  # steps whose inf/nan gradients were not applied
        if elapsed is not None:
            stats.append(f"{_hms(elapsed)}" + (f"<{_hms(eta)}" if eta is not None else ""))
        text = ", ".join(stats)
        self._last = (step, text)
        if self.tty:
            if self._bar is None:
                self._bar = tqdm(total=self._total or None, file=self.stream, bar_format=BAR_FORMAT,
                                 ascii=BAR_CHARS, dynamic_ncols=True, mininterval=0, leave=True)
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()
        elif self._display is not None:
            data = {"text/plain": self.line()}
            if self._handle is None:
                self._handle = self._display(data, raw=True, display_id=True)
            else:
                self._handle.update(data, raw=True)
        elif self._printed is None or self._tenth(step) > self._tenth(self._printed):
            self._write_line()

    def line(self) -> str:
        """The last update as one line ("" before the first)."""
        if self._last is None:
            return ""
        step, text = self._last
        return tqdm.format_meter(step, self._total or None, 0, bar_format=BAR_FORMAT, ascii=BAR_CHARS,
                                 postfix=text)

    def _tenth(self, step: int) -> int:
        return int(self.lines * step / self._total) if self._total else 0

    def _write_line(self):
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._printed = self._last[0]

    def message(self, text: str):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # clears the bar, prints, redraws it below
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def warn(self, text: str):
        """A line printed even when progress output is off (what the user must not miss)."""
        enabled, self.enabled = self.enabled, True
        try:
            self.message(text)
        finally:
            self.enabled = enabled

    def close(self):
        """End the line: the terminal bar stays as it was last drawn; a pipe or file gets the last update."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._display is None and self._last is not None and self._printed != self._last[0]:
            self._write_line()


def _jupyter_display(stream):
    """IPython's ``display`` when ``stream`` is a Jupyter kernel's output stream, else None."""
    if type(stream).__module__.split(".")[0] != "ipykernel":
        return None
    try:
        from IPython.display import display
    except ImportError:
        return None
    return display


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


LOGGED_NUMBERS = ("loss", "grad_norm", "val_loss")  # a step's and an evaluation's: null in the log is NaN


def read_log(path) -> list[dict]:
    """The records of a JSON-lines training log; a step's or an evaluation's number written as null (the log is
    strict JSON: ``session.strict_json``) reads as NaN, as the run had it."""
    p = Path(path)
    if p.is_dir():
        p = p / "log.jsonl"
    records = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    for r in records:
        if r.get("type") in ("train", "val"):
            r.update({k: float("nan") for k in LOGGED_NUMBERS if k in r and r[k] is None})
    return records


def done_line(summary: dict) -> str:
    """The last line of a finished or interrupted run, from its summary: steps, time, the validation loss (with the
    step it was measured at, when that is not the last one: an interrupted run skips the final evaluation), the
    skipped steps and where the checkpoint is."""
    fv, lv, at, steps = summary["first_val_loss"], summary["val_loss"], summary.get("val_loss_step"), summary["steps"]
    start = f"{fv:.3f} -> " if fv is not None and at != 0 else ""
    at_step = f" at step {at}" if at not in (None, steps) else ""
    val = "" if lv is None else f"val loss {start}{lv:.3f}{at_step}; "
    skipped = summary["skipped_steps"]
    head = "stopped" if summary.get("stop_reason") == "interrupted" else "done"  # not to read as a finished run
    return (f"{head}: {steps} steps in {summary['train_time_s']:.0f} s; {val}"
            + (f"{skipped} steps skipped (inf/nan gradients); " if skipped else "")
            + (f"checkpoint {summary['checkpoint']}" if "unfinished_step" not in summary else
               f"step {summary['unfinished_step']} was stopped halfway: nothing saved, "
               + (f"the last checkpoint is {summary['checkpoint']}" if summary["checkpoint"] else "no checkpoint")))


def run_banner(cfg, mc, n_params: int, dtype: str, world: int, device: str) -> str:
    """The run's first line: the model, the batch (per rank), the step's options and the device."""
    family = "" if mc.arch == "gpt2" else f"{mc.arch.capitalize()}, "  # GPT-2's banner as it always was
    if cfg.dtype == FP8:  # the model's dtype, with the GEMMs that run in FP8
        dtype = f"{dtype} with FP8 QKV/MLP GEMMs ({cfg.fp8_recipe} scaling)"
    return (f"llmgpu train: {family}{mc.n_layer} layers, C={mc.n_embd}, {n_params / 1e6:.2f}M parameters, vocab "
            f"{mc.vocab_size}, {dtype}, batch {cfg.batch}x{cfg.seq}x{cfg.grad_accum}"
            + (f" on each of {world} ranks" if world > 1 else "")
            + (f", ZeRO-{cfg.zero}" if cfg.zero else "")
            + (f", activation checkpointing every {cfg.checkpoint_every}" if cfg.checkpoint_every else "")
            + (", chapter 8 fast step" + (" as a CUDA graph" if cfg.graph else "") if cfg.fast else "")
            + f"; {device}")


__all__ = ["Progress", "done_line", "read_log", "run_banner"]
