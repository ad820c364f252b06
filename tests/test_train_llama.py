"""``llmgpu train --arch llama`` (issue 36): the Llama book step on the trainer's defaults, data, resume, sampling,
evaluation and data-parallel ranks; the combinations it cannot run refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dist_helpers import losses, needs_mpi, run_worker, train_cli

from llmgpu.cli import main
from llmgpu.model import GPT, GPTConfig, Llama, LlamaConfig, config_from_dict
from llmgpu.train import ConfigError, TrainConfig, Trainer, read_log, resolve, train
from llmgpu.train import config as config_module
from llmgpu.train import plan as plan_module
from llmgpu.train.checkpoint import load_checkpoint
from llmgpu.train.plan import SavedRun, plan_config
from llmgpu.train.sampling import load_for_sampling

pytestmark = pytest.mark.ch7

FAST = dict(arch="llama", device="cpu", batch=2, seq=32, lr=3e-3, warmup=2, eval_every=4, eval_batches=2,
            log_every=3, progress=False, sample_tokens=0, plot=False)
CLI = ["--arch", "llama", "--device", "cpu", "--batch", "2", "--seq", "16", "--eval-every", "0", "--quiet",
       "--no-plot", "--sample-tokens", "0"]


def _losses(out):
    return [(r["step"], r["loss"]) for r in read_log(out) if r["type"] == "train"]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A Llama trained 24 steps on the default data (the embedded corpus, bytes) with the CPU defaults' preset."""
    out = tmp_path_factory.mktemp("llama") / "run"
    summary = train(TrainConfig(**{**FAST, "batch": 4}, steps=24, out=str(out)))
    return out, summary


def test_llama_trains_on_the_default_data_and_says_so_everywhere(llama_run):
    out, s = llama_run
    assert s["steps"] == 24 and s["stop_reason"] == "steps"
    assert s["val_loss"] < s["first_val_loss"] - 1.0  # from ~ln(256) = 5.5 down
    _, meta, _ = load_checkpoint(out)
    assert meta["model_config"] == {**LlamaConfig.preset("llama-tiny").as_dict(), "pad_vocab_to": 0}
    assert meta["train_config"]["arch"] == "llama" and meta["train_config"]["preset"] == "llama-tiny"
    assert meta["train_config"]["fast"] is False and meta["train_config"]["graph"] is False
    assert meta["attention_kernels"] == {}  # the book step pins no kernel
    assert "model.layers.3.mlp.gate_proj.weight" in load_checkpoint(out)[0]
    run = next(r for r in read_log(out) if r["type"] == "run")
    assert run["model"]["arch"] == "llama" and run["config"]["arch"] == "llama"
    assert json.loads((out / "config.json").read_text())["model"]["arch"] == "llama"
    # MFU and FLOPs from the Llama's own formula, not GPT-2's
    t = Trainer(TrainConfig(resume=str(out), progress=False))
    assert isinstance(t.model, Llama) and t.flops_per_token == t.model.config.flops_per_token(32)
    assert t.flops_per_token != GPTConfig.preset("tiny").flops_per_token(32)


def test_llama_sample_and_eval_of_the_run(llama_run, capsys):
    out, _ = llama_run
    model, tok, meta = load_for_sampling(out)
    assert isinstance(model, Llama) and tok.name == "bytes" and meta["step"] == 24
    weights = load_checkpoint(out)[0]
    np.testing.assert_array_equal(model.state_dict()["model.layers.0.self_attn.k_proj.weight"],
                                  weights["model.layers.0.self_attn.k_proj.weight"])
    capsys.readouterr()
    assert main(["sample", "--from", str(out), "--prompt", "import", "--tokens", "12", "--device", "cpu",
                 "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import") and len(text.encode()) > len("import\n")
    assert main(["eval", "--from", str(out), "--data", "stdlib", "--device", "cpu", "--max-batches", "3", "--batch",
                 "4", "--seq", "32", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["batches"] == 3 and "(llama, step 24)" in res["model"]
    assert 0 < res["loss"] < 4.5  # the trained model, not a fresh one (~5.5)


def test_llama_resume_reproduces_the_uninterrupted_run(tmp_path):
    cfg = dict(**FAST, steps=8, grad_accum=2)
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(TrainConfig(**cfg, out=str(full))).run()
    assert Trainer(TrainConfig(**cfg, out=str(part))).run(stop_at=3)["steps"] == 3
    t = Trainer(TrainConfig(resume=str(part), progress=False))  # every setting from the checkpoint, arch included
    assert t.cfg.arch == "llama" and isinstance(t.model, Llama)
    t.run()
    a, b = _losses(full), _losses(part)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))
    assert a[:3] == b[:3]
    # as test_train's GPT-2 resume: NumPy's SIMD sums may round the last bit differently after a reload
    np.testing.assert_allclose([x for _, x in a], [x for _, x in b], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_llama_book_step_in_16_bits(tmp_path, dtype):
    out = tmp_path / dtype
    s = train(TrainConfig(**{**FAST, "eval_every": 0}, steps=4, dtype=dtype, checkpoint_every=2, out=str(out)))
    assert s["steps"] == 4 and np.isfinite(s["train_loss"])
    _, meta, _ = load_checkpoint(out)
    assert meta["dtype"] == dtype and meta["scaler"]["kind"] == ("dynamic" if dtype == "fp16" else "none")


# --------------------------------------------------------------------------- defaults and refusals


def test_llama_defaults_mirror_gpt2s():
    c = resolve(TrainConfig(arch="llama"), np)
    assert (c.preset, c.dtype, c.batch, c.seq, c.fast, c.graph) == ("llama-tiny", "fp32", 8, 128, False, False)
    assert resolve(TrainConfig(), np).preset == "tiny"  # GPT-2's default is untouched
    assert resolve(TrainConfig(arch="llama", preset="smollm-135m"), np).seq == 128


def test_on_a_gpu_llama_takes_the_fast_step_as_a_graph(tmp_path, monkeypatch):
    """Planned for a GPU where the fast step could run (pretended: the plan is pure, any non-NumPy xp is a GPU): a
    Llama takes the fast step as a graph in bf16, as GPT-2 does, with no note; its preset SmolLM-135M's."""
    monkeypatch.setattr(plan_module, "fast_path_available", lambda xp, dtype, k=0: (True, ""))
    monkeypatch.setattr(config_module, "fast_path_available", lambda xp, dtype, k=0: (True, ""))
    gpu = object()
    p = plan_config(TrainConfig(arch="llama", out=str(tmp_path / "l")), gpu)
    assert (p.cfg.preset, p.cfg.dtype, p.cfg.fast, p.cfg.graph, p.cfg.seq) == ("smollm-135m", "bf16", True, True,
                                                                               1024)
    assert not p.notes
    q = plan_config(TrainConfig(arch="llama", fast=False, out=str(tmp_path / "m")), gpu)
    assert (q.cfg.fast, q.cfg.graph, q.notes) == (False, False, ())
    # with the data's vocabulary, as GPT-2's presets take it
    m = plan_module.plan_model(p, data_vocab=50257, data_tokenizer="gpt2")
    assert isinstance(m.model_config, LlamaConfig) and m.model_config.vocab_size == 50257
    assert m.model_config.pad_vocab_to == 64 and m.model_config.n_layer == 30
    assert "smollm-135m preset's vocabulary 49152 becomes the data's 50257" in m.notes[-1]


@pytest.mark.parametrize("argv,needles", [
    (["--preset", "tiny"], ["--preset tiny is a gpt2 preset", "llama-tiny, smollm-135m, smollm-360m"]),
    (["--fast"], ["--fast: the fast model is a GPU path"]),  # this machine has no GPU (CI, the CPU tests)
    (["--graph"], ["--graph needs the fast model (--fast)"]),
    (["--fast", "--dtype", "bf16"], ["--fast: the fast model is a GPU path"]),
])
def test_llama_combinations_it_cannot_run_are_one_line(argv, needles, one_error_line):
    one_error_line(main(["train", *CLI, "--steps", "1", *argv]), *needles)


@pytest.mark.parametrize("argv,needles", [
    (["--preset", "llama-tiny"], ["--preset llama-tiny is a llama preset", "--arch llama", "tiny, d6, gpt2"]),
    (["--arch", "mamba"], ["invalid choice", "mamba"]),
])
def test_gpt2_with_a_llama_preset_or_an_unknown_arch_is_one_line(argv, needles, one_error_line):
    one_error_line(main(["train", "--device", "cpu", "--steps", "1", *argv]), *needles)


def test_resume_keeps_the_family(llama_run, tmp_path, capsys, one_error_line):
    out, _ = llama_run
    capsys.readouterr()
    one_error_line(main(["train", "--resume", str(out), "--arch", "gpt2", "--out", str(tmp_path / "x")]),
                   "--arch gpt2 (the run has llama) cannot change")
    with pytest.raises(ConfigError, match="--arch gpt2 .the run has llama. cannot change"):  # set explicitly: the
        Trainer(TrainConfig(resume=str(out), arch="gpt2", out=str(tmp_path / "y")), explicit={"arch", "resume", "out"})
    # through the API a field at its default counts as not given (config.resume_config): the run's family stays
    assert Trainer(TrainConfig(resume=str(out), arch="gpt2", out=str(tmp_path / "z"))).cfg.arch == "llama"


def test_meta_names_the_family_and_old_checkpoints_are_gpt2(llama_run):
    _, meta, _ = load_checkpoint(llama_run[0])
    saved = SavedRun.from_meta(llama_run[0], {**meta, "train_config": {k: v for k, v in meta["train_config"].items()
                                                                          if k != "arch"}})
    assert isinstance(saved.model_config, LlamaConfig) and saved.train_config.arch == "llama"
    gpt = {"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 256, "block_size": 32}  # before --arch: no "arch"
    assert config_from_dict(gpt) == GPTConfig(**gpt)
    old = SavedRun.from_meta(llama_run[0], {**meta, "model_config": gpt,
                                            "train_config": {**meta["train_config"], "arch": "gpt2", "preset": "tiny"}})
    assert isinstance(old.model_config, GPTConfig) and old.train_config.arch == "gpt2"
    with pytest.raises(ValueError, match="not a GPT-2 configuration"):  # a Llama's dict never reads as GPT-2's
        GPTConfig.from_dict(meta["model_config"])
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        config_from_dict({**gpt, "arch": "mamba"})


# --------------------------------------------------------------------------- data-parallel ranks (chapter 9)


def test_zero2_finds_the_llama_blocks():
    from llmgpu.dist import LocalComm, ZeroSync
    from llmgpu.optim.params import ALIGN

    cfg = LlamaConfig(n_layer=5, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=64, vocab_size=61, block_size=16)
    m = Llama(cfg, xp=np, param_multiple=ALIGN)
    sync = ZeroSync(LocalComm(np), m.params, stage=2, bucket_bytes=4096)
    assert sorted(set(sync._block_of.values())) == list(range(cfg.n_layer))  # one bucket per block
    gpt = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=61, block_size=16), xp=np, param_multiple=ALIGN)
    assert sorted(set(ZeroSync(LocalComm(np), gpt.params, stage=2)._block_of.values())) == [0, 1, 2]


@needs_mpi
@pytest.mark.parametrize("zero, accum", [(0, 2), (1, 1), (2, 2)])
def test_llama_ranks_match_one_rank_at_the_same_global_batch(zero, accum):
    """tests/workers/dist_step.py with a tiny Llama: 2 ranks against 1 at the same global batch (test_dist's check)."""
    p = run_worker(2, zero, accum, "llama")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["buckets"] > 2
    np.testing.assert_allclose(res["loss"], res["loss_ref"], rtol=0, atol=2e-6)
    np.testing.assert_allclose(res["norm"], res["norm_ref"], rtol=1e-5)
    assert res["max_dw"] < 1e-5 and min(res["norm_ref"]) > 0.05


@needs_mpi
def test_llama_train_nproc_2_zero_2_trains_like_one_rank(tmp_path):
    one = train_cli("--arch", "llama", "--steps", 3, "--grad-accum", 2, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-1500:]
    two = train_cli("--arch", "llama", "--nproc", 2, "--zero", 2, "--steps", 3, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-1500:]
    run = next(r for r in read_log(tmp_path / "two") if r["type"] == "run")
    assert run["model"]["arch"] == "llama" and run["config"]["zero"] == 2
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=2e-6)
    meta = json.loads((tmp_path / "two" / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["model_config"]["arch"] == "llama"
