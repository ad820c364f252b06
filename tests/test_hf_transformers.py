"""Hugging Face ``transformers`` itself, both ways: a random ``GPT2LMHeadModel`` saved with ``save_pretrained``
imports with the same logits, and ``llmgpu export`` writes a directory ``from_pretrained`` loads with the same
logits. Needs ``transformers`` and PyTorch (present on the GPU machine, not in CI): skipped with the reason
where they are missing. The fp32 comparisons run on the CPU; one more compares on the GPU (marked ``gpu``).
"""

from __future__ import annotations

import numpy as np
import pytest

import llmgpu
from llmgpu import backend
from llmgpu.interop import hf

pytestmark = pytest.mark.ch7

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the GPU machine has it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (the GPU machine has it)")

SIZES = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=65, n_positions=16)


def random_hf_model(seed=0, **kw):
    """A GPT2LMHeadModel with every tensor random (LayerNorms and biases too), no dropout, eval mode."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(**{**SIZES, **kw}, activation_function="gelu_new", resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def hf_logits(m, idx: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return m(torch.from_numpy(idx.astype(np.int64))).logits.float().numpy()


@pytest.fixture
def idx():
    return np.random.default_rng(0).integers(0, SIZES["vocab_size"], (3, SIZES["n_positions"])).astype(np.int32)


@pytest.mark.parametrize("safe", [True, False], ids=["model.safetensors", "pytorch_model.bin"])
def test_save_pretrained_imports_with_the_same_logits(tmp_path, idx, safe):
    m = random_hf_model()
    if safe:
        m.save_pretrained(tmp_path / "hf")
    else:  # what older transformers versions wrote (newer ones may no longer offer safe_serialization=False)
        m.config.save_pretrained(tmp_path / "hf")
        torch.save(m.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    ours = llmgpu.from_pretrained(tmp_path / "hf", dtype="fp32", xp=np)
    np.testing.assert_allclose(ours.forward(idx)[0], hf_logits(m, idx), rtol=1e-4, atol=1e-4)


def test_export_loads_in_transformers_with_the_same_logits(tmp_path, idx):
    m = random_hf_model(seed=1)
    m.save_pretrained(tmp_path / "hf")
    ours = llmgpu.from_pretrained(tmp_path / "hf", dtype="fp32", xp=np)
    hf.export_hf(tmp_path / "out", ours.config, ours.state_dict())
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(hf_logits(back, idx), hf_logits(m, idx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hf_logits(back, idx), ours.forward(idx)[0], rtol=1e-4, atol=1e-4)


def test_a_padded_llmgpu_model_exports_unpadded(tmp_path, idx):
    cfg = llmgpu.model.GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16, pad_vocab_to=64)
    ours = llmgpu.model.GPT(cfg, xp=np, seed=3)
    hf.export_hf(tmp_path / "out", cfg, ours.state_dict())
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert back.config.vocab_size == 65
    np.testing.assert_allclose(hf_logits(back, idx), ours.forward(idx)[0], rtol=1e-4, atol=1e-4)


def test_refused_architectures_are_refused(tmp_path):
    random_hf_model(scale_attn_by_inverse_layer_idx=True).save_pretrained(tmp_path / "a")
    with pytest.raises(hf.InteropError, match="scale_attn_by_inverse_layer_idx"):
        llmgpu.from_pretrained(tmp_path / "a", xp=np)
    m = random_hf_model(tie_word_embeddings=False)
    m.save_pretrained(tmp_path / "b")
    with pytest.raises(hf.InteropError, match="untied|tie_word_embeddings"):
        llmgpu.from_pretrained(tmp_path / "b", xp=np)


@pytest.mark.gpu
def test_imported_model_on_the_gpu(tmp_path, idx, cp):
    m = random_hf_model(seed=2)
    m.save_pretrained(tmp_path / "hf")
    ours = llmgpu.from_pretrained(tmp_path / "hf", dtype="fp32", xp=cp)
    got = backend.to_numpy(ours.forward(cp.asarray(idx))[0])
    np.testing.assert_allclose(got, hf_logits(m, idx), rtol=1e-3, atol=1e-3)  # fp32 GEMMs may use TF32
