"""``llmgpu train --init PATH``: a new run from trained weights (a Hugging Face directory or an llmgpu run),
their shape, vocabulary and block size, fine-tuning defaults where the user set nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llmgpu
from llmgpu.cli import main
from llmgpu.interop import hf
from llmgpu.model import GPT, GPTConfig
from llmgpu.train import ConfigError, TrainConfig, Trainer, resolve
from llmgpu.train.checkpoint import CheckpointError, load_checkpoint
from llmgpu.train.config import CPU_DEFAULTS, FINETUNE_DEFAULTS

pytestmark = pytest.mark.ch7

BYTES = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)  # reads the embedded corpus
RUN = dict(device="cpu", batch=2, seq=16, eval_every=0, progress=False, sample_tokens=0, plot=False)
FLAGS = ["--device", "cpu", "--batch", "2", "--seq", "16", "--eval-every", "0", "--quiet", "--no-plot",
         "--sample-tokens", "0", "--steps", "1"]


@pytest.fixture
def hf_dir(tmp_path):
    m = GPT(BYTES, xp=np, seed=5)
    return hf.export_hf(tmp_path / "hf", BYTES, m.state_dict(), tokenizer="bytes")


def test_init_starts_a_new_run_from_the_weights_with_fine_tuning_defaults(tmp_path, hf_dir):
    t = Trainer(TrainConfig(init=str(hf_dir), steps=3, out=str(tmp_path / "r"), **RUN))
    assert t.step == 0 and t.model.config == BYTES
    start = llmgpu.from_pretrained(hf_dir, xp=np).state_dict()
    assert all(np.array_equal(v, start[k]) for k, v in t.model.state_dict().items())
    assert t.cfg.lr == FINETUNE_DEFAULTS["lr"] != CPU_DEFAULTS["lr"]
    assert t.cfg.warmup == FINETUNE_DEFAULTS["warmup"] and t.cfg.preset is None and t.cfg.block_size == 16
    assert t.notes[0] == f"fine-tuning Hugging Face GPT-2 {hf_dir}: --lr 0.0001, --warmup 10 (fine-tuning defaults)"
    t.run()
    meta = load_checkpoint(tmp_path / "r")[1]
    assert meta["tokenizer"] == "bytes" and meta["train_config"]["init"] == str(hf_dir)
    # a fine-tuned run resumes like any other (its model is the checkpoint's, --init is not read again)
    r = Trainer(TrainConfig(resume=str(tmp_path / "r"), steps=4))
    assert r.init is None and r.step == 3 and r.cfg.lr == FINETUNE_DEFAULTS["lr"]
    r.run()
    assert load_checkpoint(tmp_path / "r")[1]["step"] == 4


def test_what_the_user_sets_wins_over_the_fine_tuning_defaults(tmp_path, hf_dir):
    t = Trainer(TrainConfig(init=str(hf_dir), lr=5e-4, steps=1, out=str(tmp_path / "r"), pad_vocab=64, **RUN))
    assert t.cfg.lr == 5e-4 and t.cfg.warmup == FINETUNE_DEFAULTS["warmup"]
    assert "--lr" not in t.notes[0] and "--warmup 10" in t.notes[0]
    assert t.model.config.padded_vocab_size == 256 and t.model.config.pad_vocab_to == 64


def test_init_from_an_llmgpu_run(tmp_path):
    Trainer(TrainConfig(preset="tiny", steps=2, out=str(tmp_path / "a"), **RUN)).run()
    t = Trainer(TrainConfig(init=str(tmp_path / "a"), steps=1, out=str(tmp_path / "b"), **RUN))
    before = llmgpu.from_pretrained(tmp_path / "a", xp=np).state_dict()
    assert all(np.array_equal(v, before[k]) for k, v in t.model.state_dict().items())
    assert "fine-tuning llmgpu run" in t.notes[0]


@pytest.mark.parametrize("extra, needles", [
    (["--preset", "tiny"], ["drop --preset tiny"]),
    (["--block-size", "32"], ["--block-size 32", "block_size 16"]),
    (["--vocab-size", "300"], ["--vocab-size 300", "vocab_size 256"]),
])  # fmt: skip
def test_init_keeps_the_weights_shape(tmp_path, hf_dir, extra, needles, one_error_line):
    one_error_line(main(["train", "--init", str(hf_dir), *FLAGS, "--out", str(tmp_path / "r"), *extra]), *needles)
    assert not (tmp_path / "r").exists()


def test_init_and_resume_do_not_mix(tmp_path, hf_dir, capsys, one_error_line):
    assert main(["train", "--init", str(hf_dir), *FLAGS, "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    one_error_line(main(["train", "--init", str(hf_dir), "--resume", str(tmp_path / "r")]), "--resume", "one of them")
    with pytest.raises(ConfigError, match="drop --preset"):
        resolve(TrainConfig(init="x", preset="tiny", block_size=16), np)


def test_init_refuses_data_of_another_tokenizer(tmp_path, one_error_line):
    gpt2_vocab = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=50257, block_size=16)
    d = hf.export_hf(tmp_path / "hf", gpt2_vocab, GPT(gpt2_vocab, xp=np).state_dict())  # no llmgpu.json tokenizer:
    (d / "llmgpu.json").unlink()  # a plain Hugging Face directory, GPT-2's vocabulary
    one_error_line(main(["train", "--init", str(d), *FLAGS, "--out", str(tmp_path / "r")]), "gpt2 tokens",
                   "bytes tokens", "llmgpu prepare")


def test_init_of_a_path_that_is_not_there(tmp_path, one_error_line):
    one_error_line(main(["train", "--init", str(tmp_path / "none"), *FLAGS]), "does not exist", "never downloads")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    one_error_line(main(["train", "--init", str(bad), *FLAGS]), "model_type 'mistral'")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_hugging_face_weights_are_one_line_everywhere(tmp_path, rng, bad, one_error_line):
    """--init of a Hugging Face directory whose weights hold inf/nan: one line naming the file and the tensor,
    before any run directory exists, as eval, sample and export say it."""
    m = GPT(BYTES, xp=np, seed=int(rng.integers(1000)))
    sd = m.state_dict()
    name = sorted(sd)[int(rng.integers(len(sd)))]
    sd[name] = sd[name].copy()
    sd[name].flat[int(rng.integers(sd[name].size))] = bad
    d = hf.export_hf(tmp_path / "hf", BYTES, sd, tokenizer="bytes")
    needles = [str(d / "model.safetensors"), "inf/nan", name]
    one_error_line(main(["train", "--init", str(d), *FLAGS, "--out", str(tmp_path / "r")]), *needles)
    assert not (tmp_path / "r").exists()
    one_error_line(main(["eval", "--from", str(d), "--data", str(d / "config.json"), "--device", "cpu", "--quiet"]),
                   *needles)
    one_error_line(main(["sample", "--from", str(d), "--device", "cpu", "--tokens", "2"]), *needles)
    one_error_line(main(["export", "--from", str(d), "--to", str(tmp_path / "x")]), *needles)
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match="inf/nan"):
        llmgpu.from_pretrained(d, xp=np)


def test_eval_json_replaces_only_an_earlier_result_and_writes_it_whole(tmp_path, hf_dir, one_error_line):
    """``eval --json`` pointed by mistake at the model's config.json or weights, or at the data, exited 0 having
    written the result over them (the model no longer loaded). It now writes a new file, or over an empty one or an
    earlier result, through a temporary file; anything else is refused before the evaluation, and left as it was."""
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    run = ["eval", "--from", str(hf_dir), "--data", str(data), "--device", "cpu", "--quiet", "--max-batches", "1"]
    for victim in (hf_dir / "config.json", hf_dir / "model.safetensors", data):
        before = victim.read_bytes()
        one_error_line(main([*run, "--json", str(victim)]), str(victim), "is not an earlier result of this command")
        assert victim.read_bytes() == before
    out = tmp_path / "eval.json"
    assert main([*run, "--json", str(out)]) == 0
    first = json.loads(out.read_text())
    assert main([*run, "--json", str(out)]) == 0  # an earlier result: replaced
    assert json.loads(out.read_text())["loss"] == first["loss"]
    (tmp_path / "empty.json").touch()
    assert main([*run, "--json", str(tmp_path / "empty.json")]) == 0
    assert json.loads((tmp_path / "empty.json").read_text())["loss"] == first["loss"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []
