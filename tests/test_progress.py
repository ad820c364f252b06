"""The progress line (train.report.Progress): redrawn in place on a terminal, a few lines in a pipe or a
file, one output updated in place in a notebook, nothing but warnings with --quiet; the final line is
always there."""

from __future__ import annotations

import io
import re

import pytest

from llmgpu.cli import main
from llmgpu.train import report
from llmgpu.train.report import Progress

pytestmark = pytest.mark.ch7

BAR = re.compile(r"\[[.#]{20}\] \d+/\d+")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(progress: Progress, steps: int, stop: int | None = None):
    """What the trainer does: messages, the total known after a few steps, updates, close."""
    progress.message("llmgpu train: ...")
    progress.update(1, loss=5.5, lr=1e-5, tok_s=2e5, mfu=0.2, elapsed=0.1)
    progress.total = steps
    progress.message(f"time budget 30 s: about {steps} steps")
    for s in range(2, (stop or steps) + 1):
        progress.update(s, loss=5.5 - s / steps, val=5.0, lr=1e-4, tok_s=2e5, mfu=0.2, elapsed=s / 10,
                        eta=(steps - s) / 10, skipped=int(s > steps // 2))
    progress.close()
    progress.message("done")


def test_terminal_redraws_one_line_in_place():
    out = Terminal()
    run(Progress(0, stream=out), 200)
    text = out.getvalue()
    assert text.count("\r") >= 200  # every update redrawn
    lines = text.split("\n")
    assert lines[0] == "llmgpu train: ..." and lines[-2:] == ["done", ""]
    assert lines[1].endswith("time budget 30 s: about 200 steps")  # printed above the bar, on its own line
    final = lines[-3].split("\r")[-1]  # what the terminal shows when the run has ended
    assert final.startswith("[####################] 200/200, loss 4.5000, val 5.0000") and "skipped 1" in final
    assert len(lines) == 5  # the bar is not repeated on new lines


@pytest.mark.parametrize("stop", [None, 137])
def test_pipe_or_file_gets_a_few_lines_and_the_final_one(stop):
    out = io.StringIO()
    run(Progress(0, stream=out), 1000, stop=stop)
    text = out.getvalue()
    assert "\r" not in text
    bars = [ln for ln in text.splitlines() if BAR.match(ln)]
    assert len(bars) <= Progress.lines + 2, text  # not one line per update (999 of them)
    last = stop or 1000
    assert bars[-1].startswith(f"[{'#' * (20 * last // 1000):.<20}] {last}/1000, loss "), text
    assert text.splitlines()[-1] == "done"
    assert text.splitlines()[1].startswith("[                    ] 1/?, loss 5.5000")  # the run has started


def test_quiet_prints_only_warnings():
    for out in (io.StringIO(), Terminal()):
        p = Progress(100, enabled=False, stream=out)
        run(p, 100)
        p.warn("llmgpu: note: --warmup is longer than the run")
        assert out.getvalue() == "llmgpu: note: --warmup is longer than the run\n"


def test_notebook_gets_one_output_updated_in_place(monkeypatch):
    shown = []

    class Handle:
        def update(self, data, raw):
            shown[0] = data["text/plain"]

    def display(data, raw, display_id):
        assert raw and display_id
        shown.append(data["text/plain"])
        return Handle()

    monkeypatch.setattr(report, "_jupyter_display", lambda stream: display)
    out = io.StringIO()
    run(Progress(0, stream=out), 300)
    assert len(shown) == 1 and shown[0].startswith("[####################] 300/300, loss 4.5000"), shown
    assert out.getvalue().splitlines() == ["llmgpu train: ...", "time budget 30 s: about 300 steps", "done"]


def test_jupyter_stream_detection():
    class OutStream(io.StringIO):
        pass

    OutStream.__module__ = "ipykernel.iostream"
    pytest.importorskip("IPython")
    assert report._jupyter_display(OutStream()) is not None
    assert report._jupyter_display(io.StringIO()) is None


TINY = ["train", "--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--eval-every", "0",
        "--no-plot", "--warmup", "0", "--sample-tokens", "0", "--log-every", "1", "--steps", "40"]


def test_cli_train_off_a_terminal_and_quiet(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    bars = [ln for ln in err.splitlines() if BAR.match(ln)]
    assert 1 <= len(bars) <= Progress.lines + 2 and bars[-1].startswith("[####################] 40/40, loss "), err
    assert err.splitlines()[-1].startswith("done: 40 steps")
    assert main([*TINY, "--quiet", "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""


def test_done_line_names_the_step_of_a_validation_loss_that_is_not_the_last_steps():
    base = dict(steps=31, train_time_s=3.2, first_val_loss=5.3781, val_loss=5.3781, val_loss_step=0, skipped_steps=0,
                checkpoint="r/checkpoint")
    assert report.done_line(base) == "done: 31 steps in 3 s; val loss 5.378 at step 0; checkpoint r/checkpoint"
    assert report.done_line({**base, "val_loss": 4.1, "val_loss_step": 31}) == (
        "done: 31 steps in 3 s; val loss 5.378 -> 4.100; checkpoint r/checkpoint")
    assert "val loss 5.378 -> 4.100 at step 20;" in report.done_line({**base, "val_loss": 4.1, "val_loss_step": 20})
    assert report.done_line({**base, "first_val_loss": None, "val_loss": None, "val_loss_step": None,
                             "skipped_steps": 2, "unfinished_step": 32, "checkpoint": None,
                             "stop_reason": "interrupted"}) == (  # an interrupted run does not say "done"
        "stopped: 31 steps in 3 s; 2 steps skipped (inf/nan gradients); step 32 was stopped halfway: nothing saved, "
        "no checkpoint")
