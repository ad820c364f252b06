"""The ``llmgpu`` command line: train / sample / info / bench, and one-line errors for bad input."""

from __future__ import annotations

import os
import signal
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
    (["train", "--dtype", "fp4"], ["invalid choice", "fp4"]),  # fp8 is a dtype now: tests/test_train_fp8.py
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


def test_the_command_line_loads_without_numpy():
    """``llmgpu`` reaches main(), where Ctrl-C is one line, before NumPy and the backend load (about a second)."""
    r = subprocess.run([sys.executable, "-c", "import sys, llmgpu.cli; print(sorted({'numpy', 'llmgpu.backend'} & "
                        "set(sys.modules)))"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


@pytest.mark.parametrize("how", ["raised", "signal"])
def test_ctrl_c_while_the_command_loads_is_one_line(how, monkeypatch, capsys):
    """A Ctrl-C during the imports and the parser: 'llmgpu: interrupted', exit code 130, no traceback. A SIGINT is
    held until they are done (inside NumPy's C import code it would come out as an ImportError)."""
    from llmgpu import cli

    real, built = cli.build_parser, []

    def build_parser():
        if how == "raised":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)
        built.append(real())  # reached: the signal waits for the loading to end
        return built[-1]

    monkeypatch.setattr(cli, "build_parser", build_parser)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever the test runner set
    try:
        assert main(["info"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.splitlines() == ["llmgpu: interrupted"]
    assert len(built) == (how == "signal")


@pytest.mark.parametrize("argv", [["info"], ["train", "--steps", "1", "--no-progress"], ["bench", "--steps", "1"]])
def test_bad_llmgpu_device_is_one_line_exit_2(monkeypatch, capsys, argv, one_error_line):
    """LLMGPU_DEVICE=banana: one 'llmgpu: error:' line naming the variable and exit code 2, no traceback."""
    monkeypatch.setenv("LLMGPU_DEVICE", "banana")
    one_error_line(main(argv), "LLMGPU_DEVICE", "'banana'")


# --------------------------------------------------------------------------- prompts and sampling settings

BAD_SAMPLING = [
    (["--prompt", "ids:"], ["--prompt ids:", "no token id"]),
    (["--prompt", "ids: , ,"], ["--prompt ids:", "no token id"]),
    (["--prompt", "ids:5,-1"], ["--prompt", "token id -1", "[0, 256)"]),
    (["--prompt", "ids:256"], ["--prompt", "token id 256", "[0, 256)"]),
    (["--prompt", "ids:1.5"], ["comma-separated integers"]),
    (["--prompt", ""], ["--prompt is empty"]),
    (["--prompt", "ab\udcff"], ["not valid UTF-8", "byte 0xff"]),  # how Python hands over argv bytes 'ab\xff'
    (["--temperature", "1e-320"], ["--temperature", "below 1e-06", "give 0"]),
    (["--temperature", "1e-7"], ["--temperature", "below 1e-06"]),
    (["--temperature", "nan"], ["--temperature must be"]),
    (["--seed", "-1"], ["--seed must be", "-1"]),
]  # fmt: skip


@pytest.mark.parametrize("flags,needles", BAD_SAMPLING)
def test_train_refuses_bad_sample_settings_before_it_trains(tmp_path, flags, needles, one_error_line):
    """The end-of-run sample's settings are checked at the door: one line, and no run directory written."""
    out = tmp_path / "r"
    one_error_line(main(["train", *TINY, "--steps", "2", "--sample-tokens", "4", "--out", str(out), *flags]),
                   *needles)
    assert not out.exists()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample") / "run"
    assert main(["train", *TINY, "--steps", "1", "--eval-every", "0", "--sample-tokens", "0", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("flags,needles", BAD_SAMPLING)
def test_sample_refuses_bad_settings_in_one_line(small_run, flags, needles, capsys, one_error_line):
    capsys.readouterr()
    one_error_line(main(["sample", "--from", str(small_run), "--device", "cpu", "--tokens", "3", *flags]), *needles)


def test_sampling_at_the_edges_that_work(small_run, capsys):
    """Temperature 0 (greedy) and at MIN_TEMPERATURE give the same most-likely text; ids at the vocabulary's ends."""
    def sample(*flags):
        assert main(["sample", "--from", str(small_run), "--device", "cpu", "--tokens", "6", *flags]) == 0
        return capsys.readouterr().out

    assert sample("--temperature", "0") == sample("--temperature", "1e-6", "--seed", "7")
    assert sample("--prompt", "ids:0,255")


def test_non_utf8_prompt_bytes_from_a_shell_are_one_line(small_run):
    r = subprocess.run([sys.executable, "-m", "llmgpu", "sample", "--from", str(small_run), "--device", "cpu",
                        "--prompt", b"caf\xe9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "llmgpu: error: --prompt is not valid UTF-8 text (byte 0xe9 at character 3); give UTF-8 text or token ids "
        "(ids:...)"], r.stderr
