"""The PyTorch Llama of ``llmgpu bench`` (``torch_llama.py``, ``torch_reference.build_torch_llama``) against llmgpu's
``Llama`` and ``reference_logits`` (tests/test_llama.py: an independent float64 NumPy LlamaForCausalLM): logits, one
step's loss and every gradient, tied and untied, grouped K/V heads, a padded vocabulary, both SDPA paths; and
``llmgpu bench --arch llama`` on the CPU with its refusals. Tests needing PyTorch skip with the reason without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_llama import reference_logits

from llmgpu import torch_llama, torch_reference
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
    rng = np.random.default_rng(seed + 7)
    sd = {n: np.array(a) for n, a in m.state_dict(unpadded=True).items()}
    for n, a in sd.items():
        if a.ndim == 1:
            sd[n] = (1.0 + 0.3 * rng.standard_normal(a.shape)).astype(np.float32)
    m.load_state_dict(sd)
    return m


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
