"""``llmgpu train --dtype fp8`` (issue 37, chapter 5b): bf16 storage and compute with the QKV and MLP GEMMs in FP8
(``FastOptions(fp8=--fp8-recipe)``) on the fast step, refused in one line wherever that cannot run (never bf16 in its
place), recorded in the run directory and the checkpoint, kept by a resume.

The FP8 step itself is the model's (``FastGPT``); here the plan is pretended to run on a GPU with FP8 tensor cores
(``fast_path_available`` and ``fp8_unavailable_reason`` answer yes) and the book GPT stands in for ``FastGPT``,
keeping the options it was built with, so a real run on NumPy shows what reaches the model."""

from __future__ import annotations

import json

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
