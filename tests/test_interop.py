"""Interop on the CPU: safetensors files, Hugging Face GPT-2 directories in and out, ``llmgpu export``.

Without ``transformers`` here, the Hugging Face side is checked against an independent NumPy forward pass
written in Hugging Face's conventions (``hf_logits``: Conv1D ``x @ W + b`` on the ``[in, out]`` tensors), so
a wrong transpose or name is a logits mismatch. ``tests/test_hf_transformers.py`` checks the same against
``transformers`` itself where it is installed.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import llmgpu
from llmgpu.cli import main
from llmgpu.interop import hf
from llmgpu.interop import safetensors as st
from llmgpu.interop.hf import InteropError
from llmgpu.model import GPT, GPTConfig
from llmgpu.ops.layernorm import layernorm_forward
from llmgpu.train import TrainConfig, Trainer
from llmgpu.train.checkpoint import CheckpointError, save_checkpoint
from llmgpu.train.pretrained import load_pretrained

pytestmark = pytest.mark.ch7

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
HF_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 65, "n_positions": 16,
             "n_ctx": 16, "n_embd": 32, "n_layer": 2, "n_head": 2, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5}


# --------------------------------------------------------------------------- an independent Hugging Face forward


def _ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def hf_logits(t: dict, c: dict, idx: np.ndarray) -> np.ndarray:
    """GPT2LMHeadModel's forward in float64 from Hugging Face tensors (``transformer.`` names, Conv1D layout)."""
    g = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in t.items()}
    B, T = idx.shape
    C, H = c["n_embd"], c["n_head"]
    x = g["wte.weight"][idx] + g["wpe.weight"][:T]
    mask = np.triu(np.ones((T, T), bool), 1)
    for i in range(c["n_layer"]):
        p = f"h.{i}."
        qkv = _ln(x, g[p + "ln_1.weight"], g[p + "ln_1.bias"]) @ g[p + "attn.c_attn.weight"] + g[p + "attn.c_attn.bias"]
        q, k, v = (a.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // H)
        s = np.where(mask, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        y = (s / s.sum(-1, keepdims=True)) @ v
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ g[p + "attn.c_proj.weight"] + g[p + "attn.c_proj.bias"]
        f = _ln(x, g[p + "ln_2.weight"], g[p + "ln_2.bias"]) @ g[p + "mlp.c_fc.weight"] + g[p + "mlp.c_fc.bias"]
        f = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f**3)))  # gelu_new
        x = x + f @ g[p + "mlp.c_proj.weight"] + g[p + "mlp.c_proj.bias"]
    x = _ln(x, g["ln_f.weight"], g["ln_f.bias"])
    return x @ g["wte.weight"].T


def random_hf_tensors(rng, c=HF_CONFIG, prefix="transformer.") -> dict:
    """Random GPT-2 tensors in Hugging Face layout (every tensor random, LayerNorms included)."""
    C, V, L = c["n_embd"], c["vocab_size"], c["n_layer"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (c["n_positions"], C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(L):
        shapes.update({f"h.{i}.{k}": s for k, s in {
            "ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
            "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
            "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
            "mlp.c_proj.bias": (C,)}.items()})  # fmt: skip
    out = {}
    for k, s in shapes.items():
        a = rng.standard_normal(s).astype(np.float32) * 0.2
        out[prefix + k] = (a + 1.0) if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else a
    return out


def write_hf_dir(d, tensors, config=HF_CONFIG, metadata=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    st.save_file(d / "model.safetensors", tensors, metadata or {"format": "pt"})
    return d


def _idx(rng, cfg=CFG, B=2):
    return rng.integers(0, cfg.vocab_size, (B, cfg.block_size)).astype(np.int32)


# --------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_and_layout(tmp_path, rng):
    arrays = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": np.arange(7, dtype=np.float16),
              "bf16": np.arange(4, dtype=np.float32).astype(llmgpu.backend.bfloat16),
              "i64": np.arange(6, dtype=np.int64).reshape(2, 3), "empty": np.zeros((0, 4), np.float32),
              "big_endian": np.arange(3, dtype=">f4")}
    p = st.save_file(tmp_path / "a.safetensors", arrays, {"format": "pt"})
    n = int.from_bytes(p.read_bytes()[:8], "little")
    assert (8 + n) % 8 == 0  # the data part starts aligned
    tensors, meta, _ = st.read_header(p)
    assert meta == {"format": "pt"} and tensors["bf16"][0] == llmgpu.backend.bfloat16
    back = st.load_file(p)
    for k, a in arrays.items():
        assert back[k].shape == a.shape and np.array_equal(back[k].astype(np.float64), a.astype(np.float64)), k
    assert back["big_endian"].dtype == np.dtype("<f4")


def test_safetensors_files_agree_with_the_safetensors_package(tmp_path, rng):
    ref = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
    arrays = {"w": rng.standard_normal((4, 6)).astype(np.float32), "h": np.arange(5, dtype=np.float16),
              "i": np.arange(3, dtype=np.int32)}
    st.save_file(tmp_path / "ours.safetensors", arrays, {"format": "pt"})
    theirs = ref.load_file(str(tmp_path / "ours.safetensors"))
    assert all(np.array_equal(theirs[k], arrays[k]) for k in arrays)
    ref.save_file(arrays, str(tmp_path / "theirs.safetensors"), metadata={"format": "np"})
    ours = st.load_file(tmp_path / "theirs.safetensors")
    assert all(np.array_equal(ours[k], arrays[k]) and ours[k].dtype == arrays[k].dtype for k in arrays)
    assert st.read_metadata(tmp_path / "theirs.safetensors") == {"format": "np"}


def test_safetensors_keeps_0d_tensors_as_shape_empty(tmp_path, rng):
    """A scalar (shape ()) stays a scalar: np.ascontiguousarray would have stored it as shape [1]."""
    x = float(rng.standard_normal())
    arrays = {"f32": np.array(x, np.float32), "np_scalar": np.float64(x), "i64": np.array(int(rng.integers(99)), ">i8"),
              "bf16": np.array(x, np.float32).astype(llmgpu.backend.bfloat16), "row": np.full((1,), x, np.float32)}
    p = st.save_file(tmp_path / "s.safetensors", arrays)
    assert {k: v[1] for k, v in st.read_header(p)[0].items()} == {"f32": (), "np_scalar": (), "i64": (), "bf16": (),
                                                                 "row": (1,)}
    back = st.load_file(p)
    for k, a in arrays.items():
        assert back[k].shape == np.shape(a) and back[k].dtype == np.dtype(a.dtype).newbyteorder("<"), k
        assert back[k].astype(np.float64) == np.asarray(a).astype(np.float64).reshape(back[k].shape), k
    ref = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
    assert {k: v.shape for k, v in ref.load_file(str(p)).items()}["f32"] == ()


@pytest.mark.parametrize("how", ["truncated", "longer", "garbage", "short", "json", "offsets", "dtype", "huge",
                                 "float-shape", "bool-shape"])
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path, how):
    p = st.save_file(tmp_path / "w.safetensors", {"a": np.ones(8, np.float32), "b": np.zeros(4, np.float32)})
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if how == "truncated":
        p.write_bytes(data[:-5])
    elif how == "longer":
        p.write_bytes(data + b"\0" * 4)
    elif how == "garbage":
        p.write_bytes(b"PK\x03\x04 this is a zip file, not safetensors")
    elif how == "short":
        p.write_bytes(b"\x01\x02")
    else:
        if how == "json":
            text = b"{not json" + b" " * (n - 9)
        else:
            if how == "offsets":
                header["b"]["data_offsets"] = [36, 52]  # a gap after a
            elif how == "huge":  # 2^64 elements of 0 bytes: an int64 product wrapped to 0, then np.empty failed
                header["b"]["shape"], header["b"]["data_offsets"] = [2**32, 2**32], [32, 32]
                header["a"]["data_offsets"] = [0, 32]
            elif how.endswith("shape"):  # read as 1 by int()
                header["a"]["shape"] = [8.0] if how == "float-shape" else [8, True]
            else:
                header["a"]["dtype"] = "F33"
            text = json.dumps(header).encode().ljust(n)
        body = data[8 + n:8 + n + 32] if how == "huge" else data[8 + n:]  # b holds no bytes: only a's are left
        p.write_bytes(len(text).to_bytes(8, "little") + text + body)
    with pytest.raises(st.SafetensorsError) as e:
        st.load_file(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- the configuration


def test_config_maps_both_ways_and_defaults_are_gpt2_small():
    assert hf.config_from_hf(HF_CONFIG) == CFG
    back = hf.config_to_hf(CFG, tokenizer="bytes")
    assert hf.config_from_hf(back) == CFG
    for k in ("model_type", "architectures", "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "vocab_size",
              "layer_norm_epsilon", "activation_function", "tie_word_embeddings"):
        assert k in back, k
    assert back["activation_function"] == "gelu_new" and back["tie_word_embeddings"] is True
    assert back["bos_token_id"] is None  # a 65-token vocabulary has no <|endoftext|>
    assert hf.config_to_hf(GPTConfig.preset("gpt2"), tokenizer="gpt2")["eos_token_id"] == 50256
    # what config.json leaves out means GPT2Config's default: a bare file is GPT-2 small
    assert hf.config_from_hf({"model_type": "gpt2"}) == GPTConfig.preset("gpt2")


def test_the_layernorm_epsilon_is_the_models():
    import inspect

    assert inspect.signature(layernorm_forward).parameters["eps"].default == hf.LAYER_NORM_EPSILON


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"model_type": None}, "model_type None"),
    ({"architectures": ["GPT2DoubleHeadsModel"]}, "architecture GPT2DoubleHeadsModel"),
    ({"architectures": 5}, 'architectures 5 is not a list of strings: write it as \\["GPT2LMHeadModel"\\]'),
    ({"architectures": "GPT2LMHeadModel"}, "architectures 'GPT2LMHeadModel' is not a list of strings"),
    ({"architectures": [5]}, "architectures \\[5\\] is not a list of strings"),
    ({"activation_function": "gelu"}, "activation_function 'gelu'"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"n_inner": 96}, "n_inner 96"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"n_head": 3}, "not a usable GPT-2 shape"),
    # wrong types are named as such, with their quotes ("false" read as true; "512" printed as 512)
    ({"add_cross_attention": "false"}, "add_cross_attention must be true or false, got 'false'"),
    ({"scale_attn_weights": "false"}, "scale_attn_weights must be true or false, got 'false'"),  # was accepted
    ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false, got 0"),
    ({"n_inner": "512"}, "n_inner '512'"),
    ({"n_inner": True}, "n_inner True"),
    ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon '1e-5'"),
])  # fmt: skip
def test_configs_llmgpu_does_not_compute_are_refused_in_one_line(change, needle):
    with pytest.raises(InteropError, match=needle) as e:
        hf.config_from_hf({**HF_CONFIG, **change}, where="x/config.json")
    assert str(e.value).startswith("x/config.json: ") and "\n" not in str(e.value)
    hf.config_from_hf({**HF_CONFIG, "activation_function": "gelu_pytorch_tanh", "n_inner": 128})  # the same model


# --------------------------------------------------------------------------- import


@pytest.mark.parametrize("variant", ["GPT2LMHeadModel", "GPT2Model", "buffers+tied-head", "fp16", "sharded"])
def test_import_gives_the_hugging_face_models_logits(tmp_path, rng, variant):
    t = random_hf_tensors(rng, prefix="" if variant == "GPT2Model" else "transformer.")
    d = tmp_path / "hf"
    if variant == "buffers+tied-head":  # what older transformers versions saved
        for i in range(2):
            t[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
            t[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
        t["lm_head.weight"] = t["transformer.wte.weight"].copy()
    if variant == "fp16":
        t = {k: v.astype(np.float16) for k, v in t.items()}
    if variant == "sharded":
        d.mkdir()
        (d / "config.json").write_text(json.dumps(HF_CONFIG))
        names = sorted(t)
        parts = {"model-00001-of-00002.safetensors": names[:9], "model-00002-of-00002.safetensors": names[9:]}
        for f, ks in parts.items():
            st.save_file(d / f, {k: t[k] for k in ks}, {"format": "pt"})
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    else:
        write_hf_dir(d, t)
    model = llmgpu.from_pretrained(d, xp=np)
    assert isinstance(model, GPT) and model.config == CFG
    idx = _idx(rng)
    want = hf_logits({k: v for k, v in t.items() if ".attn.bias" not in k and "masked" not in k}, HF_CONFIG, idx)
    got, _ = model.forward(idx)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    pre = load_pretrained(d)
    assert pre.kind == "hf" and pre.tokenizer is None  # a 65-token vocabulary is not GPT-2's


def test_a_missing_transpose_is_caught_by_the_logits(rng):
    """The check above can fail: attn.c_proj is square, so only the logits show a transpose left out."""
    t = random_hf_tensors(rng)
    good = hf.hf_to_nanogpt(t, CFG)
    bad = {**good, "transformer.h.1.attn.c_proj.weight": good["transformer.h.1.attn.c_proj.weight"].T}
    idx = _idx(rng)
    want = hf_logits(t, HF_CONFIG, idx)
    for weights, close in ((good, True), (bad, False)):
        model = GPT(CFG, xp=np, init=False)
        model.load_state_dict(weights)
        assert np.allclose(model.forward(idx)[0], want, rtol=2e-4, atol=2e-4) == close


FC = "transformer.h.0.mlp.c_fc.weight"


def _hf_dir_with(tmp_path, rng, change=None, config=None, drop=None, add=None):
    t = random_hf_tensors(rng)
    if drop:
        del t[drop]
    t.update(add or {})
    if change:
        t = change(t)
    return write_hf_dir(tmp_path / "bad", t, {**HF_CONFIG, **(config or {})})


@pytest.mark.parametrize("case, needle", [
    ("untied", "untied LM head"),
    ("untied-config", "tie_word_embeddings is false"),
    ("unknown", "unknown tensor 'transformer.h.5.attn.c_attn.weight'"),
    ("missing", "weight(s) missing, e.g. 'transformer.h.1.mlp.c_fc.bias'"),
    ("shape", "'transformer.h.0.mlp.c_fc.weight' has shape (128, 32), the config makes it (32, 128)"),
    ("integer", "holds int32, not floating-point"),
])  # fmt: skip
def test_layouts_llmgpu_does_not_compute_are_refused_in_one_line(tmp_path, rng, case, needle, capsys, one_error_line):
    kw = {
        "untied": dict(add={"lm_head.weight": rng.standard_normal((65, 32)).astype(np.float32)}),
        "untied-config": dict(config={"tie_word_embeddings": False}),
        "unknown": dict(add={"transformer.h.5.attn.c_attn.weight": np.zeros((32, 96), np.float32)}),
        "missing": dict(drop="transformer.h.1.mlp.c_fc.bias"),
        "shape": dict(change=lambda t: {**t, FC: t[FC].T}),
        "integer": dict(change=lambda t: {**t, "transformer.ln_f.bias": np.zeros(32, np.int32)}),
    }[case]
    d = _hf_dir_with(tmp_path, rng, **kw)
    with pytest.raises(InteropError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        llmgpu.from_pretrained(d, xp=np)
    assert str(d / "model.safetensors") in str(e.value)
    capsys.readouterr()
    one_error_line(main(["eval", "--from", str(d), "--data", str(d / "config.json"), "--device", "cpu"]), needle)


def test_paths_that_would_need_a_download_or_torch_say_so(tmp_path, rng, monkeypatch, capsys, one_error_line):
    with pytest.raises(CheckpointError, match="never downloads.*huggingface-cli download"):
        llmgpu.from_pretrained("openai-community/gpt2", xp=np)
    one_error_line(main(["sample", "--from", "gpt2", "--device", "cpu"]), "never downloads")
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02 a pickle")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # as on a machine without PyTorch
    with pytest.raises(InteropError, match="pytorch_model.bin is a PyTorch pickle, which needs PyTorch"):
        llmgpu.from_pretrained(d, xp=np)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(InteropError, match="holds no weights"):
        llmgpu.from_pretrained(d, xp=np)
    (d / "config.json").write_text("{not json")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(InteropError, match="config.json is not readable JSON"):
        llmgpu.from_pretrained(d, xp=np)
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(InteropError, match="model.safetensors is 0 bytes"):
        llmgpu.from_pretrained(d, xp=np)


# --------------------------------------------------------------------------- export


def _run(tmp_path, name="r", **kw):
    out = tmp_path / name
    cfg = dict(preset="tiny", device="cpu", batch=2, seq=16, steps=2, eval_every=0, progress=False, sample_tokens=0,
               plot=False, out=str(out))
    Trainer(TrainConfig(**{**cfg, **kw})).run()
    return out


def test_export_writes_what_transformers_reads(tmp_path, rng, capsys):
    m = GPT(GPTConfig(**{**CFG.as_dict(), "pad_vocab_to": 64}), xp=np, seed=1)  # 65 -> 128 rows inside
    m.params.data[:] += rng.standard_normal(m.params.data.size).astype(np.float32) * 0.05  # LayerNorms too
    d = hf.export_hf(tmp_path / "x", m.config, m.state_dict(), tokenizer="bytes", info={"step": 7})
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "llmgpu.json", "model.safetensors",
                                                   "nanogpt.safetensors"]
    tensors, meta, _ = st.read_header(d / "model.safetensors")
    assert meta == {"format": "pt"}  # transformers refuses a safetensors file without it
    assert all(dt == np.float32 for dt, *_ in tensors.values())
    shapes = {k: v[1] for k, v in tensors.items()}
    assert shapes["transformer.wte.weight"] == (65, 32)  # the unpadded vocabulary
    assert shapes["transformer.h.1.attn.c_attn.weight"] == (32, 96) and shapes["transformer.h.1.mlp.c_fc.weight"] \
        == (32, 128) and shapes["transformer.h.1.mlp.c_proj.weight"] == (128, 32)  # Conv1D [in, out]
    assert "lm_head.weight" not in shapes and len(shapes) == 4 + 12 * 2  # tied: left out, as save_pretrained does
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == 65 and config["n_positions"] == config["n_ctx"] == 16
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    raw = st.load_file(d / "nanogpt.safetensors")
    assert raw["transformer.h.0.mlp.c_fc.weight"].shape == (128, 32)  # nanoGPT's nn.Linear [out, in]
    # the Hugging Face file computes our model's function (an independent forward in Hugging Face's layout)
    idx = _idx(rng)
    np.testing.assert_allclose(hf_logits(st.load_file(d / "model.safetensors"), config, idx), m.forward(idx)[0],
                               rtol=2e-4, atol=2e-4)
    # and importing it gives the weights back bit for bit (without the vocabulary's padding rows), so the same
    # function: its logits agree to rounding, not to the bit, since the reloaded LM head has 65 columns instead of
    # 128 and BLAS may sum a matrix product of another width in another order (OpenBLAS 0.3.31 does)
    back = llmgpu.from_pretrained(d, xp=np)
    want = m.state_dict()
    for name, w in back.state_dict().items():
        assert np.array_equal(w, want[name][:len(w)]), name
    np.testing.assert_allclose(back.forward(idx)[0], m.forward(idx)[0], rtol=1e-5, atol=1e-6)
    assert load_pretrained(d).tokenizer == "bytes"  # llmgpu.json
    (d / "llmgpu.json").write_text("[1, 2]")  # was a TypeError from dict.update
    with pytest.raises(InteropError, match=r"llmgpu.json is not a JSON object \(it holds a list\)"):
        load_pretrained(d)


def test_safetensors_package_reads_the_export(tmp_path, rng):
    """The export's layout as the reference ``safetensors`` package sees it: names, shapes, dtypes."""
    ref = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
    m = GPT(CFG, xp=np, seed=2)
    d = hf.export_hf(tmp_path / "x", CFG, m.state_dict())
    t = ref.load_file(str(d / "model.safetensors"))
    want = {"transformer.wte.weight": (65, 32), "transformer.wpe.weight": (16, 32), "transformer.ln_f.weight": (32,),
            "transformer.ln_f.bias": (32,)}
    for i in range(2):
        want.update({f"transformer.h.{i}.{k}": s for k, s in {
            "ln_1.weight": (32,), "ln_1.bias": (32,), "attn.c_attn.weight": (32, 96), "attn.c_attn.bias": (96,),
            "attn.c_proj.weight": (32, 32), "attn.c_proj.bias": (32,), "ln_2.weight": (32,), "ln_2.bias": (32,),
            "mlp.c_fc.weight": (32, 128), "mlp.c_fc.bias": (128,), "mlp.c_proj.weight": (128, 32),
            "mlp.c_proj.bias": (32,)}.items()})  # fmt: skip
    assert {k: v.shape for k, v in t.items()} == want and all(v.dtype == np.float32 for v in t.values())
    sd = m.state_dict()
    assert np.array_equal(t["transformer.h.0.attn.c_attn.weight"], sd["transformer.h.0.attn.c_attn.weight"].T)
    assert np.array_equal(t["transformer.h.1.attn.c_proj.weight"], sd["transformer.h.1.attn.c_proj.weight"].T)
    assert np.array_equal(t["transformer.wpe.weight"], sd["transformer.wpe.weight"])
    raw = ref.load_file(str(d / "nanogpt.safetensors"))
    assert all(np.array_equal(raw[k], sd[k]) for k in raw) and set(raw) == set(want)


def test_llmgpu_export_round_trip_from_a_run(tmp_path, rng, capsys, one_error_line):
    out = _run(tmp_path)
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "hf")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokenizer"] == "bytes" and report["vocab_size"] == 256
    ours = llmgpu.from_pretrained(out, xp=np)
    theirs = llmgpu.from_pretrained(tmp_path / "hf", xp=np)
    idx = rng.integers(0, 256, (2, 16)).astype(np.int32)
    assert np.array_equal(ours.forward(idx)[0], theirs.forward(idx)[0])
    one_error_line(main(["export", "--from", str(out), "--to", str(tmp_path / "hf")]), "is not empty", "--overwrite")
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "hf"), "--overwrite"]) == 0
    one_error_line(main(["export", "--from", str(tmp_path / "nothing"), "--to", str(tmp_path / "y")]), "does not exist")


@pytest.mark.parametrize("to", ["new", "an earlier export"])
def test_a_failed_export_leaves_to_as_it_was_and_names_the_file(tmp_path, monkeypatch, capsys, one_error_line, to):
    """A full disk halfway (the second weights file): one line naming that file, and --to as it was (absent, or an
    earlier export with --overwrite), so a retry runs and nothing there reads as a half-written model."""
    out, dst = _run(tmp_path), tmp_path / "hf"
    if to != "new":
        assert main(["export", "--from", str(out), "--to", str(dst)]) == 0
    before = sorted(tmp_path.iterdir()), {p.name: p.read_bytes() for p in dst.iterdir()} if dst.exists() else None
    real, calls = st.save_file, []

    def save_file(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\0" * 100)  # a part of it, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, *a, **kw)

    monkeypatch.setattr(st, "save_file", save_file)
    capsys.readouterr()
    one_error_line(main(["export", "--from", str(out), "--to", str(dst), "--overwrite"]), "No space left on device",
                   f"writing {dst / 'nanogpt.safetensors'} failed", f"--to {dst} was left as it was")
    assert (sorted(tmp_path.iterdir()), {p.name: p.read_bytes() for p in dst.iterdir()} if dst.exists() else None) \
        == before  # no staging directory left either
    monkeypatch.undo()
    assert main(["export", "--from", str(out), "--to", str(dst), "--overwrite"]) == 0  # the retry


def test_export_overwrite_replaces_the_model_there_and_keeps_other_files(tmp_path, capsys):
    """--overwrite of a GPT-2 export (plus a sharded model's index and shards, a pickle) with a Llama: none of the
    old weight files stay beside the new config.json, the user's notes do, and the directory loads the Llama."""
    gpt2, llama, dst = _run(tmp_path), _run(tmp_path, "llama", arch="llama", preset="llama-tiny"), tmp_path / "hf"
    assert main(["export", "--from", str(gpt2), "--to", str(dst)]) == 0
    stale = [hf.INDEX_FILE, "model-00001-of-00002.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json"]
    for name in [*stale, "notes.md"]:
        (dst / name).write_text("an earlier model's" if name != "notes.md" else "the user's own file")
    assert main(["export", "--from", str(llama), "--to", str(dst), "--overwrite"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "llmgpu.json", "model.safetensors", "notes.md"]
    assert (dst / "notes.md").read_text() == "the user's own file" and not list(tmp_path.glob(".hf.*"))
    theirs, ours = llmgpu.from_pretrained(dst, xp=np), llmgpu.from_pretrained(llama, xp=np)
    assert type(theirs).__name__ == "Llama" and all(np.array_equal(v, theirs.state_dict()[k])
                                                    for k, v in ours.state_dict().items())


@pytest.mark.parametrize("fail_at", [1, 4, 5, 7])
def test_an_export_that_fails_while_moving_into_place_puts_the_old_model_back(tmp_path, monkeypatch, capsys,
                                                                             one_error_line, fail_at):
    """--overwrite moves the old model's four files aside, then the new three in: a failure at any of those renames
    (1-4 aside, 5-7 in, config.json last) leaves --to byte for byte as it was."""
    gpt2, llama, dst = _run(tmp_path), _run(tmp_path, "llama", arch="llama", preset="llama-tiny"), tmp_path / "hf"
    assert main(["export", "--from", str(gpt2), "--to", str(dst)]) == 0
    (dst / "notes.md").write_text("the user's own file")
    before = sorted(tmp_path.iterdir()), {p.name: p.read_bytes() for p in dst.iterdir()}
    real, calls = os.replace, []

    def replace(a, b):
        if Path(b).parent in (dst, dst.parent / ".hf.export-tmp" / "old"):  # the stage's moves, not hf.publish's
            calls.append(b)
            if len(calls) == fail_at:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(a), None, str(b))
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    capsys.readouterr()
    one_error_line(main(["export", "--from", str(llama), "--to", str(dst), "--overwrite"]), "into place failed",
                   "Input/output error", f"--to {dst} was left as it was")
    monkeypatch.undo()
    aside = dst.parent / ".hf.export-tmp" / "old"
    assert Path(calls[fail_at - 1]).parent == (dst if fail_at > 4 else aside)  # then the moves back
    assert (sorted(tmp_path.iterdir()), {p.name: p.read_bytes() for p in dst.iterdir()}) == before


def test_export_never_writes_over_the_model_it_reads_or_a_run(tmp_path, capsys, one_error_line):
    """--to the run's own directory (or its checkpoint/) would replace the run's config.json and weights: refused,
    also with --overwrite; so is another run, and the Hugging Face directory an export reads."""
    out = _run(tmp_path)
    other = _run(tmp_path, "other")
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for to in (out, out / "checkpoint"):
        one_error_line(main(["export", "--from", str(out), "--to", str(to), "--overwrite"]), f"--to {to}",
                       "where the model comes from")
    one_error_line(main(["export", "--from", str(out), "--to", str(other), "--overwrite"]), "holds an llmgpu run")
    one_error_line(main(["export", "--from", str(out), "--to", str(other / "checkpoint"), "--overwrite"]),
                   "holds an llmgpu run or checkpoint")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing of the run changed
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "hf")]) == 0
    one_error_line(main(["export", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "hf"), "--overwrite"]),
                   "where the model comes from")
    capsys.readouterr()
    assert main(["export", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "hf2")]) == 0  # elsewhere: fine
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "hf2"), "--overwrite"]) == 0  # an export: fine


@pytest.mark.parametrize("xp", [None, np, "cpu", "auto", "CPU"])
def test_from_pretrained_takes_the_device_names_of_the_rest_of_the_api(tmp_path, monkeypatch, xp):
    monkeypatch.setenv("LLMGPU_DEVICE", "cpu")  # 'auto' and None: NumPy here, whatever the machine
    out = _run(tmp_path)
    m = llmgpu.from_pretrained(out, xp=xp)
    assert m.xp is np and np.array_equal(m.state_dict()["transformer.wte.weight"],
                                         load_pretrained(out).weights["transformer.wte.weight"])


@pytest.mark.parametrize("xp,err,needle", [("banana", ValueError, "auto, cpu or gpu"),
                                           ("numpy", ValueError, "'numpy'"), (math, TypeError, "xp must be")])
def test_from_pretrained_refuses_other_xp_in_one_line_before_reading(tmp_path, xp, err, needle):
    with pytest.raises(err, match=needle) as e:
        llmgpu.from_pretrained(tmp_path / "not-read", xp=xp)  # the xp is checked first: no 'does not exist'
    assert "\n" not in str(e.value)


def test_sample_and_eval_read_a_hugging_face_directory(tmp_path, rng, capsys):
    out = _run(tmp_path)
    hf.export_hf(tmp_path / "hf", *(lambda p: (p.config, p.weights))(load_pretrained(out)), tokenizer="bytes")
    assert main(["sample", "--from", str(tmp_path / "hf"), "--prompt", "def", "--tokens", "5", "--device", "cpu",
                 "--seed", "3"]) == 0
    a = capsys.readouterr().out
    assert main(["sample", "--from", str(out), "--prompt", "def", "--tokens", "5", "--device", "cpu", "--seed",
                 "3"]) == 0
    assert capsys.readouterr().out == a and a.startswith("def")


def test_export_to_the_current_directory_a_link_or_below_a_file(tmp_path, monkeypatch, capsys, one_error_line):
    """``--to .`` (an empty working directory) was a traceback ('.' has an empty name), ``--to`` a link to an empty
    directory failed to move ('Not a directory'), and a --to below a file said only 'File exists'."""
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--batch", "2", "--seq", "16",
                 "--eval-every", "0", "--sample-tokens", "0", "--quiet", "--no-plot", "--out", str(out)]) == 0
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["export", "--from", str(out), "--to", "."]) == 0
    assert (here / "config.json").is_file() and not list(tmp_path.glob(".*export-tmp"))
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert main(["export", "--from", str(out), "--to", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (target / "config.json").is_file()
    (tmp_path / "a.txt").write_text("a file")
    capsys.readouterr()
    one_error_line(main(["export", "--from", str(out), "--to", str(tmp_path / "a.txt" / "out")]),
                   f"{tmp_path / 'a.txt'} is a file, not a directory")


def test_a_config_or_meta_that_is_a_directory_is_named_so_and_fast_must_be_a_bool(tmp_path):
    """A config.json that is a directory (beside weights) read as an incomplete llmgpu checkpoint whose meta.json
    "is missing"; a meta.json that is a directory was "missing" too. from_pretrained(fast="no") built a FastGPT."""
    d = hf.export_hf(tmp_path / "hf", CFG, GPT(CFG, xp=np, seed=1).state_dict(), tokenizer="bytes")
    with pytest.raises(TypeError, match="fast must be True or False, got 'no'"):
        llmgpu.from_pretrained(d, xp=np, fast="no")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(InteropError, match=f"^{d / 'config.json'} is not a file: not a Hugging Face model directory"):
        load_pretrained(d)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint", model=GPT(CFG, xp=np, seed=1).state_dict(), meta={"step": 0})
    (run / "checkpoint" / "meta.json").unlink()
    (run / "checkpoint" / "meta.json").mkdir()
    with pytest.raises(CheckpointError, match=r"meta.json is not a file$"):
        load_pretrained(run)
