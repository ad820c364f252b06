"""Flat parameter buffers: layout, views, decay split, working copy, state round trip (chapter 4)."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.model.config import gpt2_param_shapes
from llmgpu.optim.params import ALIGN, FlatParams

pytestmark = pytest.mark.ch4

SMALL = {"w1": (7, 5), "b1": (7,), "ln.weight": (3,), "w2": (1, 33), "emb": (10, 4)}


def _filled(shapes, xp, rng, working="fp32"):
    P = FlatParams(shapes, xp=xp, working_dtype=working)
    for n in P.names:
        P.param(n)[...] = backend.to_device(rng.standard_normal(P.shapes[n]).astype(np.float32), xp)
    P.sync_working()
    return P


def test_gpt2_shapes():
    s = gpt2_param_shapes()
    assert len(s) == 148
    assert sum(int(np.prod(v)) for v in s.values()) == 124_439_808
    assert s["transformer.wte.weight"] == (50257, 768)
    assert s["transformer.h.11.mlp.c_proj.weight"] == (768, 3072)
    assert s["transformer.h.0.attn.c_attn.bias"] == (2304,)
    small = gpt2_param_shapes(n_layer=2, n_embd=16, vocab=50, block_size=8, bias=False)
    assert not any(k.endswith(".bias") for k in small)


def test_layout_alignment_and_decay_split():
    P = FlatParams(SMALL, xp=np)
    assert P.names == list(SMALL)
    assert P.numel % ALIGN == 0 and P.num_parameters == sum(int(np.prod(s)) for s in SMALL.values())
    segs = P.segments()
    end = 0
    for name, off, size, decay in segs:
        assert off % ALIGN == 0 and off >= end, (name, off, end)
        end = off + size
        # decayed tensors (2-D) all before decay_end, the rest after it
        assert decay == (len(SMALL[name]) >= 2)
        assert (off + size <= P.decay_end) if decay else (off >= P.decay_end)
    assert end <= P.numel
    mask = P.decay_mask()
    assert mask[: P.decay_end].min() == 1 and mask[P.decay_end:].max() == 0


def test_views_share_memory(rng):
    P = FlatParams(SMALL, xp=np)
    P.param("w1")[2, 3] = 5.0
    assert P.data[P.offsets["w1"] + 2 * 5 + 3] == 5.0
    P.grad_of("b1")[...] = 1.0
    assert P.grad.sum() == 7.0
    P.zero_grad()
    assert not P.grad.any()
    assert P.working is P.data and P.weight("w1").base is not None
    assert np.shares_memory(P.weight("w2"), P.data)


def test_stacked_matrices_are_one_view_when_back_to_back(rng):
    """``stacked``: matrices laid out back to back are one [Σ rows, cols] view of the working weights and of the
    gradients (writes go through); padding between them (a size not a multiple of the alignment), a name out of
    order, or another tensor in between gives None; different column counts are refused."""
    shapes = {"q": (4, 8), "k": (2, 8), "v": (2, 8), "norm": (8,), "odd": (3, 5), "w": (2, 5), "x": (6, 8)}
    P = _filled(shapes, np, rng)
    qkv = P.stacked(("q", "k", "v"))
    assert qkv.shape == (8, 8)
    np.testing.assert_array_equal(qkv, np.concatenate([P.weight(n) for n in "qkv"]))
    g = P.stacked(("q", "k", "v"), grad=True)
    g[...] = rng.standard_normal(g.shape)
    np.testing.assert_array_equal(P.grad_of("k"), g[4:6])  # a view, not a copy
    assert P.stacked(("k", "q")) is None  # out of order
    assert P.stacked(("q", "v")) is None  # k lies between them
    assert P.stacked(("odd", "w")) is None  # 15 elements padded to 16: a gap
    assert P.stacked(("v", "x")) is None  # the no-decay norm goes elsewhere, but "odd" and "w" lie between
    with pytest.raises(ValueError, match="one column count"):
        P.stacked(("w", "x"))


def test_custom_no_decay_and_errors():
    P = FlatParams(SMALL, xp=np, no_decay=lambda n, s: n.startswith("emb") or len(s) < 2)
    assert not P.decay["emb"] and P.decay["w1"]
    with pytest.raises(ValueError, match="empty"):
        FlatParams({}, xp=np)
    with pytest.raises(ValueError, match="w"):
        FlatParams({"w": (3, 0)}, xp=np)
    with pytest.raises(TypeError, match="working_dtype"):
        FlatParams(SMALL, xp=np, working_dtype="fp64")
    with pytest.raises(KeyError, match="nope"):
        P.param("nope")


@pytest.mark.parametrize("working", ["fp32", "bf16", "fp16"])
def test_working_copy_numpy(rng, working):
    P = _filled(SMALL, np, rng, working)
    assert P.working.dtype == backend.resolve_dtype(working)
    for n in P.names:
        np.testing.assert_array_equal(P.weight(n), P.param(n).astype(P.working.dtype))


def test_dict_round_trip(rng):
    P = _filled(SMALL, np, rng, "bf16")
    d = P.to_dict()
    Q = FlatParams(SMALL, xp=np, working_dtype="bf16")
    Q.load_dict(d)
    np.testing.assert_array_equal(Q.data, P.data)
    np.testing.assert_array_equal(Q.working, P.working)
    with pytest.raises(ValueError, match=r"not this model's: \d+ missing \("):
        Q.load_dict({"w1": d["w1"]})
    bad = dict(d)
    bad["w1"] = np.zeros((5, 7), np.float32)
    with pytest.raises(ValueError, match="w1"):
        Q.load_dict(bad)
    Q.load_dict({"b1": np.ones(7, np.float32)}, strict=False)
    np.testing.assert_array_equal(Q.param("b1"), 1.0)
    np.testing.assert_array_equal(Q.param("w1"), P.param("w1"))


@pytest.mark.gpu
@pytest.mark.parametrize("working", ["bf16", "fp16"])
def test_working_copy_gpu(cp, rng, working):
    shapes = {**SMALL, "big": (1000, 7), "odd": (50257,)}
    Pg = _filled(shapes, cp, rng, working)
    Pg.working.fill(float("nan"))  # poisoned: sync_working must write every element
    Pg.sync_working()
    host = backend.to_numpy(Pg.data)
    ref = host.astype(np.float32).astype(Pg.working.dtype)
    np.testing.assert_array_equal(backend.to_numpy(Pg.working).view(np.uint16), ref.view(np.uint16))
    d = Pg.to_dict()
    for n in Pg.names:
        np.testing.assert_array_equal(d[n], backend.to_numpy(Pg.param(n)))
    assert Pg.weight("odd").data.ptr % 16 == 0 and Pg.param("big").data.ptr % 16 == 0
