"""Runs and checkpoints: --resume continues in its directory, refuses what it cannot apply, never loses a run;
damaged checkpoints are one line; a save killed at any point leaves the last complete checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from llmgpu.cli import main
from llmgpu.interop.safetensors import load_file, save_file
from llmgpu.train import ConfigError, TrainConfig, Trainer, read_log, resolve, rundir
from llmgpu.train import checkpoint as ck
from llmgpu.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint
from llmgpu.train.step import TrainStep

pytestmark = pytest.mark.ch7

TINY = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--eval-every", "0", "--quiet",
        "--no-plot", "--sample-tokens", "0"]
FAST = dict(preset="tiny", device="cpu", batch=2, seq=16, lr=3e-3, warmup=2, eval_every=0, log_every=2,
            progress=False, sample_tokens=0, plot=False)


def _train_steps(out):
    return [r["step"] for r in read_log(out) if r["type"] == "train"]


def _losses(out):
    return {r["step"]: r["loss"] for r in read_log(out) if r["type"] == "train"}


# --------------------------------------------------------------------------- --resume writes where the run is


def test_resume_continues_in_the_directory_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--steps", "3", "--out", "rA"]) == 0
    shutil.move("rA", "rB")
    assert main(["train", "--resume", "rB", "--steps", "6"]) == 0
    assert not Path("rA").exists()  # not re-created from the checkpoint's old --out
    assert load_checkpoint("rB")[1]["step"] == 6 and _train_steps("rB") == [1, 2, 3, 4, 5, 6]
    assert json.loads(Path("rB/summary.json").read_text())["steps"] == 6
    # a default run (runs/<timestamp>) resumed from elsewhere does not re-create runs/<timestamp>
    assert main(["train", *TINY, "--steps", "2"]) == 0
    (old,) = Path("runs").iterdir()
    shutil.move(str(old), "moved")
    Path("runs").rmdir()
    assert main(["train", "--resume", "moved/checkpoint", "--steps", "3"]) == 0  # the checkpoint dir works too
    assert not Path("runs").exists() and _train_steps("moved") == [1, 2, 3]


def test_resume_into_another_directory_starts_it_with_the_log_so_far(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(TrainConfig(**FAST, steps=6, out=str(a))).run(stop_at=3)
    Trainer(TrainConfig(resume=str(a), out=str(b))).run()
    assert _train_steps(a) == [1, 2, 3] and load_checkpoint(a)[1]["step"] == 3  # the source is left alone
    assert _train_steps(b) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ConfigError, match="already holds a run"):  # and the target must not be another run
        Trainer(TrainConfig(resume=str(a), out=str(b)))


def test_resume_cuts_the_log_back_to_the_checkpoint(tmp_path):
    """A run killed after its last save logged steps the resume does again: they are not counted twice."""
    out = tmp_path / "r"
    Trainer(TrainConfig(**FAST, steps=6, out=str(out))).run(stop_at=2)
    shutil.copytree(out / "checkpoint", tmp_path / "at2")
    Trainer(TrainConfig(resume=str(out))).run(stop_at=4)
    first = _losses(out)
    shutil.rmtree(out / "checkpoint")
    shutil.copytree(tmp_path / "at2", out / "checkpoint")  # as if killed at step 4 with the step-2 checkpoint
    Trainer(TrainConfig(resume=str(out))).run()
    assert _train_steps(out) == [1, 2, 3, 4, 5, 6]
    again = _losses(out)
    np.testing.assert_allclose([again[s] for s in (3, 4)], [first[s] for s in (3, 4)], rtol=1e-6, atol=0)


@pytest.mark.parametrize("flag,value", [("--preset", "d6"), ("--dtype", "fp16"), ("--seq", "8"), ("--batch", "4"),
                                        ("--seed", "1"), ("--data", "x.txt"), ("--weight-decay", "0.2")])
def test_resume_refuses_flags_it_cannot_apply(tmp_path, capsys, flag, value, one_error_line):
    out = str(tmp_path / "r")
    assert main(["train", *TINY, "--steps", "2", "--out", out]) == 0
    capsys.readouterr()
    one_error_line(main(["train", "--resume", out, flag, value]), flag, "cannot change", "--steps")
    # the run's own value, the flags a resume takes (length, schedule, cadence) and presentation all work
    assert main(["train", "--resume", out, "--steps", "4", "--lr", "1e-3", "--warmup", "1", "--log-every", "1",
                 "--batch", "2", "--quiet"]) == 0
    assert load_checkpoint(out)[1]["step"] == 4


def test_resume_api_refuses_changed_settings(tmp_path):
    out = str(tmp_path / "r")
    Trainer(TrainConfig(**FAST, steps=3, out=out)).run(stop_at=1)
    with pytest.raises(ConfigError, match="--preset d6 .the run has tiny. cannot change"):
        Trainer(TrainConfig(resume=out, preset="d6"))
    with pytest.raises(ConfigError, match="--val-data x.txt .the run has the default. cannot change"):  # not None
        Trainer(TrainConfig(resume=out, val_data="x.txt"))
    t = Trainer(TrainConfig(resume=out, steps=5, log_every=1))  # what it may change it takes
    assert (t.total_steps, t.cfg.log_every, t.cfg.seq) == (5, 1, 16)


# --------------------------------------------------------------------------- --out, --overwrite, exit codes


def test_out_of_an_existing_run_is_refused_unless_overwrite(tmp_path, capsys, one_error_line):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    one_error_line(main(["train", *TINY, "--steps", "2", "--out", str(out)]), "already holds a run",
                    "--resume", "--overwrite")
    assert load_checkpoint(out)[1]["step"] == 3  # untouched
    (out / "keep.txt").write_text("mine")
    assert main(["train", *TINY, "--steps", "2", "--out", str(out), "--overwrite"]) == 0
    assert load_checkpoint(out)[1]["step"] == 2 and _train_steps(out) == [1, 2]
    assert (out / "keep.txt").read_text() == "mine"  # only the run's own files are replaced


def test_out_of_a_run_without_checkpoint_or_below_a_file_says_what_works(tmp_path, capsys, one_error_line):
    """A run that saved nothing (killed in its first step) was answered 'continue it with --resume', which then
    found no checkpoint; an --out below a file failed after the set-up with only 'Not a directory'."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "config.json").write_text("{}")  # what a run writes first
    one_error_line(main(["train", *TINY, "--steps", "2", "--out", str(out)]),
                   "already holds a run that saved no checkpoint: give --overwrite")
    (tmp_path / "afile").write_text("x")
    one_error_line(main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "afile" / "sub")]),
                   f"{tmp_path / 'afile'} is a file, not a directory")
    assert main(["train", *TINY, "--steps", "1", "--out", str(out), "--overwrite"]) == 0


def test_flags_the_run_leaves_unused_get_a_note(tmp_path, capsys):
    """--prompt without a sample, --eval-batches without validation, --min-lr-ratio on a constant schedule and
    --attention-kernel on the book step were taken without a word."""
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r"), "--sample-tokens", "0", "--prompt",
                 "hi", "--top-k", "5", "--eval-every", "0", "--eval-batches", "3", "--schedule", "constant",
                 "--min-lr-ratio", "0.5", "--attention-kernel", "cudnn"]) == 0
    err = capsys.readouterr().err
    assert "llmgpu: note: --prompt, --top-k unused: there is no end-of-run sample (--sample-tokens 0)" in err
    assert "llmgpu: note: --eval-batches unused: no validation runs (--eval-every 0)" in err
    assert "llmgpu: note: --min-lr-ratio unused: a constant schedule does not decay" in err
    assert "llmgpu: note: --attention-kernel unused: it chooses the fast step's attention" in err
    assert main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "s")]) == 0
    assert "unused" not in capsys.readouterr().err


def test_output_errors_exit_2_with_one_line(tmp_path, capsys, one_error_line):
    f = tmp_path / "afile"
    f.write_text("x")
    one_error_line(main(["train", *TINY, "--steps", "1", "--out", str(f)]), "not a directory")
    # an OSError while writing (here: a file where a directory must go) is one line and exit 2 too
    one_error_line(main(["train", *TINY, "--steps", "1", "--warmup", "1", "--out", str(f / "sub")]),
                    str(f / "sub"))


def test_ctrl_c_saves_says_where_and_exits_130(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    real = Trainer.train_step

    def step(self, lr):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self, lr)

    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(["train", *TINY, "--steps", "6", "--warmup", "1", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted at step 3" in err[0] and str(out / "checkpoint") in err[0], err
    assert f"--resume {out}" in err[0]
    assert load_checkpoint(out)[1]["step"] == 3
    monkeypatch.setattr(Trainer, "train_step", real)
    assert main(["train", "--resume", str(out)]) == 0
    assert _train_steps(out) == [1, 2, 3, 4, 5, 6]


def _signal_during_step(monkeypatch, at_step: int, signals: int):
    """Send this process ``signals`` SIGINTs from inside step ``at_step``, after its batches are drawn and before
    its update: where a real Ctrl-C lands most of the time."""
    real, calls = TrainStep.__call__, [0]

    def call(self, batches, lr):
        calls[0] += 1
        if calls[0] == at_step:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGINT)
        return real(self, batches, lr)

    monkeypatch.setattr(TrainStep, "__call__", call)
    return real


def test_a_signal_during_a_step_stops_after_that_step_and_resume_continues_exactly(tmp_path, monkeypatch, capsys):
    """The first Ctrl-C is deferred to the end of the step it lands in: the checkpoint holds that whole step, with
    the data position after its batches, so the resumed run sees the batches the uninterrupted run saw."""
    args = ["train", *TINY, "--steps", "8", "--warmup", "1", "--log-every", "1"]
    assert main([*args, "--out", str(tmp_path / "full")]) == 0
    real = _signal_during_step(monkeypatch, 3, 1)
    out = tmp_path / "r"
    assert main([*args, "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted at step 3 (SIGINT)" in err[0], err
    meta = load_checkpoint(out)[1]
    ref = Trainer(TrainConfig(**{**FAST, "steps": 8, "warmup": 1, "out": str(tmp_path / "ref")}))
    ref.run(stop_at=3)
    assert meta["step"] == 3 and meta["data"] == load_checkpoint(tmp_path / "ref")[1]["data"]
    monkeypatch.setattr(TrainStep, "__call__", real)
    assert main(["train", "--resume", str(out)]) == 0
    full, resumed = _losses(tmp_path / "full"), _losses(out)
    assert sorted(resumed) == list(range(1, 9))
    np.testing.assert_allclose([resumed[k] for k in range(1, 9)], [full[k] for k in range(1, 9)], rtol=1e-6)


@pytest.mark.gpu
def test_gpu_a_signal_during_a_step_then_resume_gives_the_uninterrupted_losses_bit_for_bit(cp, tmp_path, monkeypatch):
    """The same on the GPU's default (fast, CUDA-graph) step, whose kernels fix their reduction order: bit for bit."""
    base = {**FAST, "device": "gpu", "dtype": "bf16", "batch": 4, "seq": 64, "steps": 10, "log_every": 1}
    Trainer(TrainConfig(**base, out=str(tmp_path / "full"))).run()
    real = _signal_during_step(monkeypatch, 4, 1)
    s = Trainer(TrainConfig(**base, out=str(tmp_path / "r"))).run()
    assert (s["stop_reason"], s["steps"], load_checkpoint(tmp_path / "r")[1]["step"]) == ("interrupted", 4, 4)
    monkeypatch.setattr(TrainStep, "__call__", real)
    Trainer(TrainConfig(resume=str(tmp_path / "r"), progress=False)).run()
    assert _losses(tmp_path / "r") == _losses(tmp_path / "full")


def test_a_second_signal_in_the_middle_of_a_step_saves_nothing_and_keeps_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                            capsys):
    """A second Ctrl-C stops at once; in the middle of a step the state is half updated (the data cursor moved, AdamW
    partly applied), so the checkpoint of step 2 stays and the run says so."""
    real = _signal_during_step(monkeypatch, 3, 2)
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "6", "--warmup", "1", "--save-every", "2", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in the middle of step 3" in err[0] and "nothing saved" in err[0], err
    assert str(out / "checkpoint") in err[0] and f"--resume {out}" in err[0]
    assert load_checkpoint(out)[1]["step"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["unfinished_step"], summary["signal"]) == (2, 3, "SIGINT")
    monkeypatch.setattr(TrainStep, "__call__", real)
    assert main(["train", "--resume", str(out)]) == 0
    assert _train_steps(out) == [1, 2, 3, 4, 5, 6]


def test_a_trainer_stopped_halfway_through_a_step_refuses_to_save(tmp_path, monkeypatch):
    t = Trainer(TrainConfig(**{**FAST, "steps": 4, "out": str(tmp_path / "r")}))
    monkeypatch.setattr(TrainStep, "__call__", lambda self, batches, lr: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        t.train_step(1e-3)
    with pytest.raises(RuntimeError, match="step 1 was stopped halfway"):
        t.save()


# --------------------------------------------------------------------------- the model's block size


def test_seq_beyond_the_block_size_needs_block_size(tmp_path, capsys, one_error_line):
    with pytest.raises(ConfigError, match="--seq 256 exceeds the model's block size 128.*--block-size 256"):
        resolve(TrainConfig(seq=256), np)
    assert resolve(TrainConfig(block_size=64), np).seq == 64  # the default seq never outgrows the model
    t = Trainer(TrainConfig(**{**FAST, "seq": 160}, block_size=160, steps=1, out=str(tmp_path / "b")))
    assert t.model.config.block_size == 160
    assert Trainer(TrainConfig(**FAST, steps=1, out=str(tmp_path / "c"))).model.config.block_size == 128
    capsys.readouterr()
    one_error_line(main(["train", *TINY[:6], "--seq", "200", "--steps", "1"]), "--seq 200", "--block-size")


# --------------------------------------------------------------------------- damaged checkpoints


def _damage(ckpt: Path, how: str) -> str:
    """Damage a checkpoint directory; returns the file the error must name."""
    if how == "truncated":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
        return "model.safetensors"
    if how == "missing-model":
        (ckpt / "model.safetensors").unlink()
        return "model.safetensors"
    if how == "garbage-model":
        (ckpt / "model.safetensors").write_bytes(b"not a safetensors file at all")
        return "model.safetensors"
    if how == "meta-json":
        (ckpt / "meta.json").write_text("{not json")
        return "meta.json"
    if how == "format":
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["format"] = "something-else"
        (ckpt / "meta.json").write_text(json.dumps(meta))
        return "meta.json"
    if how == "meta-list":
        (ckpt / "meta.json").write_text("[1, 2]")
        return "meta.json"
    if how == "missing-optim":
        (ckpt / "optim.npz").unlink()
        return "optim.npz"
    if how == "wrong-shapes":
        z = load_file(ckpt / "model.safetensors")
        z["transformer.wte.weight"] = z["transformer.wte.weight"][:, :7]
        save_file(ckpt / "model.safetensors", z)
        return str(ckpt)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "missing-model", "garbage-model", "meta-json", "format", "meta-list",
                                 "missing-optim", "wrong-shapes"])
def test_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, how, one_error_line):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    name = _damage(out / "checkpoint", how)
    one_error_line(main(["train", "--resume", str(out), "--steps", "3"]), name)
    if how != "missing-optim":  # sampling needs no optimizer state
        one_error_line(main(["sample", "--from", str(out), "--tokens", "2", "--device", "cpu"]), name)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("writer", ["_save_weights", "_savez"])
def test_a_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch, writer):
    d = tmp_path / "ck"
    w1 = {"a": np.arange(6, dtype=np.float32)}
    save_checkpoint(d, model=w1, meta={"step": 1, "model_config": {}})
    real = getattr(ck, writer)

    def full_disk(path, arrays):
        real(path, arrays)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(ck, writer, full_disk)
    second = dict(model={"a": np.zeros(6, np.float32)}, meta={"step": 2, "model_config": {}},
                  optim={"m/a": np.zeros(6, np.float32)})
    with pytest.raises(CheckpointError, match=f"saving a checkpoint to {d} failed .No space left on device: "
                                              f"{d}.tmp/.*; the checkpoint already in {d} is kept"):
        save_checkpoint(d, **second)
    model, meta, _ = load_checkpoint(d)
    assert meta["step"] == 1 and np.array_equal(model["a"], w1["a"])
    assert not (tmp_path / "ck.tmp").exists()  # the partial copy is removed
    with pytest.raises(CheckpointError, match="; no earlier checkpoint exists"):
        save_checkpoint(tmp_path / "first", **second)
    assert not (tmp_path / "first").exists() and not (tmp_path / "first.tmp").exists()


def test_checkpoint_weights_are_safetensors_and_old_npz_checkpoints_still_load(tmp_path):
    out = tmp_path / "r"
    Trainer(TrainConfig(**FAST, steps=2, out=str(out))).run()
    ckpt = out / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model.safetensors", "optim.npz"]
    weights = load_file(ckpt / "model.safetensors")
    assert all(a.dtype == np.float32 for a in weights.values())
    assert weights["transformer.h.0.attn.c_attn.weight"].shape == (3 * 128, 128)  # nanoGPT's [out, in]
    # the checkpoint of an earlier version: the same weights in model.npz, format 1
    with open(ckpt / "model.npz", "wb") as f:
        np.savez(f, **weights)
    (ckpt / "model.safetensors").unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": "llmgpu-checkpoint-1"}))
    assert ck.model_file(ckpt).name == "model.npz"
    model, meta, _ = load_checkpoint(out)
    assert meta["step"] == 2 and all(np.array_equal(model[k], weights[k]) for k in weights)
    t = Trainer(TrainConfig(resume=str(out), steps=3))
    t.run()
    assert load_checkpoint(out)[1]["step"] == 3 and (ckpt / "model.safetensors").is_file()


# A training run whose checkpoint save at step 4 is slowed at one point (the file being written, or between the
# two renames), so the test can SIGKILL it there.
_CHILD = textwrap.dedent("""
    import os, sys, time
    from llmgpu.train import TrainConfig, Trainer, checkpoint as ck, trainer
    point, out = sys.argv[1], sys.argv[2]
    saves = {"n": 0}
    real_save, real_savez, real_replace = trainer.save_checkpoint, ck._savez, os.replace

    def save(*a, **k):
        saves["n"] += 1
        return real_save(*a, **k)

    def stall(what):
        print("killme", what, flush=True)
        time.sleep(600)

    def savez(path, arrays):
        if point == "writing" and saves["n"] == 2:
            with open(path, "wb") as f:
                f.write(b"PK\\x03\\x04 half a file")
            stall(path)
        real_savez(path, arrays)

    def replace(src, dst):
        real_replace(src, dst)
        if point == "swapping" and saves["n"] == 2 and str(dst).endswith(".old"):
            stall(dst)

    trainer.save_checkpoint, ck._savez, os.replace = save, savez, replace
    Trainer(TrainConfig(preset="tiny", device="cpu", batch=2, seq=16, warmup=2, eval_every=0, log_every=1,
                        save_every=2, steps=6, progress=False, sample_tokens=0, plot=False, out=out)).run()
""")


@pytest.mark.parametrize("point", ["writing", "swapping"])
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path, point):
    out = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, point, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()  # blocks until the child stalls inside its second save (step 4)
        assert line.startswith("killme"), line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    logged = _losses(out)
    assert sorted(logged) == [1, 2, 3, 4]  # the killed run got to step 4
    expected = {"writing": out / "checkpoint", "swapping": out / "checkpoint.old"}[point]
    assert find_checkpoint(out) == expected
    assert load_checkpoint(out)[1]["step"] == 2  # the last complete checkpoint
    t = Trainer(TrainConfig(resume=str(out)))
    assert t.step == 2
    t.run()
    assert _train_steps(out) == [1, 2, 3, 4, 5, 6]
    again = _losses(out)
    np.testing.assert_allclose([again[s] for s in (3, 4)], [logged[s] for s in (3, 4)], rtol=1e-6, atol=0)
    assert find_checkpoint(out) == out / "checkpoint" and load_checkpoint(out)[1]["step"] == 6
    assert not (out / "checkpoint.old").exists() and not (out / "checkpoint.tmp").exists()


def test_checkpoint_errors_name_the_file(tmp_path):
    d = tmp_path / "ck"
    save_checkpoint(d, model={"a": np.ones(3, np.float32)}, meta={"step": 1, "model_config": {}})
    (d / "meta.json").write_text(json.dumps({"format": ck.FORMAT}))
    with pytest.raises(CheckpointError, match="meta.json lacks model_config, step"):
        load_checkpoint(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="incomplete.*model.safetensors is missing"):
        load_checkpoint(d)


def test_a_checkpoint_outside_a_run_directory_needs_out(tmp_path):
    Trainer(TrainConfig(**FAST, steps=4, out=str(tmp_path / "r"))).run(stop_at=2)
    shutil.copytree(tmp_path / "r" / "checkpoint", tmp_path / "saved")
    with pytest.raises(ConfigError, match="outside a run directory: give --out"):
        Trainer(TrainConfig(resume=str(tmp_path / "saved")))
    Trainer(TrainConfig(resume=str(tmp_path / "saved"), out=str(tmp_path / "new"))).run()
    assert load_checkpoint(tmp_path / "new")[1]["step"] == 4 and _train_steps(tmp_path / "new") == [3, 4]


def test_overwrite_is_never_inherited_from_the_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(TrainConfig(**FAST, steps=4, out=str(b))).run()
    Trainer(TrainConfig(**FAST, steps=4, overwrite=True, out=str(a))).run(stop_at=2)
    with pytest.raises(ConfigError, match="already holds a run"):  # --overwrite was the first run's, not this one's
        Trainer(TrainConfig(resume=str(a), out=str(b)))


@pytest.mark.parametrize("saved_world, world, accum, says", [
    (2, 1, 1, "32 tokens per step (it had 64; --grad-accum 2 keeps that)"),  # batch 2 x seq 16 a rank
    (2, 1, 2, "64 tokens per step (as before)"),
    (1, 2, 1, "64 tokens per step (it had 32, which no --grad-accum gives with --batch 2 on 2 rank(s))"),
    (2, 3, 1, "96 tokens per step (it had 64, which no --grad-accum gives with --batch 2 on 3 rank(s))"),
])  # fmt: skip
def test_a_resume_on_another_rank_count_says_whether_grad_accum_keeps_the_tokens_per_step(tmp_path, saved_world,
                                                                                        world, accum, says):
    """The note promised "--grad-accum keeps it" also where no --grad-accum can (fewer tokens were saved than one
    micro-batch over the new ranks holds), and --batch cannot change on a resume."""
    from llmgpu.train import plan as plan_module
    from llmgpu.train.plan import SavedRun, plan_config

    Trainer(TrainConfig(**FAST, steps=1, out=str(tmp_path / "r"))).run()
    meta = {**load_checkpoint(tmp_path / "r")[1], "world_size": saved_world}
    saved = SavedRun.from_meta(tmp_path / "r" / "checkpoint", meta)
    p = plan_config(TrainConfig(resume=str(tmp_path / "r"), grad_accum=accum), np, saved=saved)
    m = plan_module.plan_model(p, data_vocab=256, data_tokenizer="bytes", saved=saved, world_size=world)
    assert any(f"saved on {saved_world} rank(s) and continues on {world}: {says}" in n for n in m.notes), m.notes


# --------------------------------------------------------------------------- metadata of the wrong type

@pytest.mark.parametrize("key,value", [
    ("step", "2"), ("step", 2.0), ("step", True), ("step", None), ("step", -3), ("total_steps", "4"),
    ("total_steps", 0), ("world_size", "1"), ("budget_fitted", "no"), ("tokenizer", 5), ("dtype", ["fp32"]),
    ("model_config", "tiny"), ("train_config", [1]), ("optimizer", 1), ("scaler", "x"), ("data", []), ("rng", "x"),
    ("train_config.batch", "2"), ("train_config.steps", 2.5), ("train_config.seed", True),
])  # fmt: skip
def test_resume_metadata_of_the_wrong_type_is_one_line_naming_the_file(tmp_path, capsys, key, value, one_error_line):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    meta_file = out / "checkpoint" / "meta.json"
    meta = json.loads(meta_file.read_text())
    where, _, field = key.partition(".")
    (meta[where] if field else meta)[field or key] = value
    meta_file.write_text(json.dumps(meta))
    one_error_line(main(["train", "--resume", str(out), "--steps", "3"]), str(meta_file), field or key)
    if not field:  # llmgpu sample reads the same metadata (not the training configuration)
        one_error_line(main(["sample", "--from", str(out), "--tokens", "2", "--device", "cpu"]), str(meta_file), key)


@pytest.mark.parametrize("vocab", [300, 255])
def test_a_model_configuration_edited_to_another_vocabulary_is_refused_not_zero_padded(tmp_path, capsys, vocab,
                                                                                      one_error_line):
    """256 tokens trained, meta.json edited to 300: the 44 new tokens would get zero embeddings, as if trained.
    Edited to 255: the last trained token's row would be cut off as padding. Both refused, naming the weights."""
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    meta_file = out / "checkpoint" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model_config"]["vocab_size"] = vocab
    meta_file.write_text(json.dumps(meta))
    for command in (["sample", "--from", str(out), "--tokens", "2", "--device", "cpu"],
                    ["export", "--from", str(out), "--to", str(tmp_path / "hf")],
                    ["train", "--resume", str(out), "--steps", "2"]):
        one_error_line(main(command), str(out / "checkpoint"), "transformer.wte.weight")


# --------------------------------------------------------------------------- one writer; a finished run stays

def test_run_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path, capsys):
    out = tmp_path / "r"
    with rundir.run_lock(out):
        owner = json.loads((out / rundir.LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["host"]
        with pytest.raises(ConfigError, match=rf"{out} is being written by another llmgpu process \(pid {os.getpid()}"):
            with rundir.run_lock(out):
                pass
        rundir.refuse_if_in_use(out)  # this process's own lock: the set-up check leaves it to run_lock
    assert not (out / rundir.LOCK_FILE).exists()  # released: nothing left behind
    (out / rundir.LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone", "since": "then"}))
    notes = []
    with rundir.run_lock(out, notes):
        assert json.loads((out / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(notes) == 1 and "took over" in notes[0] and "pid 999999999 on gone" in notes[0]
    assert f"llmgpu: note: {notes[0]}" in capsys.readouterr().err
    with rundir.run_lock(out, enabled=False):  # ranks other than 0
        assert not (out / rundir.LOCK_FILE).exists()


def test_a_run_another_process_writes_before_its_first_checkpoint_is_named_as_such(tmp_path, one_error_line):
    """Before its first checkpoint a running run holds none: a --resume says that another process writes it, and
    sample/eval/export --from say that it has no checkpoint yet because of that, not only that it holds none."""
    out = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "llmgpu", "train", *TINY, "--steps", "1000000", "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / rundir.LOCK_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and not (out / "checkpoint").exists(), "the run never started, or saved already"
        one_error_line(main(["train", "--resume", str(out)]), f"pid {proc.pid}", "being written")
        text = tmp_path / "held-out.txt"
        text.write_text("some held-out text " * 50)
        for command in (["sample", "--from", str(out)], ["eval", "--from", str(out), "--data", str(text)],
                        ["export", "--from", str(out), "--to", str(tmp_path / "hf")]):
            one_error_line(main(command), f"{out} holds no checkpoint yet", f"another llmgpu process writes that run "
                           f"(pid {proc.pid}", "--save-every")
    finally:
        proc.kill()
        proc.wait(timeout=60)
    one_error_line(main(["sample", "--from", str(out)]), f"{out} holds no llmgpu checkpoint")  # its writer is gone


def test_a_second_process_on_a_running_run_is_refused_and_a_killed_ones_lock_taken_over(tmp_path, capsys,
                                                                                         one_error_line):
    """Two processes: the first resumes a run for (nearly) ever; a second --resume, or a new run with --overwrite
    into the same directory, is one line naming the first's pid and writes nothing. Once the first is killed
    (SIGKILL leaves its run.lock behind), a resume takes the lock over with a note."""
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "llmgpu", "train", "--resume", str(out), "--steps", "1000000",
                             "--log-every", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / rundir.LOCK_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and (out / rundir.LOCK_FILE).exists(), "the first run never took its lock"
        one_error_line(main(["train", "--resume", str(out), "--steps", "5"]), f"pid {proc.pid}", "being written")
        one_error_line(main(["train", *TINY, "--steps", "2", "--out", str(out), "--overwrite"]), f"pid {proc.pid}")
        assert (out / "checkpoint").is_dir() and proc.poll() is None  # neither touched the run nor stopped it
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert (out / rundir.LOCK_FILE).exists()  # SIGKILL: no clean-up ran
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 0
    assert f"took over {out / rundir.LOCK_FILE}" in capsys.readouterr().err
    assert not (out / rundir.LOCK_FILE).exists() and load_checkpoint(out)[1]["step"] == 4
    notes = json.loads((out / "config.json").read_text())["notes"]
    assert any(f"pid {proc.pid}" in n for n in notes)


def test_resuming_a_finished_run_leaves_it_as_it_was(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "3", "--eval-every", "2", "--sample-tokens", "4", "--out", str(out)]) == 0
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    saved = json.loads((out / "summary.json").read_text())
    assert saved["first_val_loss"] is not None and saved["train_loss"] is not None
    capsys.readouterr()
    for extra, needle in (([], "has done its 3 steps"), (["--steps", "3"], "has done its 3 steps"),
                          (["--steps", "2"], "is at step 3, past --steps 2")):
        assert main(["train", "--resume", str(out), *extra]) == 0
        err = capsys.readouterr().err
        assert needle in err and "nothing to train" in err and "Traceback" not in err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # not a byte changed
    s = Trainer(TrainConfig(resume=str(out))).run()
    assert {k: v for k, v in s.items() if k != "notes"} == {k: v for k, v in saved.items() if k not in ("notes",
                                                                                                    "sample")}
    # stopped between its last checkpoint and its summary: it finishes now, the figures from its log
    (out / "summary.json").unlink()
    assert main(["train", "--resume", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    for k in ("steps", "stop_reason", "first_val_loss", "val_loss", "train_loss", "tokens", "skipped_steps"):
        assert again[k] == saved[k], k


def test_a_checkpoint_of_step_0_resumes(tmp_path):
    """A run stopped before its first step saved a checkpoint of step 0: --resume continues it (it used to be
    taken for a new run and refused as 'already holds a run')."""
    out = tmp_path / "r"
    s = Trainer(TrainConfig(**FAST, steps=3, out=str(out))).run(stop_at=0)
    assert s["steps"] == 0 and load_checkpoint(out)[1]["step"] == 0
    assert Trainer(TrainConfig(resume=str(out))).run()["steps"] == 3
    assert _train_steps(out) == [1, 2, 3]
