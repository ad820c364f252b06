"""Nothing silently wrong: a diverged run stops and keeps its last good checkpoint, skipped fp16 steps are
counted and a streak of them stops the run, adjusted settings are said and written down, and the CPU
fallback says why."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.cli import main
from llmgpu.train import TrainConfig, Trainer, read_log, train
from llmgpu.train.checkpoint import load_checkpoint, save_checkpoint
from llmgpu.train.data import write_shard

pytestmark = pytest.mark.ch7

TINY = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--eval-every", "0", "--quiet",
        "--no-plot", "--warmup", "0"]
FAST = dict(preset="tiny", device="cpu", batch=2, seq=16, lr=3e-3, warmup=0, eval_every=0, log_every=2,
            progress=False, sample_tokens=0, plot=False)


def _error_lines(capsys):
    err = capsys.readouterr().err
    return [x for x in err.splitlines() if x.startswith("llmgpu: error: ")], err


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "r"
    # lr 1e30: the first step blows the weights up, the second step's loss is nan
    code = main(["train", *TINY, "--lr", "1e30", "--steps", "20", "--save-every", "1", "--log-every", "1",
                 "--eval-every", "5", "--sample-tokens", "20", "--out", str(out)])
    errors, err = _error_lines(capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and "RuntimeWarning" not in err, err
    assert "the loss is nan at step 2" in errors[0] and str(out / "checkpoint") in errors[0]
    assert load_checkpoint(out)[1]["step"] == 1  # step 2's weights were not written over it
    s = _strict_json((out / "summary.json").read_text())
    assert s["stop_reason"] == "diverged" and s["steps"] == 2 and "sample" not in s
    assert s["train_loss"] is None  # NaN is not JSON: null
    assert read_log(out)[-1]["type"] == "end" and not (out / "samples.txt").exists()
    lines = [_strict_json(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines if r["type"] == "train"][1] is None
    assert np.isnan([r["loss"] for r in read_log(out) if r["type"] == "train"][1])  # read back as the run had it


def _strict_json(text: str):
    """JSON as strict parsers (JavaScript, Go) read it: NaN and Infinity are errors."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a file that must be strict JSON"))


def test_a_diverged_run_without_a_checkpoint_says_so(tmp_path):
    s = train(TrainConfig(**{**FAST, "lr": 1e30}, steps=10, out=str(tmp_path / "r")))
    assert s["stop_reason"] == "diverged" and s["checkpoint"] is None and "no checkpoint was saved" in s["error"]
    assert not (tmp_path / "r" / "checkpoint").exists()


def test_a_divergence_seen_at_a_later_log_sync_says_where_the_run_stopped(tmp_path):
    """The loss is read every --log-every steps: the NaN of step 2 is seen at step 4's sync, where the run stops.
    The error names both, so the summary's 'steps': 4 does not contradict it."""
    s = train(TrainConfig(**{**FAST, "lr": 1e30, "log_every": 4}, steps=10, out=str(tmp_path / "r")))
    assert s["stop_reason"] == "diverged" and s["steps"] == 4
    assert "the loss is nan at step 2" in s["error"] and "log sync of step 4, where the run stopped" in s["error"]


def test_sample_refuses_non_finite_weights_and_a_nan_temperature(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    for t in ("nan", "inf", "-1"):
        assert main(["sample", "--from", str(out), "--temperature", t, "--device", "cpu"]) == 2
        errors, err = _error_lines(capsys)
        assert len(errors) == 1 and "--temperature" in errors[0] and "Traceback" not in err, err
    assert main(["train", *TINY, "--steps", "1", "--temperature", "nan", "--out", str(tmp_path / "t")]) == 2
    assert "--temperature" in _error_lines(capsys)[0][0]
    model, meta, optim = load_checkpoint(out)
    model["transformer.h.0.mlp.c_fc.weight"][0, 0] = np.nan
    save_checkpoint(out / "checkpoint", model=model, meta=meta, optim=optim)
    assert main(["sample", "--from", str(out), "--device", "cpu"]) == 2
    errors, err = _error_lines(capsys)
    assert len(errors) == 1 and "inf/nan weights" in errors[0] and "mlp.c_fc.weight" in errors[0], err
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 2  # and resume does not train on them
    assert "inf/nan weights" in _error_lines(capsys)[0][0]


def test_bf16_weights_with_a_nan_are_refused_as_fp32_ones_are(tmp_path, capsys):
    """bfloat16 (ml_dtypes) is no NumPy floating type: a bf16 checkpoint's NaN passed the check, export wrote it
    and exited 0, and eval and sample blamed the configuration with a Python hint (allow_nonfinite=True)."""
    from llmgpu import backend
    from llmgpu.interop import safetensors

    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    f = out / "checkpoint" / "model.safetensors"
    weights = {k: v.astype(backend.bfloat16) for k, v in safetensors.load_file(f).items()}
    weights["transformer.h.0.attn.c_attn.weight"][1, 2] = np.nan
    safetensors.save_file(f, weights, safetensors.read_metadata(f))
    capsys.readouterr()
    for cmd in (["sample", "--from", str(out), "--device", "cpu"], ["export", "--from", str(out), "--to",
                str(tmp_path / "x")], ["eval", "--from", str(out), "--data", "stdlib", "--device", "cpu"]):
        assert main(cmd) == 2, cmd
        errors, err = _error_lines(capsys)
        assert len(errors) == 1 and "inf/nan weights (transformer.h.0.attn.c_attn.weight)" in errors[0], err
    assert not (tmp_path / "x").exists()


def test_weights_overwritten_with_0xff_bytes_may_be_a_damaged_file(tmp_path, capsys):
    """0xFF bytes read as NaN weights: the refusal names a damaged file, not only a diverged run."""
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    f = out / "checkpoint" / "model.safetensors"
    data = bytearray(f.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # after safetensors' header
    data[start:] = b"\xff" * (len(data) - start)
    f.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["sample", "--from", str(out), "--device", "cpu"]) == 2
    errors, err = _error_lines(capsys)
    assert len(errors) == 1 and "inf/nan weights" in errors[0] and "the file is damaged" in errors[0], err


def test_fp16_skipped_steps_are_counted_in_the_summary_and_the_progress_line(tmp_path, capsys):
    t = Trainer(TrainConfig(**{**FAST, "progress": True, "log_every": 3}, steps=14, dtype="fp16",
                            out=str(tmp_path / "r")))
    t.scaler._buf[...] = [2.0**26, 2.0**-26]  # a loss scale that overflows fp16 until the scaler halves it
    s = t.run()
    skipped = [r["skipped"] for r in read_log(tmp_path / "r") if r["type"] == "train"]
    assert s["stop_reason"] == "steps" and 0 < sum(skipped) < 14 and s["skipped_steps"] == sum(skipped)
    err = capsys.readouterr().err
    assert f"skipped {sum(skipped)}" in err and f"{sum(skipped)} steps skipped" in err


def test_a_streak_of_skipped_steps_stops_the_run(tmp_path, capsys):
    out = tmp_path / "r"
    code = main(["train", *TINY, "--dtype", "fp16", "--lr", "1e30", "--steps", "40", "--max-skipped-steps", "5",
                 "--save-every", "1", "--out", str(out)])
    errors, err = _error_lines(capsys)
    assert code == 2 and len(errors) == 1 and "5 steps in a row" in errors[0], err
    s = json.loads((out / "summary.json").read_text())
    assert s["stop_reason"] == "skipped" and s["steps"] == 6 and s["skipped_steps"] == 5
    assert load_checkpoint(out)[1]["step"] == 5  # the state of the failing step is not written


def test_adjusted_settings_are_said_once_and_written_to_config_json(tmp_path, capsys):
    data = tmp_path / "shards"
    data.mkdir()
    write_shard(data / "a_train.bin", np.arange(4000) % 300)
    (data / "README.txt").write_text("about these shards")
    out = tmp_path / "r"
    assert main(["train", *TINY[:-2], "--warmup", "1000", "--steps", "2", "--data", str(data), "--out", str(out),
                 "--sample-tokens", "0"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("llmgpu: note: ")]
    assert len(notes) == 3, notes
    assert any("--warmup 1000 is longer than the run (2 steps)" in n for n in notes)
    assert any("README.txt" in n and ".bin file(s) only" in n for n in notes)
    assert any("vocabulary 256 becomes the data's 50257" in n for n in notes)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["notes"] == [n[len("llmgpu: note: "):] for n in notes]
    assert cfg["config"]["seq"] == 16 and cfg["model"]["vocab_size"] == 50257 and cfg["config"]["warmup"] == 1000
    assert read_log(out)[0]["notes"] == cfg["notes"]


def test_the_cpu_fallback_says_why_only_where_cupy_is_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMGPU_DEVICE", raising=False)  # the fallback is what --device auto does
    cfg = TrainConfig(**{**FAST, "device": "auto"}, steps=1)
    monkeypatch.setattr(backend, "gpu_unavailable_reason", lambda: "CuPy is installed but no CUDA device was found")
    fake_cupy = types.SimpleNamespace(ndarray=type("ndarray", (), {}))
    monkeypatch.setattr(backend, "cupy_module", lambda: fake_cupy)
    train(cfg, out=str(tmp_path / "a"))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no usable GPU, so this run trains on the CPU" in err[0], err
    assert "no CUDA device was found" in err[0]
    train(cfg, device="cpu", out=str(tmp_path / "b"))  # asked for the CPU: nothing to explain
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(backend, "cupy_module", lambda: None)  # no CuPy at all: the expected CPU set-up
    train(cfg, out=str(tmp_path / "c"))
    assert capsys.readouterr().err == ""
