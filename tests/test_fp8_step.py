"""Chapter 5b: the FP8 step (``FastOptions(fp8=...)``, ``model/fp8_linear.py``) against the step it replaces.

On the CPU the FP8 GEMMs run their NumPy emulation (the same bytes, scales and epilogues), so the error measured
here is FP8's own: a few percent per gradient tensor, cosine similarity above 0.99 (dev/cuda/fp8_plan.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.model import FastOptions, GPTConfig
from llmgpu.model import fp8_linear as fp8_linear_module
from llmgpu.model.fast import FastGPT
from llmgpu.model.fp8_linear import FP8_LAYERS, Fp8Linears, Fp8Saved
from llmgpu.ops.fp8 import AmaxHistory

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=37, block_size=16, pad_vocab_to=16)
FP8_WEIGHTS = [f"transformer.h.{i}.{layer}.weight" for i in range(CFG.n_layer) for layer in FP8_LAYERS]


def _batch(rng, B=2, T=16, xp=np):
    idx = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    tgt = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    return backend.to_device(idx, xp), backend.to_device(tgt, xp)


def _grads(m):
    return {n: backend.to_numpy(m.params.grad_of(n)).astype(np.float64) for n in m.params.names}


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _cos(a, b):
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def _step(model, idx, tgt, steps=1):
    for _ in range(steps):
        model.zero_grad()
        loss = model.forward_backward(idx, tgt)
    return float(loss), _grads(model)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_gradients_close_to_the_fp32_step(rng, recipe):
    """Every gradient within FP8's expected error of the unquantized step's, and the FP8 layers really
    quantized (their error is far above fp32 rounding)."""
    idx, tgt = _batch(rng)
    l_ref, g_ref = _step(FastGPT(CFG, dtype="fp32", xp=np, seed=1), idx, tgt)
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=1, options=FastOptions(fp8=recipe))
    l8, g8 = _step(m, idx, tgt, steps=3)  # delayed: steps 2 and 3 use the history
    assert abs(l8 - l_ref) < 1e-2 * abs(l_ref)
    for name, g in g_ref.items():
        assert np.isfinite(g8[name]).all(), name
        assert _rel(g8[name], g) < 0.15 and _cos(g8[name], g) > 0.99, (name, _rel(g8[name], g), _cos(g8[name], g))
    assert min(_rel(g8[n], g_ref[n]) for n in FP8_WEIGHTS) > 1e-3  # quantized: not the fp32 GEMMs
    assert len(m.fp8.states) == 3 * len(FP8_LAYERS) * CFG.n_layer and not m.fp8.unfused


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_checkpointing_is_bitwise(rng, recipe):
    """Within one forward_backward no scale changes, so recomputing a span casts the same bytes."""
    idx, tgt = _batch(rng)
    runs = []
    for k in (0, 1, 2):
        m = FastGPT(CFG, dtype="fp32", xp=np, seed=3, checkpoint_every=k, options=FastOptions(fp8=recipe))
        runs.append(_step(m, idx, tgt, steps=2))
    for loss, grads in runs[1:]:
        assert loss == runs[0][0]
        for name, g in grads.items():
            assert np.array_equal(g, runs[0][1][name]), name


def test_delayed_scaling_first_step_is_current_then_uses_the_history(rng):
    idx, tgt = _batch(rng)
    cur = FastGPT(CFG, dtype="fp32", xp=np, seed=4, options=FastOptions(fp8="current"))
    dl = FastGPT(CFG, dtype="fp32", xp=np, seed=4, options=FastOptions(fp8="delayed", fp8_history=4))
    l_c, g_c = _step(cur, idx, tgt)
    l_d, g_d = _step(dl, idx, tgt)
    assert l_c == l_d and all(np.array_equal(g_c[n], g_d[n]) for n in g_c)  # no history yet: current scaling
    assert dl.fp8.primed and not cur.fp8.primed
    x_state = dl.fp8.state("h.0.mlp.c_fc", "x")
    assert x_state.length == 4 and dl.fp8.state("h.0.mlp.c_fc", "w").length == 4  # fp8_delayed_weights
    no_w = FastGPT(CFG, dtype="fp32", xp=np, options=FastOptions(fp8="delayed", fp8_delayed_weights=False)).fp8
    assert no_w.state("h.0.mlp.c_fc", "w").length == 1 and no_w.delayed_roles == ("x", "dy")
    first = x_state.history.copy()
    assert first.max() > 0 and x_state.amax[0] == 0  # recorded, and cleared for the next step's casts
    idx2, tgt2 = _batch(rng)
    dl.zero_grad()
    dl.forward_backward(idx2 * 0 + 1, tgt2)  # another batch: its amax goes into the ring at the step's end
    assert int(x_state.pos[0]) == 2 and x_state.history[1] > 0
    want = np.float32(448.0) / x_state.history.max()  # E4M3's max over the ring's max
    assert np.isclose(x_state.scale[0], want, rtol=1e-6)


def _fill_random(st, rng):
    """Random values in a delayed state's arrays (a ring, its position, a scale, a recorded amax)."""
    st.history[...] = np.abs(rng.standard_normal(st.length)).astype(np.float32) * 10.0 ** rng.integers(-3, 4)
    st.pos[...] = rng.integers(0, st.length)
    st.scale[...] = np.float32(2.0 ** rng.integers(-8, 8))
    st.scale_inv[...] = np.float32(1) / st.scale
    st.amax[...] = np.float32(rng.uniform(0.5, 2.0) * 10.0 ** rng.integers(-3, 4))


def _copy_state(st):
    return {n: getattr(st, n).copy() for n in ("history", "pos", "amax", "scale", "scale_inv")}


def test_end_step_updates_every_delayed_state_in_one_group(rng):
    """end_step groups the delayed states made in the first step into one AmaxHistories (the weights' states stay
    out: current scaling), then gives every delayed state what its own update() and a zeroed amax give; a state
    first used later joins a group of its own, and the grouped states' arrays never move."""
    lin = Fp8Linears("delayed", 3, np)
    layers = [f"h.{i}.{layer}" for i in range(2) for layer in FP8_LAYERS]
    for layer in layers:
        for role in ("x", "w", "dy"):
            _fill_random(lin.state(layer, role), rng)
    delayed = {k: st for k, st in lin.states.items() if k[1] != "w"}
    weights = {k: _copy_state(st) for k, st in lin.states.items() if k[1] == "w"}
    before = {k: _copy_state(st) for k, st in delayed.items()}
    lin.end_step()  # the first step: grouped, amaxes zeroed, nothing else changes
    assert lin.primed and len(lin.groups) == 1 and set(lin.groups[0].states) == set(delayed.values())
    for k, st in delayed.items():
        assert st.group is lin.groups[0] and st.amax[0] == 0
        for n in ("history", "pos", "scale", "scale_inv"):
            assert np.array_equal(getattr(st, n), before[k][n]), (k, n)
    arrays = {k: (st.history, st.scale, st.amax) for k, st in delayed.items()}
    for _ in range(4):  # the next steps: the casts record amaxes, end_step updates every state
        want = {}
        for k, st in delayed.items():
            st.amax[0] = np.float32(rng.uniform(0.5, 2.0) * 10.0 ** rng.integers(-3, 4))
            ref = AmaxHistory(st.fmt, st.length, xp=np)
            for n, v in _copy_state(st).items():
                getattr(ref, n)[...] = v
            ref.update()
            ref.amax[0] = 0
            want[k] = _copy_state(ref)
        lin.end_step()
        for k, st in delayed.items():
            for n, v in want[k].items():
                assert np.array_equal(getattr(st, n), v), (k, n)
    for k, w in weights.items():  # the weights' states are the casts' alone
        assert lin.states[k].group is None and all(np.array_equal(getattr(lin.states[k], n), v) for n, v in w.items())
    late = lin.state("h.9.attn.c_attn", "dy")
    late.amax[0] = 4.0
    lin.end_step()
    assert len(lin.groups) == 2 and lin.groups[1].states == (late,) and late.history.max() == 4.0
    assert all(delayed[k].history is h and delayed[k].scale is s and delayed[k].amax is a
               for k, (h, s, a) in arrays.items())
    cur = Fp8Linears("current", 3, np)  # current scaling keeps nothing between steps: nothing to group
    cur.state("h.0.attn.c_attn", "x")
    cur.end_step()
    assert not cur.groups and cur.state("h.0.attn.c_attn", "x").group is None


def test_a_graph_is_captured_after_an_eager_step():
    """The delayed states are made in the first step and grouped at its end (their arrays move into flat buffers),
    so a CUDA graph must not record the first step: TrainStep runs eager steps before it captures (and grouping
    during a capture is refused: test_fp8.py)."""
    from llmgpu.train.step import EAGER_WARMUP

    assert EAGER_WARMUP >= 1


def test_delayed_scaling_state_round_trips_through_json_bit_for_bit(rng):
    """A model that takes the delayed state of another after its first two steps (through JSON, as a checkpoint's
    meta.json) computes the third step's gradients bit for bit as the one that ran all three; without the state
    it does not (its first step scales like current scaling). Current scaling keeps no state."""
    import json

    batches = [_batch(rng) for _ in range(3)]
    opts = FastOptions(fp8="delayed", fp8_history=4)
    whole = FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=opts)
    for idx, tgt in batches[:2]:
        _step(whole, idx, tgt)
    state = json.loads(json.dumps(whole.fp8.state_dict()))
    assert state["primed"] and state["history"] == 4 and len(state["states"]) == 3 * len(FP8_LAYERS) * CFG.n_layer
    assert all(s["pos"] == 2 and s["history"][1] > 0 for s in state["states"].values())
    want = _step(whole, *batches[2])
    resumed, fresh = (FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=opts) for _ in range(2))
    resumed.fp8.load_state_dict(state)
    assert resumed.fp8.state_dict() == state
    got, other = _step(resumed, *batches[2]), _step(fresh, *batches[2])
    assert got[0] == want[0] and all(np.array_equal(got[1][n], want[1][n]) for n in want[1])
    assert not all(np.array_equal(other[1][n], want[1][n]) for n in want[1])
    assert FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="current")).fp8.state_dict() == {}
    resumed.fp8.load_state_dict({})  # a checkpoint made before the state was kept: nothing changes
    for bad, needle in (({**state, "history": 8}, "history 8, but this model runs 'delayed' with history 4"),
                        ({**state, "states": {"h.0.attn.c_attn|b": next(iter(state["states"].values()))}},
                         "histories for x/dy/w only"),
                        ({**state, "states": {"h.0.attn.c_attn|x": {**next(iter(state["states"].values())),
                                                                    "pos": 9}}}, "does not fit a history of 4 steps")):
        with pytest.raises(ValueError, match=needle):
            FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=opts).fp8.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"x/dy only \(FastOptions.fp8_delayed_weights is off\)"):
        FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="delayed", fp8_history=4,
                                                                      fp8_delayed_weights=False)).fp8.load_state_dict(state)
    with pytest.raises(ValueError, match="but this model runs 'current'"):
        FastGPT(CFG, dtype="fp32", xp=np, options=FastOptions(fp8="current")).fp8.load_state_dict(state)


def test_a_checkpoint_without_the_weights_states_scales_them_like_a_first_step(rng):
    """fp8_delayed_weights: the weights' states are delayed too and the checkpoint keeps them. One made before
    (x and dy states only) leaves them fresh (scale 1, an empty ring), so in the first resumed step they scale like
    current scaling, as in a run's first step: that step is bit for bit the step of a model whose weights are
    always current-scaled, and the step after it casts the weights with their new history."""
    batches = [_batch(rng) for _ in range(3)]
    whole = FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="delayed", fp8_history=4))
    for idx, tgt in batches[:2]:
        _step(whole, idx, tgt)
    state = whole.fp8.state_dict()
    old = {**state, "states": {k: v for k, v in state["states"].items() if not k.endswith("|w")}}
    assert len(old["states"]) == 2 * len(FP8_LAYERS) * CFG.n_layer
    resumed = FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="delayed", fp8_history=4))
    current_w = FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="delayed", fp8_history=4,
                                                                              fp8_delayed_weights=False))
    for m in (resumed, current_w):
        m.fp8.load_state_dict(old)
    w = ("h.0.attn.c_attn", "w")
    assert resumed.fp8.state(*w).scale[0] == 1 and not resumed.fp8._delayed(*w)  # fresh: scale 1 would be wrong
    assert resumed.fp8._delayed("h.0.attn.c_attn", "x")
    got, want = _step(resumed, *batches[2]), _step(current_w, *batches[2])
    assert got[0] == want[0] and all(np.array_equal(got[1][n], want[1][n]) for n in want[1])
    assert resumed.fp8._delayed(*w) and resumed.fp8.state(*w).history.max() > 0


def test_checkpoint_keeps_and_restores_the_fp8_scaling_state(rng):
    """The trainer's seam: ``model_state_of`` holds the FP8 state next to the attention kernels, and
    ``restore_model_state`` puts it back; a state for a model without FP8 GEMMs is refused."""
    from llmgpu.train import checkpoint as ck

    m = FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=FastOptions(fp8="delayed"))
    _step(m, *_batch(rng))
    meta = ck.model_state_of(m)
    assert set(meta) == {ck.ATTENTION_KERNELS_KEY, ck.FP8_SCALING_KEY} and meta[ck.FP8_SCALING_KEY]["primed"]
    back = FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=FastOptions(fp8="delayed"))
    assert ck.restore_model_state(back, meta) == [] and back.fp8.state_dict() == meta[ck.FP8_SCALING_KEY]
    with pytest.raises(ValueError, match="holds FP8 scaling state, but this model runs no FP8 GEMMs"):
        ck.restore_model_state(FastGPT(CFG, dtype="fp32", xp=np), meta)
    assert ck.model_state_of(FastGPT(CFG, dtype="fp32", xp=np))[ck.FP8_SCALING_KEY] == {}


def test_fp8_inference_forward_leaves_the_delayed_state_alone(rng):
    idx, tgt = _batch(rng)
    ref = FastGPT(CFG, dtype="fp32", xp=np, seed=5)
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=5, options=FastOptions(fp8="delayed"))
    _step(m, idx, tgt)
    before = {k: (s.history.copy(), s.amax.copy(), s.scale.copy()) for k, s in m.fp8.states.items()}
    logits, loss = m.forward(idx, tgt)
    ref_logits, ref_loss = ref.forward(idx, tgt)
    assert _rel(np.asarray(logits, np.float64), np.asarray(ref_logits, np.float64)) < 0.05
    for k, (h, a, s) in before.items():
        st = m.fp8.states[k]
        assert np.array_equal(st.history, h) and np.array_equal(st.amax, a) and np.array_equal(st.scale, s), k


def test_fp8_forward_keeps_one_byte_casts_instead_of_the_inputs(rng):
    idx, tgt = _batch(rng)
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=6, options=FastOptions(fp8="current"))
    (_, h, *_), caches, _ = m._forward_trunk(idx, store=True)
    c = caches[0]
    for key in ("h1", "h2", "g"):
        assert isinstance(c[key], Fp8Saved) and c[key].x_t.dtype == np.uint8, key
    N, C = idx.size, CFG.n_embd
    assert c["g"].x_t.shape == (4 * C, N) and c["h1"].w_t.shape == (C, 3 * C)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fused_casts_compute_the_step_they_replace(rng, recipe):
    """FastOptions.fp8_fused_casts (GELU, GELU' and the bias gradients in the FP8 casts): the same function
    as the step with cuBLASLt's epilogues and separate passes (in fp32 on the CPU only the fp32 roundings between
    the passes differ), the same bits with checkpointing, and no bf16 GELU output kept: the cache holds the
    product f = h2 W₁ᵀ, MLP-out keeps its FP8 cast."""
    idx, tgt = _batch(rng)
    unfused = FastOptions(fp8=recipe, fp8_fused_casts=False)
    l_ref, g_ref = _step(FastGPT(CFG, dtype="fp32", xp=np, seed=9, options=unfused), idx, tgt, 3)
    opts = FastOptions(fp8=recipe, fp8_fused_casts=True)
    runs = [_step(FastGPT(CFG, dtype="fp32", xp=np, seed=9, options=opts, checkpoint_every=k), idx, tgt, 3)
            for k in (0, 1)]
    assert abs(runs[0][0] - l_ref) < 1e-6 * abs(l_ref)
    for name, g in g_ref.items():
        assert _rel(runs[0][1][name], g) < 1e-5, name
        assert np.array_equal(runs[1][1][name], runs[0][1][name]), name
    assert runs[1][0] == runs[0][0]
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=9, options=opts)
    (_, _, *_), caches, _ = m._forward_trunk(idx, store=True)
    c = caches[0]
    assert m.fused_casts and isinstance(c["g"], Fp8Saved) and c["f"].shape == (idx.size, 4 * CFG.n_embd)
    assert not FastGPT(CFG, dtype="fp32", xp=np, options=FastOptions(fp8_fused_casts=True)).fused_casts


# the epilogues matter where the casts do not apply GELU (fp8_fused_casts=False)
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_layernorm_casts_compute_the_step_they_replace(rng, monkeypatch, recipe):
    """FastOptions.fp8_layernorm_casts: under delayed scaling, from the second step on, the residual add + LayerNorm
    before QKV and MLP-in writes the layers' FP8 inputs (counted: 3 per forward of this 2-layer model, 2 more where a
    checkpointed backward recomputes; none in the first step, none with current scaling, no transpose in
    inference). In fp32 the LayerNorm's value needs no rounding, so the bits are the step's without it."""
    from llmgpu.model import fp8_linear

    calls = []

    def spy(*args, **kw):
        calls.append(kw["transpose"])
        return fused_ln(*args, **kw)

    fused_ln = fp8_linear.fp8_add_layernorm
    monkeypatch.setattr(fp8_linear, "fp8_add_layernorm", spy)
    idx, tgt = _batch(rng)
    l_ref, g_ref = _step(FastGPT(CFG, dtype="fp32", xp=np, seed=9, options=FastOptions(
        fp8=recipe, fp8_layernorm_casts=False)), idx, tgt, 3)
    assert not calls
    delayed = recipe == "delayed"
    for k, per_step in ((0, 3), (1, 5)):
        m = FastGPT(CFG, dtype="fp32", xp=np, seed=9, checkpoint_every=k, options=FastOptions(fp8=recipe))
        loss, g = _step(m, idx, tgt)
        assert not calls  # the first step has no delayed scale yet
        loss, g = _step(m, idx, tgt, 2)
        assert calls == [True] * (2 * per_step if delayed else 0)
        calls.clear()
        assert loss == l_ref and all(np.array_equal(g[n], g_ref[n]) for n in g_ref)
    m.forward(idx)
    assert calls == ([False] * 3 if delayed else [])


FUSED = FastOptions(fp8="current", fp8_fused_epilogues=("bias", "gelu_bias", "dgelu"), fp8_fused_casts=False)
UNFUSED = FastOptions(fp8="current", fp8_fused_epilogues=(), fp8_fused_casts=False)


def test_unfused_epilogues_by_default_and_when_cublaslt_has_no_fp8_kernel(rng, monkeypatch):
    """Epilogues run fused, as separate passes, or (fused asked for, but cuBLASLt has no FP8 kernel for them)
    separate after a fallback: all compute the same function."""
    idx, tgt = _batch(rng)
    _, g_fused = _step(FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=FUSED), idx, tgt)
    for opts in (UNFUSED, FastOptions(fp8="current", fp8_fused_casts=False)):
        default = FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=opts)
        _, g_default = _step(default, idx, tgt)
        assert default.fp8.fused_epilogues == set(opts.fp8_fused_epilogues) and not default.fp8.unfused
        for name in g_default:
            assert _rel(g_default[name], g_fused[name]) < 1e-5, name
    with pytest.raises(ValueError, match="fp8_fused_epilogues must be a tuple of bias, gelu_bias, dgelu"):
        FastOptions(fp8="current", fp8_fused_epilogues=("relu",))
    real = fp8_linear_module.fp8_gemm

    def no_epilogues(*args, epilogue="none", **kwargs):
        if epilogue != "none":
            raise RuntimeError("cuBLASLt heuristic returned no usable algorithm for fp8 ... (count 0, state 0)")
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "fp8_gemm", no_epilogues)
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=FUSED)
    _, g = _step(m, idx, tgt)
    assert m.fp8.unfused == {"bias", "gelu_bias", "dgelu"}
    for name in g:
        assert _rel(g[name], g_fused[name]) < 1e-5, name

    def broken(*args, epilogue="none", **kwargs):
        raise RuntimeError("something else went wrong")

    monkeypatch.setattr(fp8_linear_module, "fp8_gemm", broken)
    with pytest.raises(RuntimeError, match="something else"):  # only cuBLASLt's refusal falls back
        FastGPT(CFG, dtype="fp32", xp=np, seed=7, options=FUSED).forward_backward(idx, tgt)


def test_fp8_bad_inputs(rng):
    idx, tgt = _batch(rng, B=1, T=15)  # 15 tokens: the FP8 weight gradient reduces over them
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=8, options=FastOptions(fp8="current"))
    with pytest.raises(ValueError, match="multiple of 16"):
        m.forward_backward(idx, tgt)
    m.forward(idx)  # the forward alone takes any token count
    from llmgpu.model.fast_llama import FastLlama
    from llmgpu.model.llama_config import LlamaConfig

    lcfg = LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, ffn_dim=32, vocab_size=32,
                       block_size=8)
    with pytest.raises(ValueError, match="GPT-2 family's fast step only"):
        FastLlama(lcfg, dtype="fp32", xp=np, options=FastOptions(fp8="current"))
    with pytest.raises(ValueError, match="FastOptions.fp8 must be one of off, current, delayed"):
        FastOptions(fp8="e4m3")


# =========================================================================== GPU


def _gpu_cfg():
    return GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=1000, block_size=256, pad_vocab_to=64)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,fused,fused_casts", [("current", ("gelu_bias",), False), ("delayed", (), False),
                                                        ("current", ("bias", "gelu_bias", "dgelu"), False),
                                                        ("current", ("gelu_bias",), True), ("delayed", (), True)])
def test_gpu_fp8_step_close_to_the_bf16_step(cp, rng, recipe, fused, fused_casts):
    """bf16 model, FP8 GEMMs through cuBLASLt: gradients within FP8's error of the bf16 step's, losses close,
    and the fused epilogues found on Hopper (no unfused fallback); also with GELU inside the casts."""
    cfg = _gpu_cfg()
    idx = cp.asarray(rng.integers(0, cfg.vocab_size, (4, 256)).astype(np.int32))
    tgt = cp.asarray(rng.integers(0, cfg.vocab_size, (4, 256)).astype(np.int32))
    bf = FastGPT(cfg, dtype="bf16", seed=1)
    m = FastGPT(cfg, dtype="bf16", seed=1, options=FastOptions(fp8=recipe, fp8_fused_epilogues=fused,
                                                               fp8_fused_casts=fused_casts))
    l_bf, g_bf = _step(bf, idx, tgt)
    l8, g8 = _step(m, idx, tgt, steps=3)
    assert abs(l8 - l_bf) < 2e-2 * abs(l_bf)
    worst = {n: (_rel(g8[n], g), _cos(g8[n], g)) for n, g in g_bf.items()}
    bad = {n: v for n, v in worst.items() if not (v[0] < 0.2 and v[1] > 0.98)}
    assert not bad, bad
    assert min(worst[n][0] for n in FP8_WEIGHTS if n.startswith("transformer.h.0")) > 2e-3
    print("fp8 vs bf16 gradients: worst rel", max(v[0] for v in worst.values()), "worst cos",
          min(v[1] for v in worst.values()), "unfused", m.fp8.unfused)
    assert not m.fp8.unfused, f"cuBLASLt had no FP8 kernel for {m.fp8.unfused}"


@pytest.mark.gpu
def test_gpu_layernorm_casts_close_to_the_step_without(cp, rng):
    """bf16, delayed scaling: with the LayerNorms writing FP8 (the default) the bytes come from the fp32 LayerNorm
    value instead of its bf16 rounding, so the step differs from the one without by FP8's own error, no more (the
    bounds of test_gpu_fp8_step_close_to_the_bf16_step: a byte one code off moves a gradient as much as FP8's
    rounding does); with checkpointing it is bitwise the step without checkpointing."""
    cfg = _gpu_cfg()
    idx = cp.asarray(rng.integers(0, cfg.vocab_size, (4, 256)).astype(np.int32))
    tgt = cp.asarray(rng.integers(0, cfg.vocab_size, (4, 256)).astype(np.int32))
    runs = {}
    for lnc, k in ((False, 0), (True, 0), (True, 1)):
        m = FastGPT(cfg, dtype="bf16", seed=3, checkpoint_every=k,
                    options=FastOptions(fp8="delayed", fp8_layernorm_casts=lnc))
        runs[lnc, k] = _step(m, idx, tgt, steps=3)
    (l0, g0), (l1, g1), (l2, g2) = runs[False, 0], runs[True, 0], runs[True, 1]
    assert l2 == l1 and all(np.array_equal(g2[n], g1[n]) for n in g1)
    assert abs(l1 - l0) < 1e-2 * abs(l0)
    worst = {n: (_rel(g1[n], g), _cos(g1[n], g)) for n, g in g0.items()}
    assert not {n: v for n, v in worst.items() if not (v[0] < 0.2 and v[1] > 0.98)}, worst
    print("layernorm casts vs not: worst rel", max(v[0] for v in worst.values()), "worst cos",
          min(v[1] for v in worst.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("fused_casts", [False, True])
def test_gpu_fp8_graph_step_replays_the_eager_step(cp, rng, fused_casts):
    """The FP8 step captured as one CUDA graph gives the eager step's bits (scales live on the device)."""
    from llmgpu.train import TrainConfig, TrainStep

    cfg = _gpu_cfg()
    batches = [[(cp.asarray(rng.integers(0, cfg.vocab_size, (2, 256)).astype(np.int32)),
                 cp.asarray(rng.integers(0, cfg.vocab_size, (2, 256)).astype(np.int32)))] for _ in range(4)]
    losses = []
    for graph in (False, True):
        m = FastGPT(cfg, dtype="bf16", seed=2, options=FastOptions(fp8="delayed", fp8_fused_casts=fused_casts))
        step = TrainStep(m, TrainConfig(lr=1e-3), graph=graph)
        losses.append([float(step(b, 1e-3)[0]) for b in batches])
        if graph:
            assert step.graph is not None
        # every delayed state in the one group the first step made: one update launch per step
        assert len(m.fp8.groups) == 1 and len(m.fp8.groups[0].states) == 3 * len(FP8_LAYERS) * cfg.n_layer
    assert losses[0] == losses[1] and all(np.isfinite(losses[0]))
