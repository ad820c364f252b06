"""The PyTorch Llama of ``llmgpu bench`` (``torch_llama.py``, ``torch_reference.build_torch_llama``) against llmgpu's
``Llama`` and ``reference_logits`` (tests/test_llama.py: an independent float64 NumPy LlamaForCausalLM): logits, one
step's loss and every gradient, tied and untied, grouped K/V heads, a padded vocabulary, both SDPA paths; and
``llmgpu bench --arch llama`` on the CPU with its refusals. Tests needing PyTorch skip with the reason without it."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from test_llama import reference_logits, with_random_gains

from llmgpu import bench, bench_scale, torch_llama, torch_reference
from llmgpu.cli import main
from llmgpu.model import GPTConfig, Llama, LlamaConfig
from llmgpu.model.llama_config import EMBED, LM_HEAD, llama_param_shapes

pytestmark = pytest.mark.ch8

SMALL = dict(n_layer=2, n_head=4, n_embd=32, ffn_dim=40, vocab_size=45, block_size=16)
SHAPES = [  # (n_kv_head, tied, pad_vocab_to): grouped (2 query heads per K/V head), one K/V head, none grouped
    (2, False, 0), (2, True, 16), (1, True, 0), (4, False, 16)]


def _torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed: the reference model is not tested here")


def _llama(n_kv_head, tied, pad, seed=1):
    """An fp32 ``Llama`` with random norm gains too (the init's ones would hide a gain applied in the wrong place)."""
    m = Llama(LlamaConfig(**SMALL, n_kv_head=n_kv_head, tie_embeddings=tied, pad_vocab_to=pad), dtype="fp32",
              xp=np, seed=seed)
    return with_random_gains(m, seed + 7)


def _tokens(cfg, B=3, T=13, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2))


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "repeat_interleave"])
@pytest.mark.parametrize("n_kv_head, tied, pad", SHAPES)
def test_torch_llama_logits_equal_llmgpus_and_the_numpy_reference(n_kv_head, tied, pad, gqa, monkeypatch):
    torch = _torch_or_skip()
    if gqa and not torch_llama.sdpa_takes_gqa(torch):
        pytest.skip(f"torch {torch.__version__}'s SDPA takes no enable_gqa")
    monkeypatch.setattr(torch_llama, "_SDPA_GQA", gqa)
    m = _llama(n_kv_head, tied, pad)
    cfg = m.config
    idx, _ = _tokens(cfg)
    tm = torch_reference.build_torch_llama(cfg, state_dict=m.state_dict(), device="cpu", mask_padded=True)
    assert (tm.model.embed_tokens.weight is tm.lm_head.weight) == tied
    with torch.no_grad():
        got = tm(torch.from_numpy(idx.astype(np.int64))).numpy()
    assert got.shape == (3, 13, cfg.padded_vocab_size)
    ours = m.forward(idx)[0]
    ref = reference_logits(m.state_dict(unpadded=True), cfg, idx)
    assert _rel(got[..., : cfg.vocab_size], ours) <= 1e-5
    assert _rel(got[..., : cfg.vocab_size], ref) <= 1e-5
    if pad:  # the padded columns carry llmgpu's PAD_LOGIT (their head rows are zero)
        np.testing.assert_array_equal(got[..., cfg.vocab_size:], -1.0e4)


@pytest.mark.parametrize("n_kv_head, tied, pad", SHAPES)
def test_one_steps_loss_and_every_gradient_equal_llmgpus(n_kv_head, tied, pad):
    torch = _torch_or_skip()
    m = _llama(n_kv_head, tied, pad, seed=4)
    cfg = m.config
    idx, tgt = _tokens(cfg, seed=2)
    tm = torch_reference.build_torch_llama(cfg, state_dict=m.state_dict(unpadded=True), device="cpu",
                                           mask_padded=True)
    m.zero_grad()
    loss = float(m.forward_backward(idx, tgt))
    tl = tm(torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64)))
    tl.backward()
    assert float(tl.detach()) == pytest.approx(loss, rel=1e-5)
    theirs = {n: p.grad.numpy() for n, p in tm.named_parameters()}
    ours = m.grads()
    # the same parameters under the same names (a tied head: listed once, as the embedding, by both)
    assert sorted(theirs) == sorted(ours) == sorted(n for n in llama_param_shapes(cfg) if not (tied and n == LM_HEAD))
    V = cfg.vocab_size
    for name, g in ours.items():
        if name in (EMBED, LM_HEAD):  # the padded rows: no gradient on either side
            np.testing.assert_array_equal(theirs[name][V:], 0.0)
            np.testing.assert_array_equal(np.asarray(g)[V:], 0.0)
            g, t = np.asarray(g)[:V], theirs[name][:V]
        else:
            t = theirs[name]
        assert _rel(g, t) <= 1e-5, name


def test_torch_llama_init_follows_llmgpus_rule_and_trains():
    torch = _torch_or_skip()
    cfg = LlamaConfig(**{**SMALL, "n_layer": 3, "n_embd": 64}, n_kv_head=2, tie_embeddings=False)
    tm = torch_reference.build_torch_llama(cfg, device="cpu", seed=3)
    shapes = {n: tuple(p.shape) for n, p in tm.named_parameters()}
    assert shapes == {n: tuple(s) for n, s in llama_param_shapes(cfg).items()}
    ps = dict(tm.named_parameters())
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        assert float(ps[name].std()) == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.15), name
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight", LM_HEAD, EMBED):
        assert float(ps[name].std()) == pytest.approx(0.02, rel=0.15), name
    assert float(ps["model.norm.weight"].min()) == float(ps["model.norm.weight"].max()) == 1.0
    again = torch_reference.build_torch_llama(cfg, device="cpu", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(tm.parameters(), again.parameters()))  # one seed, one model
    r = torch_reference.run_torch(cfg, 2, 16, steps=2, mode="eager", warmup=1, dtype="fp32", device="cpu",
                                  checkpoint_every=2)
    assert r["arch"] == "llama" and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"])
    assert abs(r["final_loss"] - math.log(cfg.vocab_size)) < 1.0


def test_the_builders_refuse_the_other_family():
    _torch_or_skip()
    with pytest.raises(TypeError, match="takes a LlamaConfig"):
        torch_reference.build_torch_llama(GPTConfig.preset("tiny"), device="cpu")
    with pytest.raises(TypeError, match="takes a GPTConfig"):
        torch_reference.build_torch_gpt(LlamaConfig.preset("llama-tiny"), device="cpu")


# --------------------------------------------------------------------------- llmgpu bench --arch llama


def _args(**kw):
    ns = bench.add_arguments(argparse.ArgumentParser()).parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_bench_arch_llama_on_the_cpu_runs_its_modes_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.bench_main(_args(device="cpu", arch="llama", batch=2, seq=16, steps=1, warmup=0, json=str(out)))
    assert rc == 0
    text = capsys.readouterr().out
    assert "model: llama-tiny (llama:" in text and "2 K/V heads" in text
    data = json.loads(out.read_text())
    cfg = LlamaConfig.preset("llama-tiny", block_size=128, pad_vocab_to=64)
    assert data["arch"] == "llama" and data["preset"] == "llama-tiny" and data["model"] == cfg.as_dict()
    assert data["flops_per_token"] == cfg.flops_per_token(16)
    rows = data["results"]
    assert [r["mode"] for r in rows] == ["llmgpu", "llmgpu-fast", "torch-eager", "torch-compile"]
    for ours in rows[:2]:  # the book step and the fast step (FastLlama, eager on NumPy)
        assert ours["arch"] == "llama" and ours["tokens_per_s"] > 0 and ours["vocab"] == 256
        assert ours["mfu"] == pytest.approx(cfg.flops_per_token(16) * ours["tokens_per_s"]
                                            / (data["gemm_ceiling_tflops"] * 1e12))
        assert abs(ours["final_loss"] - math.log(256)) < 1.0
    try:
        import torch  # noqa: F401
    except ImportError:
        assert all(r.get("skipped") for r in rows[2:])
    else:  # the same vocabulary on both sides (the fair comparison), the same family
        for r in rows[2:]:
            assert r.get("arch") == "llama" and r["vocab"] == ours["vocab"] and r["tokens_per_s"] > 0, r


def test_bench_arch_from_the_preset_and_defaults():
    assert bench.bench_arch(_args()) == "gpt2"
    assert bench.bench_arch(_args(preset="smollm-360m")) == "llama"
    assert bench.bench_arch(_args(arch="llama")) == "llama"
    assert bench.bench_modes(_args(), "llama", gpu=True) == ["llmgpu", "llmgpu-fast-graph", "torch-eager",
                                                             "torch-compile"]
    assert bench.bench_modes(_args(), "gpt2", gpu=False) == ["llmgpu", "llmgpu-fast", "torch-eager", "torch-compile"]
    assert bench._defaults(_args(), True, "llama")["preset"] == "smollm-135m"
    assert bench._defaults(_args(), False, "llama")["preset"] == "llama-tiny"


@pytest.mark.parametrize("argv, needle", [
    (["--arch", "gpt2", "--preset", "smollm-135m"], "is a llama model, not --arch gpt2's"),
    (["--arch", "llama", "--preset", "gpt2"], "is a gpt2 model, not --arch llama's"),
    (["--arch", "llama", "--preset", "llama-huge"], "unknown Llama preset"),
    (["--arch", "llama", "--scale-table"], "the scale table is GPT-2's"),
    (["--arch", "llama", "--modes", "torch-jit"], "unknown mode"),
])
def test_bad_llama_bench_combinations_are_one_line(argv, needle, one_error_line):
    one_error_line(main(["bench", "--device", "cpu", *argv]), needle)


def test_the_llama_fast_step_trains_in_the_bench_and_the_scale_table_is_refused():
    step, model = bench.make_train_step(LlamaConfig.preset("llama-tiny"), 2, 8, dtype="fp32", xp=np, fast=True)
    assert type(model).__name__ == "FastLlama"
    first = float(step()[0])
    assert np.isfinite(first) and float(step()[0]) < first  # the same batch again: the loss falls
    with pytest.raises(ValueError, match="scale table is GPT-2's"):
        bench_scale.scale_main(_args(arch="llama", preset="llama-tiny", scale_table=True), np)


@pytest.mark.gpu
def test_gpu_pick_sdpa_backend_times_the_grouped_llama_attention(cp):
    torch = _torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    pick = torch_reference.pick_sdpa_backend(LlamaConfig.preset("smollm-135m"), 4, 1024)
    assert pick["backend"] in ("flash", "cudnn"), pick
    assert pick["ms"][pick["backend"]] == min(t for t in pick["ms"].values() if t is not None)
