"""The ``llmgpu`` command line: train / sample / info / bench, and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llmgpu.cli import main
from llmgpu.train.data import write_shard

pytestmark = pytest.mark.ch7

TINY = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--eval-batches", "1",
        "--quiet", "--no-plot"]


def test_train_then_sample(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", *TINY, "--steps", "3", "--eval-every", "2", "--sample-tokens", "8", "--out", str(out)])
    assert code == 0
    assert (out / "checkpoint" / "model.safetensors").is_file() and (out / "log.jsonl").is_file()
    capsys.readouterr()
    assert main(["sample", "--from", str(out), "--prompt", "import", "--tokens", "10", "--device", "cpu",
                 "--seed", "1"]) == 0
    text1 = capsys.readouterr().out
    assert text1.startswith("import") and len(text1.encode()) >= len("import") + 1
    main(["sample", "--from", str(out / "checkpoint"), "--prompt", "import", "--tokens", "10", "--device", "cpu",
          "--seed", "1"])
    assert capsys.readouterr().out == text1  # same seed, same text; a run dir or its checkpoint/ both work
    # resume for more steps from the command line
    assert main(["train", "--resume", str(out), "--steps", "5", "--quiet", "--no-plot", "--sample-tokens", "0"]) == 0
    steps = [ln for ln in (out / "log.jsonl").read_text().splitlines() if '"type": "train"' in ln]
    assert len(steps) == 5


@pytest.mark.parametrize("argv,needles", [
    (["train", "--steps", "0"], ["--steps must be >= 1"]),
    (["train", "--dtype", "fp8"], ["invalid choice", "fp8"]),
    (["train", "--preset", "huge"], ["invalid choice", "huge"]),
    (["train", "--lr", "-1"], ["--lr must be a positive number"]),
    (["train", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["train", "--batch", "two"], ["--batch must be an integer"]),
    (["sample"], ["--from"]),
    (["nonsense"], ["invalid choice"]),
])
def test_bad_flags_give_one_error_line(argv, needles, one_error_line):
    one_error_line(main(argv), *needles)


def test_bad_data_gives_one_error_line(tmp_path, capsys, one_error_line):
    out = str(tmp_path / "o")
    one_error_line(main(["train", *TINY, "--steps", "1", "--out", out, "--data", str(tmp_path / "no.txt")]),
                    "does not exist")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(np.array([1234, 1, 10] + [0] * 253, "<i4").tobytes() + b"\0" * 20)
    one_error_line(main(["train", *TINY, "--steps", "1", "--out", out, "--data", str(bad)]),
                    "magic 1234", "20240520")
    shard = write_shard(tmp_path / "tok.bin", np.arange(3000) % 1000)
    one_error_line(main(["train", *TINY, "--steps", "1", "--out", out, "--data", str(shard),
                                  "--vocab-size", "256"]), "token id 999", "vocabulary is 256")
    one_error_line(main(["sample", "--from", str(tmp_path / "nowhere")]), "does not exist")
    (tmp_path / "small.txt").write_text("tiny")
    one_error_line(main(["train", *TINY, "--steps", "1", "--out", out, "--data",
                                  str(tmp_path / "small.txt")]), "too few for one batch")


def test_info_and_bench(capsys, one_error_line):
    assert main(["info"]) == 0
    assert "device:" in capsys.readouterr().out
    assert main(["info", "--json"]) == 0
    assert '"device"' in capsys.readouterr().out
    one_error_line(main(["bench", "--modes", "llmgpu,warp-speed"]), "unknown mode")


def test_module_entry_point_error_is_one_line():
    r = subprocess.run([sys.executable, "-m", "llmgpu", "train", "--steps", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["llmgpu: error: --steps must be >= 1, got 0"]


@pytest.mark.parametrize("argv", [["info"], ["train", "--steps", "1", "--no-progress"], ["bench", "--steps", "1"]])
def test_bad_llmgpu_device_is_one_line_exit_2(monkeypatch, capsys, argv, one_error_line):
    """LLMGPU_DEVICE=banana: one 'llmgpu: error:' line naming the variable and exit code 2, no traceback."""
    monkeypatch.setenv("LLMGPU_DEVICE", "banana")
    one_error_line(main(argv), "LLMGPU_DEVICE", "'banana'")
