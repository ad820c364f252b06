"""The Llama model (chapter 10): an independent NumPy forward written from Hugging Face's formulas, float64 finite
differences of every parameter, checkpointing, the seam's order, the tie, the configuration's refusals; on the GPU
the same model in fp32 and bf16 against the float64 one."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu.model.llama import Llama
from llmgpu.model.llama_config import EMBED, LM_HEAD, PRESETS, LlamaConfig, llama_param_shapes

SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_dim=24, vocab_size=37, block_size=16)


def with_random_gains(m: Llama, seed: int) -> Llama:
    """``m`` with random norm gains (the init sets them to 1, which would hide a gain applied in the wrong place)."""
    rng = np.random.default_rng(seed)
    sd = {n: np.asarray(a) for n, a in m.state_dict(unpadded=True).items()}
    for n, a in sd.items():
        if a.ndim == 1:
            sd[n] = (1.0 + 0.3 * rng.standard_normal(a.shape)).astype(np.float32)
    m.load_state_dict(sd)
    return m


def _model(tied=False, dtype="fp64", xp=np, seed=1, **kw):
    cfg = LlamaConfig(**{**SMALL, "tie_embeddings": tied, **kw})
    return with_random_gains(Llama(cfg, dtype=dtype, xp=xp, seed=seed), seed + 100)


def _batch(cfg, B=2, T=7, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


def reference_logits(sd: dict, cfg: LlamaConfig, idx) -> np.ndarray:
    """LlamaForCausalLM's forward in float64 NumPy, written from transformers' modeling_llama formulas (rotate_half,
    repeat_kv, RMSNorm computed in full precision) and nothing of llmgpu's."""
    w = {n: np.asarray(a, np.float64) for n, a in sd.items()}
    B, T = idx.shape
    H, Hk, D = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g

    inv_freq = cfg.rope_theta ** (-np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv_freq[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [B, h, T, D]
        rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rot * sin

    x = w[EMBED][idx]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hk, D).transpose(0, 2, 1, 3)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hk, D).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)  # repeat_kv
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + mask
        p_ = np.exp(s - s.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        o = (p_ @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w[EMBED] if cfg.tie_embeddings else w[LM_HEAD]
    return x @ head[: cfg.vocab_size].T


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype, tol", [("fp64", 1e-12), ("fp32", 2e-6)])
def test_logits_equal_an_independent_numpy_llama(tied, dtype, tol):
    m = _model(tied, dtype, pad_vocab_to=8)  # padded rows: the logits stay those of the 37-token vocabulary
    idx, _ = _batch(m.config, T=11)
    got, _ = m.forward(idx)
    ref = reference_logits(m.state_dict(unpadded=True), m.config, idx)
    assert got.shape == (2, 11, 37)
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    # the last position alone: a GEMM of B rows instead of B*T, which cuBLAS may sum in another order
    last, _ = m.forward(idx, last_only=True)
    np.testing.assert_allclose(last, got[:, -1], rtol=0, atol=tol * np.abs(ref).max())


def test_the_loss_is_the_cross_entropy_of_those_logits():
    m = _model()
    idx, tg = _batch(m.config)
    ref = reference_logits(m.state_dict(), m.config, idx)
    z = ref - ref.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, tg[..., None], -1).mean()
    m.zero_grad()
    assert float(m.forward_backward(idx, tg)) == pytest.approx(want, rel=1e-12)
    assert float(m.forward(idx, tg)[1]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_every_gradient_matches_float64_finite_differences(tied):
    """Central differences of the loss for 6 random entries of every parameter (norm gains, every projection, the
    embedding and the head), against the backward pass."""
    m = _model(tied)
    idx, tg = _batch(m.config, T=9)
    m.zero_grad()
    m.forward_backward(idx, tg)
    grads = {n: np.array(g) for n, g in m.grads().items()}
    P, rng, eps = m.params, np.random.default_rng(5), 1e-6
    for name in P.names:
        w = P.param(name)
        flat = w.reshape(-1)
        rows = m.config.vocab_size * w.shape[1] if name in (EMBED, LM_HEAD) else flat.size  # padded rows: no loss
        picks = rng.choice(rows, size=min(6, rows), replace=False)
        if name == EMBED:  # rows of tokens in the batch, where the lookup's gradient lives
            picks = np.concatenate([picks, idx[0, 0] * w.shape[1] + rng.integers(0, w.shape[1], 3)])
        for j in picks:
            old = flat[j]
            flat[j] = old + eps
            up = float(m.forward(idx, tg)[1])
            flat[j] = old - eps
            down = float(m.forward(idx, tg)[1])
            flat[j] = old
            fd = (up - down) / (2 * eps)
            assert grads[name].reshape(-1)[j] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, j)


def test_checkpointing_gives_the_same_gradients_bitwise():
    a, b = _model(), _model()
    b.checkpoint_every = 1
    idx, tg = _batch(a.config)
    for m in (a, b):
        m.zero_grad()
        m.forward_backward(idx, tg)
    for n in a.params.names:
        np.testing.assert_array_equal(a.params.grad_of(n), b.params.grad_of(n), err_msg=n)
    assert b.stats["activation_bytes_stored"] < a.stats["activation_bytes_stored"]


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_activation_formula_counts_what_the_model_keeps(dtype, k):
    m = _model(dtype=dtype, n_layer=3)
    m.checkpoint_every = k
    idx, tg = _batch(m.config, B=3, T=8)
    m.zero_grad()
    m.forward_backward(idx, tg)
    assert m.activation_bytes(3, 8) == {"stored": m.stats["activation_bytes_stored"],
                                        "peak": m.stats["activation_bytes_peak"]}


@pytest.mark.parametrize("tied", [False, True])
def test_grads_ready_names_every_parameter_once_last_block_first(tied):
    m = _model(tied)
    idx, tg = _batch(m.config)
    seen: list = []
    m.zero_grad()
    m.forward_backward(idx, tg, grads_ready=lambda names: seen.append(list(names)))
    flat = [n for group in seen for n in group]
    assert sorted(flat) == sorted(m.params.names) and len(flat) == len(set(flat))
    assert seen[1][0].startswith("model.layers.1.") and seen[-1] == [EMBED]


def test_state_dict_round_trip_and_the_tie():
    m = _model(tied=True, dtype="fp32", pad_vocab_to=8)
    sd = m.state_dict(unpadded=True)
    assert sd[EMBED].shape == (37, 16) and sd[LM_HEAD] is sd[EMBED]
    m2 = Llama(m.config, xp=np, init=False)
    m2.load_state_dict(sd)
    idx, _ = _batch(m.config)
    np.testing.assert_array_equal(m.forward(idx)[0], m2.forward(idx)[0])
    untied = _model(tied=False, dtype="fp32")
    assert LM_HEAD in untied.params.names and untied.num_parameters() == untied.config.num_parameters()


def test_presets_count_smollms_parameters():
    # SmolLM-135M / -360M (Hugging Face's model cards: 134,515,008 and 361,821,120 parameters)
    assert PRESETS["smollm-135m"].num_parameters() == 134_515_008
    assert PRESETS["smollm-360m"].num_parameters() == 361_821_120
    assert sum(int(np.prod(s)) for s in llama_param_shapes(PRESETS["smollm-135m"]).values()) == 134_515_008


@pytest.mark.parametrize("kw, msg", [
    (dict(n_kv_head=3), "multiple of n_kv_head"),
    (dict(n_embd=20, n_head=4, n_kv_head=2), "must be even"),  # head_dim 5
    (dict(n_head=3, n_kv_head=3), "multiple of n_head"),
    (dict(rope_theta=0.0), "rope_theta must be a positive"),
    (dict(norm_eps=float("nan")), "norm_eps must be a positive"),
])
def test_bad_configurations_are_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LlamaConfig(**{**SMALL, **kw})


def test_config_fields_of_the_wrong_type_are_refused_not_rounded():
    with pytest.raises(TypeError, match="n_kv_head must be an int"):
        LlamaConfig(**{**SMALL, "n_kv_head": 2.0})
    with pytest.raises(TypeError, match="tie_embeddings must be a bool"):
        LlamaConfig(**{**SMALL, "tie_embeddings": "yes"})
    with pytest.raises(TypeError, match="config must be a LlamaConfig"):
        from llmgpu.model import GPTConfig

        Llama(GPTConfig.preset("tiny"), xp=np)
    cfg = LlamaConfig(**SMALL)
    assert LlamaConfig.from_dict(cfg.as_dict()) == cfg
    with pytest.raises(ValueError, match="not a Llama configuration"):
        LlamaConfig.from_dict({**cfg.as_dict(), "arch": "gpt2"})
    from llmgpu.model import GPTConfig

    for config_type, d in ((LlamaConfig, cfg.as_dict()), (GPTConfig, GPTConfig.preset("tiny").as_dict())):
        with pytest.raises(ValueError, match=r"'n_layers' is no field of \w+Config \(n_layer, "):  # left the default
            config_type.from_dict({**d, "n_layers": 3})
        with pytest.raises(TypeError, match="is a dict of its fields, got list"):
            config_type.from_dict([d])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("ids,msg", [
    ([[-1, 5]], r"idx must lie in \[0, 37\); 1 do not \(first: idx\[0, 0\] = -1\)"),
    ([[3, 37]], r"idx must lie in \[0, 37\); 1 do not \(first: idx\[0, 1\] = 37\)"),  # a padding row's id
    ([[2**32 + 7, 5]], "beyond int32's range"),  # narrowed, it would read as id 7
    (np.zeros((1, 0), np.int32), r"idx is empty \(shape \(1, 0\)\)"),
])  # fmt: skip
def test_token_ids_outside_the_vocabulary_are_refused_on_numpy_by_both_families(family, ids, msg):
    """A plain gather reads row -1 as the last row, and int64 ids wrap when narrowed to int32: both gave logits of
    other tokens. Each family's forward, loss and backward refuse them in one line (vocabulary padded to 40 rows:
    id 37 is a padding row, not a token)."""
    from llmgpu.model import GPT, GPTConfig

    m = (Llama(LlamaConfig(**SMALL, pad_vocab_to=8), xp=np) if family == "llama" else
         GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=37, block_size=16, pad_vocab_to=8), xp=np))
    idx = np.asarray(ids, dtype=np.int64)
    for call in (lambda: m.forward(idx), lambda: m.loss(idx, np.zeros(idx.shape, np.int32)),
                 lambda: m.forward_backward(idx, np.zeros(idx.shape, np.int32))):
        with pytest.raises(ValueError, match=msg):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("fast", [False, True], ids=["book", "fast"])
def test_gpu_token_ids_outside_the_vocabulary_turn_the_loss_nan(cp, family, fast):
    """On a GPU the check would cost a host synchronisation: the embedding kernel writes NaN rows for such ids
    instead, so the loss turns NaN (loud), in each family's book and fast model. Llama's gather read id -1 as the
    last (padding) row and a padding row's id as zeros: a finite loss of other tokens."""
    from test_fast_model import _need_fast  # the chapter 8 tests' helper (tests/ is not a package)

    from llmgpu.model import GPT, FastGPT, FastLlama, GPTConfig

    if fast:
        _need_fast(cp)
    cfg = (LlamaConfig(**{**SMALL, "n_embd": 32}, pad_vocab_to=8) if family == "llama" else
           GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=37, block_size=16, pad_vocab_to=8))
    model = {("llama", False): Llama, ("llama", True): FastLlama, ("gpt2", False): GPT, ("gpt2", True): FastGPT}
    m = model[family, fast](cfg, dtype="bf16" if fast else "fp32", xp=cp, seed=2)
    idx = cp.asarray([[3, 5, 7, 9], [1, 2, 4, 6]], dtype=cp.int32)
    assert np.isfinite(float(m.loss(idx, idx)))
    for bad in (-1, 37):  # 37: the first padding row's id
        bad_idx = idx.copy()
        bad_idx[1, 2] = bad
        assert np.isnan(float(m.loss(bad_idx, idx))), bad


def test_llama_loads_the_rope_buffers_older_transformers_saved():
    """``rotary_emb.inv_freq`` is recomputed from the configuration: skipped, as GPT-2's causal-mask buffers are."""
    m = _model()
    sd = {n: np.asarray(a) for n, a in m.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    other = Llama(m.config, dtype="fp64", xp=np, init=False)
    other.load_state_dict(sd)
    assert all(np.array_equal(a, other.state_dict()[n]) for n, a in m.state_dict().items())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_gpu_llama_against_the_float64_model(cp, dtype, tol):
    """The same weights on the GPU (our RMSNorm, RoPE and SwiGLU kernels, cuBLAS, grouped attention): logits, loss
    and every gradient against the float64 NumPy model, relative norm error."""
    ref = _model(tied=False, n_layer=2, n_head=8, n_kv_head=2, n_embd=128, ffn_dim=352, vocab_size=300,
                 block_size=64)
    gpu = Llama(ref.config, dtype=dtype, xp=cp, init=False)
    gpu.load_state_dict(ref.state_dict())
    idx, tg = _batch(ref.config, B=3, T=61)
    for m, x, t in ((ref, idx, tg), (gpu, cp.asarray(idx), cp.asarray(tg))):
        m.zero_grad()
        m.loss_value = float(m.forward_backward(x, t))
    assert gpu.loss_value == pytest.approx(ref.loss_value, rel=tol)
    logits = cp.asnumpy(gpu.forward(cp.asarray(idx))[0]).astype(np.float64)
    want = ref.forward(idx)[0]
    assert np.linalg.norm(logits - want) <= tol * np.linalg.norm(want)
    for n in ref.params.names:
        g, w = cp.asnumpy(gpu.params.grad_of(n)).astype(np.float64), ref.params.grad_of(n)
        assert np.all(np.isfinite(g)), n
        assert np.linalg.norm(g - w) <= 3 * tol * np.linalg.norm(w) + 1e-12, n
