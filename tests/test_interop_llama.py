"""Hugging Face ``LlamaForCausalLM`` directories in and out (``interop/hf_llama.py``, ``train/pretrained.py``).

On the CPU without ``transformers``: directories written by hand (NumPy + llmgpu's safetensors writer, Hugging Face
names, single file and sharded) against ``reference_logits`` (tests/test_llama.py: an independent float64 NumPy
LlamaForCausalLM), our export read back bit for bit, every refusal one line. Where ``transformers`` and PyTorch are
installed (the GPU machine), ``transformers`` itself both ways; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
from dist_helpers import losses
from test_llama import reference_logits

import llmgpu
from llmgpu.cli import main
from llmgpu.interop import hf
from llmgpu.interop import safetensors as st
from llmgpu.interop.hf import InteropError
from llmgpu.interop.hf_llama import HF_DEFAULTS, llama_config_from_hf, llama_config_to_hf
from llmgpu.model import GPTConfig, Llama, LlamaConfig
from llmgpu.model.family import config_from_dict
from llmgpu.model.llama_config import EMBED, LM_HEAD, llama_param_shapes
from llmgpu.train import TrainConfig, Trainer
from llmgpu.train.checkpoint import save_checkpoint
from llmgpu.train.pretrained import load_pretrained

pytestmark = pytest.mark.ch7

# GQA (2 query heads per K/V head), a vocabulary that padding changes (37 -> 40), theta and eps not the defaults
CFG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_dim=24, vocab_size=37, block_size=16,
                  rope_theta=5000.0, norm_eps=1e-5, tie_embeddings=False)
HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 37, "hidden_size": 16,
             "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 16, "rope_theta": 5000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
             "tie_word_embeddings": False}


def random_weights(cfg: LlamaConfig, rng) -> dict:
    """Every tensor of ``cfg`` (Hugging Face names, unpadded), random norm gains included."""
    out = {}
    for name, shape in llama_param_shapes(replace(cfg, pad_vocab_to=0)).items():
        a = rng.standard_normal(shape).astype(np.float32)
        out[name] = (1.0 + 0.3 * a) if len(shape) == 1 else 0.3 * a
    return out


def random_model(cfg: LlamaConfig, rng) -> Llama:
    m = Llama(cfg, xp=np, init=False)
    m.load_state_dict(random_weights(cfg, rng))
    return m


def write_llama_dir(d, tensors: dict, config=None, shards: int = 1):
    """A Hugging Face Llama directory by hand: config.json, then model.safetensors or ``shards`` files + index."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(HF_CONFIG if config is None else config))
    if shards == 1:
        st.save_file(d / "model.safetensors", tensors, {"format": "pt"})
        return d
    names = sorted(tensors)
    parts = {f"model-{k + 1:05d}-of-{shards:05d}.safetensors": names[k::shards] for k in range(shards)}
    for f, ks in parts.items():
        st.save_file(d / f, {k: tensors[k] for k in ks}, {"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    return d


def _idx(rng, cfg=CFG, B=2, T=None):
    return rng.integers(0, cfg.vocab_size, (B, T or cfg.block_size)).astype(np.int32)


def assert_close_relative(got, want, rtol=1e-5):
    """|got - want| within rtol of want's largest magnitude (fp32 logits against the float64 reference)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())


# --------------------------------------------------------------------------- config.json


def test_config_maps_both_ways():
    assert llama_config_from_hf(HF_CONFIG) == CFG
    back = llama_config_to_hf(CFG)
    assert llama_config_from_hf(back) == CFG
    assert back["architectures"] == ["LlamaForCausalLM"] and back["torch_dtype"] == "float32"
    assert back["rope_scaling"] is None and back["head_dim"] == 4 and back["num_key_value_heads"] == 2
    assert back["bos_token_id"] is None and back["eos_token_id"] is None  # no tokenizer named: none known
    tied = replace(CFG, tie_embeddings=True, vocab_size=50304, pad_vocab_to=64)
    out = llama_config_to_hf(tied, tokenizer="gpt2")
    assert out["tie_word_embeddings"] is True and out["vocab_size"] == 50304 and out["eos_token_id"] == 50256
    assert llama_config_to_hf(CFG, bos_token_id=0, eos_token_id=[0, 7])["eos_token_id"] == [0, 7]  # kept as given


def test_what_config_json_leaves_out_means_transformers_defaults():
    """transformers' LlamaConfig defaults (HF_DEFAULTS): Llama 2 7B's shape, rms_norm_eps 1e-6, untied, one K/V
    head per query head when num_key_value_heads is absent."""
    assert llama_config_from_hf({"model_type": "llama"}) == LlamaConfig(
        n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, ffn_dim=11008, vocab_size=32000, block_size=2048,
        rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False)
    assert HF_DEFAULTS["rms_norm_eps"] == 1e-6 != LlamaConfig().norm_eps  # the reason the default is written down
    no_kv = {k: v for k, v in HF_CONFIG.items() if k != "num_key_value_heads"}
    assert llama_config_from_hf(no_kv).n_kv_head == 4


def test_smollm_135m_config_is_the_preset():
    """SmolLM-135M's config.json keys (Hugging Face hub, HuggingFaceTB/SmolLM-135M) give the smollm-135m preset."""
    smollm = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
              "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
              "tie_word_embeddings": True, "vocab_size": 49152, "hidden_act": "silu", "pretraining_tp": 1,
              "attention_bias": False, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16"}
    assert llama_config_from_hf(smollm) == LlamaConfig.preset("smollm-135m")


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "rope_theta": None},  # transformers 5
    {"rope_scaling": {"rope_type": "default"}},
    {"rope_scaling": {"type": "default"}},
    {"hidden_act": "swish"},
    {"pretraining_tp": 2},  # sliced GEMMs in transformers 4.3x, ignored later: the same function
    {"head_dim": 4},
    {"attention_dropout": 0.1},  # a training setting: inference has none
])  # fmt: skip
def test_spellings_of_the_same_model_are_accepted(change):
    c = {**HF_CONFIG, **change}
    if c.get("rope_theta") is None:
        del c["rope_theta"]
    assert llama_config_from_hf(c) == CFG


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not 'llama'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architecture LlamaForSequenceClassification"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling of rope_type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling of rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters of rope_type"),
    ({"rope_scaling": "llama3"}, "rope_scaling 'llama3' is not a JSON object"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"partial_rotary_factor": "1.0"}, "partial_rotary_factor '1.0' is not a number"),
    ({"attention_bias": True}, "attention_bias true: llmgpu's Llama has no biases"),
    ({"mlp_bias": True}, "mlp_bias true"),
    ({"attention_bias": "false"}, "attention_bias 'false' is not true or false"),  # a true value to Python
    ({"mlp_bias": 0}, "mlp_bias 0 is not true or false"),
    ({"head_dim": 8}, "head_dim 8"),
    ({"head_dim": "4"}, "head_dim '4' is not a whole number"),  # printed without quotes, it read as the right one
    ({"sliding_window": 4096}, "sliding_window 4096"),
    ({"num_key_value_heads": 3}, "not a usable Llama shape"),
    ({"hidden_size": 18}, "not a usable Llama shape"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps '1e-5'"),
    ({"rope_theta": -1.0}, "rope_theta -1.0"),
])  # fmt: skip
def test_configs_llama_does_not_compute_are_refused_in_one_line(change, needle):
    with pytest.raises(InteropError, match=needle.replace("(", r"\(")) as e:
        llama_config_from_hf({**HF_CONFIG, **change}, where="x/config.json")
    assert str(e.value).startswith("x/config.json: ") and "\n" not in str(e.value)


def test_config_from_dict_reads_either_family():
    assert config_from_dict(CFG.as_dict()) == CFG
    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
    assert config_from_dict(gpt.as_dict()) == gpt
    with pytest.raises(TypeError, match="is a dict"):
        config_from_dict(["llama"])


# --------------------------------------------------------------------------- import


@pytest.mark.parametrize("variant", ["single", "sharded", "tied", "tied+head+buffers", "bf16"])
def test_a_hand_written_directory_gives_the_reference_logits(tmp_path, rng, variant):
    cfg = replace(CFG, tie_embeddings=variant.startswith("tied"))
    t = random_weights(cfg, rng)
    if variant == "tied+head+buffers":  # what older versions saved: the tied head, RoPE's frequencies
        t[LM_HEAD] = t[EMBED].copy()
        for i in range(cfg.n_layer):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(cfg.head_dim // 2, np.float32)
    if variant == "bf16":  # how most hub checkpoints are stored: read and widened exactly
        t = {k: v.astype(llmgpu.backend.bfloat16) for k, v in t.items()}
    config = {**HF_CONFIG, "tie_word_embeddings": cfg.tie_embeddings}
    d = write_llama_dir(tmp_path / "hf", t, config, shards=3 if variant == "sharded" else 1)
    model = llmgpu.from_pretrained(d, xp=np)
    assert isinstance(model, Llama) and model.config == cfg
    idx = _idx(rng)
    want = reference_logits({k: np.asarray(v, np.float32) for k, v in t.items()}, cfg, idx)
    assert_close_relative(model.forward(idx)[0], want)
    pre = load_pretrained(d)
    assert pre.kind == "hf" and pre.tokenizer is None and pre.source == f"Hugging Face Llama {d}"


def test_the_reference_catches_a_swapped_projection(rng):
    """The check above can fail: gate and up have the same shape, so only the logits show them swapped."""
    t = random_weights(CFG, rng)
    idx = _idx(rng)
    want = reference_logits(t, CFG, idx)
    g, u = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    for weights, close in ((t, True), ({**t, g: t[u], u: t[g]}, False)):
        m = Llama(CFG, xp=np, init=False)
        m.load_state_dict(weights)
        got = m.forward(idx)[0]
        assert (np.abs(got - want).max() <= 1e-5 * np.abs(want).max()) == close


K0 = "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize("case, needle", [
    ("unknown", "unknown tensor 'model.layers.2.mlp.up_proj.weight'"),
    ("bias", "unknown tensor 'model.layers.0.self_attn.q_proj.bias'"),
    ("missing", "weight(s) missing, e.g. 'model.layers.1.mlp.down_proj.weight'"),
    ("shape", f"'{K0}' has shape (16, 16), the config makes it (8, 16)"),  # k_proj as if n_kv_head = n_head
    ("vocab", "'model.embed_tokens.weight' has shape (40, 16), the config makes it (37, 16)"),
    ("integer", "'model.norm.weight' holds int32, not floating-point"),
    ("untied-no-head", "tie_word_embeddings is false and there is no 'lm_head.weight'"),
    ("tied-other-head", "'lm_head.weight' differs from 'model.embed_tokens.weight'"),
])  # fmt: skip
def test_tensors_llama_does_not_compute_are_refused_in_one_line(tmp_path, rng, case, needle, capsys,
                                                                 one_error_line):
    t, config = random_weights(CFG, rng), dict(HF_CONFIG)
    if case == "unknown":
        t["model.layers.2.mlp.up_proj.weight"] = np.zeros((24, 16), np.float32)
    elif case == "bias":
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
    elif case == "missing":
        del t["model.layers.1.mlp.down_proj.weight"]
    elif case == "shape":
        t[K0] = np.zeros((16, 16), np.float32)
    elif case == "vocab":
        t[EMBED] = np.zeros((40, 16), np.float32)
    elif case == "integer":
        t["model.norm.weight"] = np.ones(16, np.int32)
    elif case == "untied-no-head":
        del t[LM_HEAD]
    else:
        config["tie_word_embeddings"] = True  # and lm_head.weight is another matrix
    d = write_llama_dir(tmp_path / "bad", t, config)
    with pytest.raises(InteropError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        llmgpu.from_pretrained(d, xp=np)
    assert str(d / "model.safetensors") in str(e.value) and "\n" not in str(e.value)
    capsys.readouterr()
    one_error_line(main(["eval", "--from", str(d), "--data", str(d / "config.json"), "--device", "cpu"]), needle)


def test_a_sharded_directory_is_named_by_the_directory(tmp_path, rng):
    t = random_weights(CFG, rng)
    del t[K0]
    d = write_llama_dir(tmp_path / "bad", t, shards=2)
    with pytest.raises(InteropError, match=f"^{d}: 1 weight\\(s\\) missing, e.g. '{K0}'$"):
        llmgpu.from_pretrained(d, xp=np)


def test_a_sharded_index_must_match_its_shards(tmp_path, rng):
    """A tensor copied into a second shard loaded silently (the later read won); the index naming a shard that does
    not hold a tensor, a tensor found elsewhere, or a weight_map of no file names were tracebacks."""
    t = random_weights(CFG, rng)
    good = write_llama_dir(tmp_path / "good", t, shards=2)
    index = json.loads((good / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))
    in_second = next(k for k, f in index["weight_map"].items() if f == second)

    def variant(name, edit_index=None, edit_shard=None):
        d = tmp_path / name
        shutil.copytree(good, d)
        if edit_shard:
            part = st.load_file(d / first)
            edit_shard(part)
            st.save_file(d / first, part, {"format": "pt"})
        if edit_index:
            idx = json.loads((d / "model.safetensors.index.json").read_text())
            edit_index(idx["weight_map"])
            (d / "model.safetensors.index.json").write_text(json.dumps(idx))
        return d

    twice = variant("twice", edit_shard=lambda part: part.update({in_second: t[in_second] + 1}))
    with pytest.raises(InteropError, match=f"'{re.escape(in_second)}' is stored twice, in {first} and in {second}"):
        llmgpu.from_pretrained(twice, xp=np)
    moved = variant("moved", edit_index=lambda wm: wm.update({in_second: first}))
    with pytest.raises(InteropError, match=f"puts '{re.escape(in_second)}' in {first}, but {second} holds it"):
        llmgpu.from_pretrained(moved, xp=np)
    ghost = variant("ghost", edit_index=lambda wm: wm.update({"model.extra.weight": first}))
    with pytest.raises(InteropError, match=r"names 1 tensor\(s\) that no shard holds \('model.extra.weight' in"):
        llmgpu.from_pretrained(ghost, xp=np)
    for i, bad in enumerate(({"a": 5}, {}, {"a": "../x.safetensors"}, ["a"])):
        d = variant(f"bad{i}")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(InteropError, match="its weight_map must be a non-empty JSON object from each tensor's "):
            llmgpu.from_pretrained(d, xp=np)


def test_a_llama_directory_loads_into_the_fast_step_too(tmp_path, rng):
    """fast=True: a FastLlama holding the same weights, whose logits are the book model's (fp64 on NumPy)."""
    d = write_llama_dir(tmp_path / "hf", random_weights(CFG, rng))
    book = llmgpu.from_pretrained(d, xp=np, dtype="fp64")
    fast = llmgpu.from_pretrained(d, xp=np, dtype="fp64", fast=True)
    assert type(fast).__name__ == "FastLlama"
    idx = rng.integers(0, CFG.vocab_size, (2, 7))
    np.testing.assert_allclose(fast.forward(idx)[0], book.forward(idx)[0], rtol=0, atol=1e-12)


def test_train_init_fine_tunes_a_hugging_face_llama(tmp_path, rng, capsys):
    """--init of a Llama directory trains a Llama (the family taken from the weights, book step), starting from those
    weights: its first loss is the directory's model's loss on that batch, and it falls."""
    cfg = replace(CFG, vocab_size=256, block_size=32)  # byte tokens: the embedded data's
    d = write_llama_dir(tmp_path / "hf", random_weights(cfg, rng),
                        {**HF_CONFIG, "vocab_size": 256, "max_position_embeddings": 32})
    out = tmp_path / "ft"
    rc = main(["train", "--init", str(d), "--device", "cpu", "--steps", "6", "--batch", "2", "--seq", "16",
               "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--no-progress", "--no-plot",
               "--lr", "1e-2", "--warmup", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert meta["model_config"]["arch"] == "llama" and meta["train_config"]["arch"] == "llama"
    loss = losses(out)
    assert len(loss) == 6 and loss[-1] < loss[0]
    assert 4.0 < loss[0] < 7.0  # a random model's loss on 256 tokens is about ln 256 = 5.5, not a trained one's
    capsys.readouterr()
    rc = main(["train", "--init", str(d), "--arch", "gpt2", "--device", "cpu", "--steps", "1", "--out",
               str(tmp_path / "x"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err  # an --arch the user gave that contradicts the weights: one line, nothing written
    assert rc != 0 and "holds a Llama model: drop --arch gpt2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    ft = Trainer(TrainConfig(init=str(d), arch="gpt2", device="cpu", steps=1, out=str(tmp_path / "y")))
    assert ft.cfg.arch == "llama"  # the API cannot tell gpt2, the default, from one set: the weights' family wins
    back = llmgpu.from_pretrained(out, xp=np)
    assert type(back).__name__ == "Llama"


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_back_bit_for_bit(tmp_path, rng, tied):
    cfg = replace(CFG, tie_embeddings=tied, pad_vocab_to=8)  # 37 -> 40 rows inside, 37 in the files
    m = random_model(cfg, rng)
    d = hf.export_hf(tmp_path / "x", cfg, m.state_dict(), tokenizer="bytes", info={"step": 7})
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "llmgpu.json", "model.safetensors"]
    tensors, meta, _ = st.read_header(d / "model.safetensors")
    assert meta == {"format": "pt"} and all(dt == np.float32 for dt, *_ in tensors.values())
    want = llama_param_shapes(replace(cfg, pad_vocab_to=0))
    assert {k: v[1] for k, v in tensors.items()} == want  # Hugging Face's names, unpadded; tied: no lm_head
    assert (LM_HEAD in tensors) == (not tied)
    config = json.loads((d / "config.json").read_text())
    assert llama_config_from_hf(config) == replace(cfg, pad_vocab_to=0)
    back = llmgpu.from_pretrained(d, xp=np)
    assert isinstance(back, Llama) and back.config == replace(cfg, pad_vocab_to=0)
    ours = m.state_dict(unpadded=True)
    theirs = back.state_dict()
    assert set(theirs) == set(ours)
    for name, w in theirs.items():
        assert w.dtype == ours[name].dtype and np.array_equal(w, ours[name]), name
    idx = _idx(rng)
    assert_close_relative(back.forward(idx)[0], reference_logits(ours, cfg, idx))
    pre = load_pretrained(d)
    assert pre.tokenizer == "bytes" and pre.meta["step"] == 7


def test_llmgpu_export_carries_a_hugging_face_llamas_special_tokens(tmp_path, rng, capsys):
    t = random_weights(CFG, rng)
    src = write_llama_dir(tmp_path / "src", t, {**HF_CONFIG, "bos_token_id": 1, "eos_token_id": [2, 3],
                                                "torch_dtype": "bfloat16", "rope_scaling": None})
    assert main(["export", "--from", str(src), "--to", str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "Llama" and report["from"] == f"Hugging Face Llama {src}"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == [2, 3]
    back = st.load_file(tmp_path / "out" / "model.safetensors")
    assert set(back) == set(t) and all(np.array_equal(back[k], t[k]) for k in t)


def test_an_llmgpu_llama_checkpoint_samples_evaluates_and_exports(tmp_path, rng, capsys):
    """A Llama run's checkpoint (as train --arch llama will write it: model_config with arch 'llama', padded rows):
    load_pretrained drops the padding, sample and eval read it, export writes a directory that reads back equal."""
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=16, ffn_dim=24, vocab_size=256, block_size=32,
                      tie_embeddings=False, pad_vocab_to=64)
    m = random_model(cfg, rng)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint", model={k: v for k, v in m.state_dict().items()},
                    meta={"model_config": cfg.as_dict(), "step": 3, "tokenizer": "bytes"})
    pre = load_pretrained(run)
    assert pre.config == cfg and pre.kind == "llmgpu" and pre.weights[LM_HEAD].shape == (256, 16)
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    back = llmgpu.from_pretrained(tmp_path / "hf", xp=np)
    for name, w in back.state_dict().items():
        assert np.array_equal(w, m.state_dict(unpadded=True)[name]), name
    for src in (run, tmp_path / "hf"):
        assert main(["sample", "--from", str(src), "--prompt", "def", "--tokens", "5", "--device", "cpu",
                     "--seed", "3"]) == 0
    a, b = capsys.readouterr().out.split("\n", 1)
    assert a.startswith("def") and b.startswith(a)  # the same 5 tokens from the run and from its export
    assert main(["eval", "--from", str(tmp_path / "hf"), "--data", "stdlib", "--device", "cpu",
                 "--max-batches", "1", "--seq", "32", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert '"loss"' in out and "Hugging Face Llama" in out


# --------------------------------------------------------------------------- transformers itself


@pytest.fixture
def transformers_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the GPU machine has it)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the GPU machine has it)")
    return transformers, torch


def _their_config(transformers, **change):
    """A transformers LlamaConfig of HF_CONFIG's values, ``change`` applied."""
    kw = {k: v for k, v in HF_CONFIG.items() if k not in ("model_type", "architectures")}
    return transformers.LlamaConfig(**{**kw, **change})


def _hf_logits(model, idx, torch) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(idx.astype(np.int64))).logits.double().numpy()


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_our_export_with_our_logits(tmp_path, rng, tied, transformers_torch):
    transformers, torch = transformers_torch
    cfg = replace(CFG, tie_embeddings=tied, pad_vocab_to=8)
    m = random_model(cfg, rng)
    hf.export_hf(tmp_path / "x", cfg, m.state_dict())
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "x").eval()
    assert theirs.config.num_key_value_heads == 2 and theirs.config.vocab_size == 37
    idx = _idx(rng)
    got = _hf_logits(theirs, idx, torch)
    assert_close_relative(got, m.forward(idx)[0].astype(np.float64))
    assert_close_relative(got, reference_logits(m.state_dict(unpadded=True), cfg, idx))


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_loads_into_ours_with_their_logits(tmp_path, rng, tied, transformers_torch):
    transformers, torch = transformers_torch
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = transformers.LlamaForCausalLM(_their_config(transformers, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # every tensor random, the norm gains too
            p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(tmp_path / "hf")
    ours = llmgpu.from_pretrained(tmp_path / "hf", dtype="fp32", xp=np)
    assert ours.config == replace(CFG, tie_embeddings=tied)
    idx = _idx(rng)
    assert_close_relative(ours.forward(idx)[0].astype(np.float64), _hf_logits(theirs, idx, torch))


def test_transformers_llama3_scaling_is_refused(tmp_path, transformers_torch):
    transformers, _ = transformers_torch
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    transformers.LlamaForCausalLM(_their_config(transformers, rope_scaling=scaling)).save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError, match="rope_type 'llama3'"):
        llmgpu.from_pretrained(tmp_path / "hf", xp=np)
