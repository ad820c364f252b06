"""``llmgpu train --dtype fp8`` (issue 37, chapter 5b): bf16 storage and compute with the QKV and MLP GEMMs in FP8
(``FastOptions(fp8=--fp8-recipe)``) on the fast step, refused in one line wherever that cannot run (never bf16 in its
place), recorded in the run directory and the checkpoint, kept by a resume.

The FP8 step itself is the model's (``FastGPT``); here the plan is pretended to run on a GPU with FP8 tensor cores
(``fast_path_available`` and ``fp8_unavailable_reason`` answer yes) and the book GPT stands in for ``FastGPT``,
keeping the options it was built with, so a real run on NumPy shows what reaches the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from llmgpu.cli import _Parser, add_train_arguments, main
from llmgpu.model import GPT, FastOptions
from llmgpu.model.options import FP8_ONLY_GPT2
from llmgpu.train import ConfigError, TrainConfig, Trainer, read_log, resolve, train
from llmgpu.train import config as config_module
from llmgpu.train import plan as plan_module
from llmgpu.train import trainer as trainer_module
from llmgpu.train.checkpoint import load_checkpoint
from llmgpu.train.config import compute_dtype, fast_options, fp8_unavailable_reason

pytestmark = pytest.mark.ch7

FAST = dict(preset="tiny", device="cpu", batch=2, seq=32, lr=3e-3, warmup=2, eval_every=0, log_every=2,
            progress=False, sample_tokens=0, plot=False)
CLI = ["--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "32", "--eval-every", "0", "--sample-tokens",
       "0", "--no-plot", "--no-progress"]


# --------------------------------------------------------------------------- the flags


def test_cli_parses_dtype_fp8_and_the_recipe():
    p = add_train_arguments(_Parser(prog="llmgpu train"))
    a = vars(p.parse_args(["--dtype", "fp8", "--fp8-recipe", "delayed"]))
    cfg = TrainConfig(**a)
    assert (cfg.dtype, cfg.fp8_recipe) == ("fp8", "delayed")
    assert TrainConfig(**vars(p.parse_args(["--dtype", "fp8"]))).fp8_recipe is None  # resolve: current
    assert "fp8" in p.format_help() and "--fp8-recipe" in p.format_help()


@pytest.mark.parametrize("argv,needles", [
    (["--dtype", "fp8"], ["--dtype fp8 runs in the fast step only, unavailable here", "GPU path"]),  # no GPU here
    (["--dtype", "fp8", "--arch", "llama", "--preset", "llama-tiny"], [FP8_ONLY_GPT2, "not --arch llama's"]),
    (["--dtype", "fp8", "--no-fast"], ["--dtype fp8 runs in the fast step only: drop --no-fast"]),
    (["--dtype", "bf16", "--fp8-recipe", "delayed"], ["--fp8-recipe delayed sets the scaling of --dtype fp8's",
                                                      "this run's --dtype is bf16"]),
    (["--fp8-recipe", "current"], ["--fp8-recipe current", "this run's --dtype is fp32"]),  # the CPU's default dtype
    (["--fp8-recipe", "hybrid"], ["--fp8-recipe", "invalid choice", "hybrid"]),
    (["--dtype", "fp4"], ["--dtype", "invalid choice", "fp8"]),
])
def test_fp8_where_it_cannot_run_is_one_line(argv, needles, one_error_line):
    one_error_line(main(["train", *CLI, "--steps", "1", *argv]), *needles)


# --------------------------------------------------------------------------- the plan


@pytest.fixture
def fp8_gpu(monkeypatch):
    """Plans as on a GPU with the fast step and FP8 tensor cores (the plan is pure: any xp that is not NumPy is a GPU,
    and on NumPy the answers are pretended)."""
    yes = lambda xp, dtype, k=0: (True, "")  # noqa: E731
    monkeypatch.setattr(config_module, "fast_path_available", yes)
    monkeypatch.setattr(plan_module, "fast_path_available", yes)
    monkeypatch.setattr(config_module, "fp8_unavailable_reason", lambda xp: None)


def test_fp8_resolves_to_the_fast_step_in_bf16_with_fp8_options(fp8_gpu):
    gpu = object()
    c = resolve(TrainConfig(dtype="fp8"), gpu)
    assert (c.dtype, c.fp8_recipe, c.fast, c.graph, c.preset) == ("fp8", "current", True, True, "gpt2")
    assert compute_dtype(c.dtype) == "bf16" and fast_options(c) == FastOptions(fp8="current")
    d = resolve(TrainConfig(dtype="fp8", fp8_recipe="delayed", attention_kernel="ours"), gpu)
    assert fast_options(d) == FastOptions(attention_kernel="ours", fp8="delayed")
    for dtype in ("bf16", "fp16"):  # every other dtype: FP8 off, as before
        b = resolve(TrainConfig(dtype=dtype), gpu)
        assert b.fp8_recipe is None and fast_options(b).fp8 == "off" and compute_dtype(dtype) == dtype
    h = resolve(TrainConfig(dtype="fp8", fp8_recipe="delayed", fp8_history=64), gpu)
    assert fast_options(h) == FastOptions(fp8="delayed", fp8_history=64)
    assert fast_options(d).fp8_history == FastOptions().fp8_history  # not given: the default


@pytest.mark.parametrize("kw,needle", [
    (dict(dtype="fp8", fp8_history=32), "--fp8-history sets the amax history of --dtype fp8 --fp8-recipe delayed; "
                                        "this run's is --fp8-recipe current"),
    (dict(dtype="bf16", fp8_history=32), "this run's is --dtype bf16"),
    (dict(dtype="fp8", fp8_recipe="delayed", fp8_history=0), "--fp8-history must be >= 1, got 0"),
])
def test_fp8_history_outside_the_delayed_recipe_is_refused(fp8_gpu, kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        resolve(TrainConfig(**kw), object())


def test_cli_parses_fp8_history():
    p = add_train_arguments(_Parser(prog="llmgpu train"))
    cfg = TrainConfig(**vars(p.parse_args(["--dtype", "fp8", "--fp8-recipe", "delayed", "--fp8-history", "8"])))
    assert cfg.fp8_history == 8 and "--fp8-history" in p.format_help()


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(fp8_gpu, monkeypatch):
    monkeypatch.setattr(config_module, "fp8_unavailable_reason", lambda xp: "FP8 GEMMs need ...; A100 is sm_80")
    with pytest.raises(ConfigError, match="--dtype fp8: FP8 GEMMs need ...; A100 is sm_80"):
        resolve(TrainConfig(dtype="fp8"), object())
    resolve(TrainConfig(dtype="bf16"), object())  # bf16 does not ask


def test_fp8_unavailable_reason_without_a_gpu():
    assert "sm_89+" in fp8_unavailable_reason(np) and "none is in use" in fp8_unavailable_reason(np)


# --------------------------------------------------------------------------- a run


class _RecordingModel(GPT):
    """The book GPT in FastGPT's place: built in the dtype the trainer asks for, keeping the options it was given."""

    built: list = []

    def __init__(self, config, *, options=None, **kw):
        super().__init__(config, **kw)
        self.options = options
        _RecordingModel.built.append((options, kw["dtype"]))


@pytest.fixture
def recording(fp8_gpu, monkeypatch):
    monkeypatch.setattr(trainer_module, "fast_model_class", lambda mcfg: _RecordingModel)
    _RecordingModel.built.clear()
    return _RecordingModel.built


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_fp8_run_reaches_the_model_is_recorded_and_resumes_as_fp8(recipe, recording, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(**FAST, dtype="fp8", fp8_recipe=recipe, graph=False, steps=6, out=str(out))
    s = Trainer(cfg).run(stop_at=4)
    want = recipe or "current"
    assert s["steps"] == 4 and np.isfinite(s["train_loss"])
    assert recording == [(FastOptions(fp8=want), "bf16")]  # bf16 storage and compute, FP8 GEMMs by the options
    saved = json.loads((out / "config.json").read_text())["config"]
    assert (saved["dtype"], saved["fp8_recipe"], saved["fast"]) == ("fp8", want, True)
    run_line = next(r for r in read_log(out) if r["type"] == "run")
    assert run_line["config"]["dtype"] == "fp8"
    _, meta, _ = load_checkpoint(out)
    assert (meta["train_config"]["dtype"], meta["train_config"]["fp8_recipe"]) == ("fp8", want)
    assert meta["dtype"] == "bf16"  # the weights' dtype: what `llmgpu sample` builds its model in
    # the resume keeps fp8 and its recipe without being told, and the model gets the same options
    r = Trainer(TrainConfig(resume=str(out), progress=False))
    assert (r.cfg.dtype, r.cfg.fp8_recipe) == ("fp8", want)
    assert r.run()["steps"] == 6
    assert recording[-1] == (FastOptions(fp8=want), "bf16")
    with pytest.raises(ConfigError, match="--dtype bf16 .the run has fp8. cannot change"):
        Trainer(TrainConfig(resume=str(out), dtype="bf16", out=str(tmp_path / "b")), explicit={"resume", "dtype",
                                                                                              "out"})
    other = "current" if want == "delayed" else "delayed"
    with pytest.raises(ConfigError, match=f"--fp8-recipe {other} .the run has {want}. cannot change"):
        Trainer(TrainConfig(resume=str(out), dtype="fp8", fp8_recipe=other, out=str(tmp_path / "c")),
                explicit={"resume", "fp8_recipe", "out"})


def test_fp8_run_resumed_where_the_fast_step_is_missing_is_refused_not_bf16(recording, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(TrainConfig(**FAST, dtype="fp8", graph=False, steps=2, out=str(out)))
    monkeypatch.setattr(plan_module, "fast_path_available", lambda xp, dtype, k=0: (False, "no cuBLASLt here"))
    with pytest.raises(ConfigError, match="the checkpointed run trains with --dtype fp8, which runs in the fast step "
                                          "only, unavailable here: no cuBLASLt here"):
        Trainer(TrainConfig(resume=str(out), steps=4, progress=False))


def test_the_banner_names_the_fp8_gemms():
    from llmgpu.model import GPTConfig
    from llmgpu.train.report import run_banner

    c = TrainConfig(**FAST, dtype="fp8", fp8_recipe="delayed")
    line = run_banner(c, GPTConfig.preset("tiny"), 10**6, "bf16", 1, "GPU")
    assert "bf16 with FP8 QKV/MLP GEMMs (delayed scaling)" in line
    assert "FP8" not in run_banner(TrainConfig(**FAST, dtype="bf16"), GPTConfig.preset("tiny"), 10**6, "bf16", 1, "x")


# --------------------------------------------------------------------------- the recipe (tools/recipes/fp8_vs_bf16.sh)

REPO = Path(__file__).resolve().parents[1]


def test_compare_runs_names_the_fp8_run_and_its_recipe(recording, tmp_path, capsys):
    import runpy

    train(TrainConfig(**FAST, dtype="bf16", graph=False, steps=4, out=str(tmp_path / "bf16")))
    train(TrainConfig(**FAST, dtype="fp8", fp8_recipe="delayed", graph=False, steps=4, out=str(tmp_path / "fp8")))
    tool = runpy.run_path(str(REPO / "tools" / "recipes" / "compare_runs.py"), run_name="tool")
    js = tmp_path / "c.json"
    capsys.readouterr()
    assert tool["main"]([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--window", "2", "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    a, b = data[str(tmp_path / "bf16")], data[str(tmp_path / "fp8")]
    assert (a["dtype"], b["dtype"], b["fp8_recipe"]) == ("bf16", "fp8", "delayed") and "fp8_recipe" not in a
    assert a["train_time_s"] > 0 and b["train_time_s"] > 0 and b["max_gap_to_first"] >= 0
    assert f"{tmp_path / 'fp8'}: fp8 delayed, 4 steps" in capsys.readouterr().out


def test_the_recipe_trains_both_precisions_alike_and_compares_them(tmp_path):
    """The script's commands, recorded by a stand-in python3: per preset a bf16 and an fp8 run that differ in the dtype
    (and the fp8 recipe) alone, then compare_runs into benchmarks/results/ch5b/."""
    import os
    import subprocess

    log, fake = tmp_path / "calls.txt", tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CALLS"\ncase "$*" in *sysconfig*) echo /no/stdlib;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "CALLS": str(log), "FP8_RECIPE": "delayed"}
    res = subprocess.run(["bash", str(REPO / "tools" / "recipes" / "fp8_vs_bf16.sh"), str(tmp_path / "w"), "7",
                          "gpt2,d24"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    calls = [c for c in log.read_text().splitlines() if "sysconfig" not in c]
    assert calls[0].startswith("-m llmgpu prepare /no/stdlib/*.py") and "--tokenizer gpt2" in calls[0]
    runs = [c.split() for c in calls if c.startswith("-m llmgpu train")]
    assert len(runs) == 4
    flags = [dict(zip(r[3::2], r[4::2])) for r in [[x for x in c if x != "--fast" and not x.startswith("--no-")]
                                                   for c in runs]]
    assert [(f["--preset"], f["--dtype"]) for f in flags] == [("gpt2", "bf16"), ("gpt2", "fp8"), ("d24", "bf16"),
                                                             ("d24", "fp8")]
    assert all("--fast" in r for r in runs)
    assert [f.get("--fp8-recipe") for f in flags] == [None, "delayed", None, "delayed"]
    same = [{k: v for k, v in f.items() if k not in ("--dtype", "--fp8-recipe", "--out")} for f in flags]
    assert same[0] == same[1] and same[2] == same[3]  # the same data, seed, batch and steps
    assert (same[0]["--steps"], same[0]["--batch"], same[0]["--seq"], same[0]["--seed"]) == ("7", "16", "1024", "1337")
    compares = [c for c in calls if "compare_runs.py" in c]
    assert len(compares) == 2 and "benchmarks/results/ch5b/ch5b_fp8_vs_bf16_gpt2.json" in compares[0]
    assert f"{tmp_path / 'w'}/d24-bf16 {tmp_path / 'w'}/d24-fp8" in compares[1] and "ch5b_fp8_vs_bf16_d24.png" in \
        compares[1]
    assert "in all (presets gpt2,d24, 7 steps, B=16, T=1024)" in res.stdout


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_delayed_fp8_run_resumes_bit_for_bit(cp, tmp_path):
    """A delayed-scaling FP8 run stopped after 4 steps and resumed gives the uninterrupted run's losses bit for bit:
    the checkpoint keeps every amax history, its position and scale (meta.json's fp8_scaling)."""
    from test_fast_model import _losses, _need_fast  # tests/ is not a package

    _need_fast(cp)
    if reason := fp8_unavailable_reason(cp):
        pytest.skip(reason)
    kw = dict(device="gpu", preset="tiny", dtype="fp8", fp8_recipe="delayed", fp8_history=3, batch=4, seq=64, lr=3e-3,
              warmup=2, eval_every=0, log_every=1, progress=False, sample_tokens=0, plot=False, steps=8)
    Trainer(TrainConfig(**kw, out=str(tmp_path / "whole"))).run()
    Trainer(TrainConfig(**kw, out=str(tmp_path / "p"))).run(stop_at=4)
    _, meta, _ = load_checkpoint(tmp_path / "p")
    assert meta["fp8_scaling"]["primed"] and meta["fp8_scaling"]["history"] == 3
    Trainer(TrainConfig(resume=str(tmp_path / "p"), progress=False)).run()
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 8 and _losses(tmp_path / "p") == whole
