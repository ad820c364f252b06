"""Chapter 6 / 7: the GPT-2 model, its gradients, activation checkpointing, state_dict, PyTorch parity."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.model import GPT, PRESETS, GPTConfig, sample_token
from llmgpu.model.config import gpt2_param_shapes

pytestmark = pytest.mark.ch6

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8)


def _batch(rng, cfg, B=2, T=None, xp=np):
    T = T or cfg.block_size
    idx = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    return backend.to_device(idx, xp), backend.to_device(tgt, xp)


# --------------------------------------------------------------------------- configuration


def test_presets_parameter_counts():
    assert GPTConfig.preset("gpt2").num_parameters() == 124_439_808  # GPT-2 small as nanoGPT counts it
    for name, cfg in PRESETS.items():
        shapes = gpt2_param_shapes(cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size, cfg.block_size)
        assert cfg.num_parameters() == sum(int(np.prod(s)) for s in shapes.values()), name
    assert GPTConfig.preset("d48").num_parameters() == pytest.approx(1.558e9, rel=1e-3)
    assert GPTConfig.preset("gpt2", pad_vocab_to=64).padded_vocab_size == 50304
    assert GPTConfig.preset("tiny").vocab_size == 256
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPTConfig(n_layer=0)


def test_init_is_gpt2_and_seeded():
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=300, block_size=16, pad_vocab_to=128)
    m = GPT(cfg, xp=np, seed=3)
    sd = m.state_dict()
    w = sd["transformer.h.1.mlp.c_fc.weight"]
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    p = sd["transformer.h.2.attn.c_proj.weight"]
    assert abs(p.std() - 0.02 / np.sqrt(8)) < 0.001  # residual projections: 0.02 / sqrt(2 L)
    assert np.all(sd["transformer.h.0.attn.c_attn.bias"] == 0)
    assert np.all(sd["transformer.h.3.ln_2.weight"] == 1) and np.all(sd["transformer.ln_f.bias"] == 0)
    assert sd["transformer.wte.weight"].shape == (384, 64)
    assert np.all(sd["transformer.wte.weight"][300:] == 0)  # padded rows
    m2 = GPT(cfg, xp=np, seed=3)
    m3 = GPT(cfg, xp=np, seed=4)
    assert np.array_equal(m2.params.data, m.params.data)
    assert not np.array_equal(m3.params.data, m.params.data)


# --------------------------------------------------------------------------- gradients


def test_full_gradient_vs_float64_finite_differences(rng):
    """Every parameter tensor: a few coordinates of the analytic gradient (float64 model) against
    central differences, and the fp32 model's analytic gradient against the float64 one."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=16)
    idx, tgt = _batch(rng, cfg, B=2, T=7)
    m64 = GPT(cfg, dtype="fp64", xp=np, seed=11)
    m64.forward_backward(idx, tgt)
    m32 = GPT(cfg, dtype="fp32", xp=np, seed=11)
    m32.forward_backward(idx, tgt)
    P = m64.params
    assert P.data.dtype == np.float64
    eps = 1e-6
    for name in P.names:
        w = P.param(name).reshape(-1)
        g = P.grad_of(name).reshape(-1)
        cand = np.arange(w.size)
        if name == "transformer.wte.weight":  # the padded rows get no gradient; check real ones
            cand = cand[: cfg.vocab_size * cfg.n_embd]
        if name == "transformer.wpe.weight":  # positions >= T are unused (zero gradient)
            cand = cand[: 7 * cfg.n_embd]
        picks = rng.choice(cand, size=min(4, cand.size), replace=False)
        num = []
        for i in picks:
            old = w[i]
            w[i] = old + eps
            lp = float(m64.loss(idx, tgt))
            w[i] = old - eps
            lm = float(m64.loss(idx, tgt))
            w[i] = old
            num.append((lp - lm) / (2 * eps))
        num, ana = np.array(num), g[picks]
        # central differences in float64 are good to ~1e-10 absolute (rounding / eps); relative 1e-5
        diff = np.linalg.norm(num - ana)
        assert diff <= 1e-5 * np.linalg.norm(num) + 1e-9, f"{name}: finite differences disagree: {num} vs {ana}"
        g32 = m32.params.grad_of(name)
        rel = np.linalg.norm(g32 - P.grad_of(name)) / max(np.linalg.norm(P.grad_of(name)), 1e-12)
        assert rel < 1e-4, f"{name}: fp32 gradient off the float64 one by {rel:.2e}"
    wte_g = P.grad_of("transformer.wte.weight")
    assert np.all(wte_g[cfg.vocab_size:] == 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpointing_gives_bitwise_identical_gradients(rng, dtype):
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=8)
    idx, tgt = _batch(rng, cfg, B=3)
    ref = GPT(cfg, dtype=dtype, xp=np, seed=2)
    loss0 = ref.forward_backward(idx, tgt)
    for k in (1, 2, 3, 5, 7):
        m = GPT(cfg, dtype=dtype, xp=np, seed=2, checkpoint_every=k)
        loss = m.forward_backward(idx, tgt)
        assert np.array_equal(loss, loss0)
        assert np.array_equal(m.params.grad, ref.params.grad), f"checkpoint_every={k}"
        assert m.stats["activation_bytes_stored"] < ref.stats["activation_bytes_stored"]
        # the formula of activation_bytes matches what the model actually kept
        est = m.activation_bytes(3, 8)
        assert est["stored"] == m.stats["activation_bytes_stored"]
        assert est["peak"] == m.stats["activation_bytes_peak"]
    assert ref.activation_bytes(3, 8)["stored"] == ref.stats["activation_bytes_stored"]


@pytest.mark.parametrize("k", [0, 2])
def test_keep_returns_the_activation_gradients(rng, k):
    """forward_backward(keep=...) hands out dlogits and each block's output gradient, changes nothing else."""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=8)
    idx, tgt = _batch(rng, cfg, B=3)
    ref, m = GPT(cfg, xp=np, seed=4), GPT(cfg, xp=np, seed=4, checkpoint_every=k)
    ref.forward_backward(idx, tgt, dloss=4.0)
    keep = {}
    m.forward_backward(idx, tgt, dloss=4.0, keep=keep)
    assert np.array_equal(m.params.grad, ref.params.grad)
    assert sorted(keep) == ["dlogits", "h.0", "h.1", "h.2"]
    assert keep["dlogits"].shape == (3 * 8, cfg.padded_vocab_size) and keep["h.1"].shape == (3, 8, 16)
    # dlogits = dloss * (softmax - onehot) / (B*T): each row sums to 0, the padded columns are 0
    assert np.allclose(keep["dlogits"].sum(axis=1), 0, atol=1e-6) and not keep["dlogits"][:, 37:].any()
    # the kept gradients are times dloss, like the weight gradients
    keep1 = {}
    GPT(cfg, xp=np, seed=4).forward_backward(idx, tgt, dloss=1.0, keep=keep1)
    assert np.allclose(keep["h.2"], 4.0 * keep1["h.2"], rtol=1e-5, atol=1e-9)


def test_gradient_accumulation_matches_one_big_batch(rng):
    idx, tgt = _batch(rng, SMALL, B=4)
    one = GPT(SMALL, xp=np, seed=5)
    one.forward_backward(idx, tgt)
    two = GPT(SMALL, xp=np, seed=5)
    for h in (slice(0, 2), slice(2, 4)):
        two.forward_backward(np.ascontiguousarray(idx[h]), np.ascontiguousarray(tgt[h]), dloss=0.5)
    np.testing.assert_allclose(two.params.grad, one.params.grad, rtol=1e-4, atol=1e-6)


def test_vocab_padding_computes_the_same_function(rng):
    plain = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8)
    padded = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=64)
    idx, tgt = _batch(rng, plain)
    a = GPT(plain, xp=np, seed=1)
    b = GPT(padded, xp=np, init=False)
    b.load_state_dict(a.state_dict())  # zero-pads the token embedding
    la = a.forward_backward(idx, tgt)
    lb = b.forward_backward(idx, tgt)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    for name in a.params.names:
        ga, gb = a.params.grad_of(name), b.params.grad_of(name)
        if name == "transformer.wte.weight":
            assert np.all(gb[37:] == 0)
            gb = gb[:37]
        np.testing.assert_allclose(gb, ga, rtol=1e-4, atol=1e-7, err_msg=name)
    logits, _ = b.forward(idx)
    assert logits.shape == (2, 8, 37)


# --------------------------------------------------------------------------- state_dict, forward API


def test_state_dict_names_layouts_and_roundtrip(rng):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=64)
    m = GPT(cfg, xp=np, seed=9)
    sd = m.state_dict()
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (48, 16)  # nn.Linear: [out, in]
    assert sd["transformer.h.0.mlp.c_proj.weight"].shape == (16, 64)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    assert set(sd) == set(gpt2_param_shapes(2, 16, 64, 8)) | {"lm_head.weight"}
    assert all(v.dtype == np.float32 for v in sd.values())
    sd["transformer.wte.weight"][0, 0] += 1.0  # a copy: the model is untouched
    assert m.params.param("transformer.wte.weight")[0, 0] != sd["transformer.wte.weight"][0, 0]
    m2 = GPT(cfg, xp=np, init=False)
    m2.load_state_dict(m.state_dict())
    assert np.array_equal(m2.params.data, m.params.data)
    # unpadded export loads into the padded model; extra keys PyTorch's nanoGPT may carry are ignored
    up = m.state_dict(unpadded=True)
    assert up["transformer.wte.weight"].shape == (37, 16)
    up["transformer.h.0.attn.bias"] = np.ones((1, 1, 8, 8))
    m3 = GPT(cfg, xp=np, init=False)
    m3.load_state_dict(up)
    assert np.array_equal(m3.params.data, m.params.data)
    idx, tgt = _batch(rng, cfg)
    assert np.array_equal(m3.forward(idx, tgt)[0], m.forward(idx, tgt)[0])
    bad = m.state_dict()
    bad["transformer.h.0.ln_1.weight"] = np.ones(17, np.float32)
    with pytest.raises(ValueError, match="shape"):
        m2.load_state_dict(bad)
    del bad["transformer.h.0.ln_1.weight"]
    with pytest.raises(ValueError, match=r"names are not this model's: 1 missing \('transformer.h.0.ln_1.weight'\)$"):
        m2.load_state_dict(bad)
    bad.update({f"extra.{i}": np.ones(2, np.float32) for i in range(5)})
    with pytest.raises(ValueError, match=r"1 missing .*; 5 unexpected \('extra.0', 'extra.1', 'extra.2' and 2 more\)$"):
        m2.load_state_dict(bad)


def test_forward_api_and_bad_inputs(rng):
    m = GPT(SMALL, xp=np, seed=0)
    idx, tgt = _batch(rng, SMALL)
    logits, loss = m.forward(idx, tgt)
    last, _ = m.forward(idx, last_only=True)
    np.testing.assert_allclose(last, logits[:, -1], rtol=1e-5, atol=1e-6)
    assert np.array_equal(loss, m.loss(idx, tgt))
    # the causal mask: changing the last token does not change the earlier logits
    idx2 = idx.copy()
    idx2[:, -1] = (idx2[:, -1] + 1) % SMALL.vocab_size
    l2, _ = m.forward(idx2)
    np.testing.assert_allclose(l2[:, :-1], logits[:, :-1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block_size"):
        m.forward(np.zeros((1, 9), np.int32))
    with pytest.raises(TypeError, match="integer token ids"):
        m.forward(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        m.forward(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="targets must have"):
        m.forward_backward(idx, tgt[:, :4].copy())
    with pytest.raises(ValueError, match="checkpoint_every"):
        GPT(SMALL, xp=np, checkpoint_every=-1)
    with pytest.raises(TypeError, match="checkpoint_every must be 0 .off. or an integer >= 1, got 1.5"):  # was 1
        GPT(SMALL, xp=np, checkpoint_every=1.5)


def test_generate_and_sampling_rules(rng):
    m = GPT(SMALL, xp=np, seed=0)
    a = m.generate([1, 2, 3], 12, temperature=0.9, top_k=5, seed=42)
    b = m.generate([1, 2, 3], 12, temperature=0.9, top_k=5, seed=42)
    assert a == b and len(a) == 15 and a[:3] == [1, 2, 3]
    assert all(0 <= t < SMALL.vocab_size for t in a)
    g0 = m.generate([1, 2], 5, temperature=0.0)
    g1 = m.generate([1, 2], 5, temperature=1.0, top_k=1, seed=7)
    assert g0 == g1  # top-1 sampling is greedy decoding
    logits = np.array([0.0, 5.0, 1.0, 4.0])
    r = np.random.default_rng(0)
    draws = {sample_token(logits, 1.0, 2, r) for _ in range(200)}
    assert draws == {1, 3}
    with pytest.raises(ValueError, match="vocab|\\[0, 37\\)"):
        m.generate([40], 1)
    with pytest.raises(ValueError, match="holds no token"):
        m.generate([], 1)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_matches_numpy_model(cp, rng, dtype):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=101, block_size=32, pad_vocab_to=64)
    idx, tgt = _batch(rng, cfg, B=3, T=29)
    ref = GPT(cfg, dtype="fp32", xp=np, seed=4)
    lr = ref.forward_backward(idx, tgt)
    g = GPT(cfg, dtype=dtype, xp=cp, seed=4)
    lg = g.forward_backward(cp.asarray(idx), cp.asarray(tgt))
    tol = 1e-4 if dtype == "fp32" else 2e-2
    assert abs(float(lg) - float(lr)) / float(lr) < tol
    for name in ref.params.names:
        a, b = cp.asnumpy(g.params.grad_of(name)), ref.params.grad_of(name)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert err < tol * (5 if dtype == "bf16" else 1), f"{name}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_checkpointing_bitwise(cp, rng, dtype):
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=101, block_size=64, pad_vocab_to=64)
    idx, tgt = _batch(rng, cfg, B=4, xp=cp)
    ref = GPT(cfg, dtype=dtype, xp=cp, seed=1)
    ref.forward_backward(idx, tgt)
    g0 = cp.asnumpy(ref.params.grad)
    for k in (1, 2, 3):
        m = GPT(cfg, dtype=dtype, xp=cp, seed=1, checkpoint_every=k)
        m.forward_backward(idx, tgt)
        assert np.array_equal(cp.asnumpy(m.params.grad), g0), f"checkpoint_every={k}"


# --------------------------------------------------------------------------- PyTorch parity (GPU)


def _torch_gpt(torch, cfg):
    """A minimal nanoGPT-style GPT-2 (same names and layouts), built here so the test needs no other code."""
    nn, F = torch.nn, torch.nn.functional

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
            self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
            self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), Attn()
            self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            V = cfg.padded_vocab_size
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(V, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList([Block() for _ in range(cfg.n_layer)]), ln_f=nn.LayerNorm(cfg.n_embd)))
            self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
            self.lm_head.weight = self.transformer.wte.weight  # tied

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
            for b in self.transformer.h:
                x = b(x)
            logits = self.lm_head(self.transformer.ln_f(x))[..., : cfg.vocab_size]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            return logits, loss

    return Net()


def _torch_from(torch, cfg, model, dtype=None):
    net = _torch_gpt(torch, cfg).cuda()
    sd = {k: torch.from_numpy(backend.to_numpy(v)) for k, v in model.state_dict().items()}
    net.load_state_dict(sd)
    return net.to(dtype) if dtype is not None else net


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_gpu_matches_pytorch_logits_loss_gradients(cp, rng, dtype, tol):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: parity test skipped")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=128, vocab_size=211, block_size=64, pad_vocab_to=64)
    m = GPT(cfg, dtype=dtype, xp=cp, seed=7)
    idx, tgt = _batch(rng, cfg, B=4, T=64)
    net = _torch_from(torch, cfg, m, torch.float64)  # the reference in float64
    ti, tt = torch.from_numpy(idx.astype(np.int64)).cuda(), torch.from_numpy(tgt.astype(np.int64)).cuda()
    logits_ref, loss_ref = net(ti, tt)
    loss_ref.backward()
    logits, loss_fwd = m.forward(cp.asarray(idx), cp.asarray(tgt))
    assert _rel(cp.asnumpy(logits.astype(cp.float32)), logits_ref.detach().cpu().numpy()) <= tol
    loss = m.forward_backward(cp.asarray(idx), cp.asarray(tgt))
    assert abs(float(loss) - loss_ref.item()) / loss_ref.item() <= tol
    assert float(loss) == float(loss_fwd)
    grads = dict(net.named_parameters())
    for name in m.params.names:
        ref = grads[name].grad.detach().cpu().numpy()
        err = _rel(cp.asnumpy(m.params.grad_of(name)), ref)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_gpu_ten_adamw_steps_match_pytorch(cp, rng, dtype, tol):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: parity test skipped")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    from llmgpu.optim import AdamW, GradClipper

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=97, block_size=32)
    m = GPT(cfg, dtype=dtype, xp=cp, seed=3)
    net = _torch_from(torch, cfg, m, torch.float64)
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.dim() < 2]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt = AdamW(m.params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    clip = GradClipper(1.0, xp=cp)
    ours, theirs = [], []
    idx, tgt = _batch(rng, cfg, B=4, T=32)  # one batch, seen 10 times: the loss must fall
    for _ in range(10):
        loss = m.forward_backward(cp.asarray(idx), cp.asarray(tgt))
        res = clip(m.params.grad)
        opt.step(grad_scale=res.scale, zero_grad=True)
        ours.append(float(loss))
        topt.zero_grad()
        _, tl = net(torch.from_numpy(idx.astype(np.int64)).cuda(), torch.from_numpy(tgt.astype(np.int64)).cuda())
        tl.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        topt.step()
        theirs.append(tl.item())
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    assert ours[-1] < ours[0]


@pytest.mark.parametrize("field, value", [("n_head", 2.5), ("n_layer", "2"), ("n_embd", 64.0), ("vocab_size", True),
                                          ("block_size", None), ("pad_vocab_to", 1.5)])
def test_config_field_types(field, value):
    """Non-int fields fail at construction with one line naming the field (not later, obscurely)."""
    with pytest.raises(TypeError, match=rf"GPTConfig\.{field} must be an int"):
        GPTConfig(**{field: value})


def test_config_numpy_ints_become_ints():
    cfg = GPTConfig(n_layer=np.int64(2), n_head=np.int32(2), n_embd=32, vocab_size=64, block_size=8)
    assert type(cfg.n_layer) is int and type(cfg.n_head) is int
    assert GPTConfig.from_dict(cfg.as_dict()) == cfg


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tied_model_refuses_an_lm_head_that_differs_from_its_embedding(family):
    """An untied model's weights (lm_head.weight its own matrix) into a tied model: the head was dropped without a
    word. The same head rounded to bf16 or fp16 (a file saved in 16 bits) still loads."""
    from llmgpu.model.llama import Llama
    from llmgpu.model.llama_config import LlamaConfig

    if family == "gpt2":
        m, E = GPT(SMALL, xp=np, seed=0), "transformer.wte.weight"
    else:
        cfg = LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, ffn_dim=24, vocab_size=37, block_size=8)
        m, E = Llama(cfg, xp=np, seed=0), "model.embed_tokens.weight"
    sd = {k: np.asarray(v) for k, v in m.state_dict().items()}
    for dtype in (backend.bfloat16, np.float16):
        m.load_state_dict({**sd, "lm_head.weight": sd[E].astype(dtype)})
    untied = {**sd, "lm_head.weight": sd[E] + np.float32(0.01) * np.ones_like(sd[E])}
    with pytest.raises(ValueError, match=f"lm_head.weight differs from {E}, which this model ties it to"):
        m.load_state_dict(untied)


def test_load_state_dict_refuses_non_float_and_non_finite_weights():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=37, block_size=8)
    m = GPT(cfg, xp=np, seed=0)
    key = "transformer.h.0.mlp.c_fc.weight"
    for dtype in (np.int64, np.int32, np.bool_):
        sd = m.state_dict()
        sd[key] = np.ones(sd[key].shape, dtype)
        with pytest.raises(TypeError, match=key):
            m.load_state_dict(sd)
    sd = m.state_dict()
    sd[key] = sd[key].copy()
    sd[key][0, :3] = [np.nan, np.inf, -np.inf]
    m2 = GPT(cfg, xp=np, init=False)
    with pytest.raises(ValueError, match=rf"{key}.*3 non-finite"):
        m2.load_state_dict(sd)
    m2.load_state_dict(sd, allow_nonfinite=True)  # on request: e.g. to look at a diverged run
    assert np.isnan(m2.params.param(key)[0, 0])
    sd = m.state_dict()
    sd["transformer.wte.weight"] = sd["transformer.wte.weight"].astype(backend.bfloat16)  # 16-bit floats load
    m2.load_state_dict(sd)
